"""The objects that isolate a job: its join-token Secret, the mount, its NetworkPolicy."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from ringwright.kube import ApiError
from ringwright.objects import Obj
from ringwright.operator.apply.events import EventRecorder
from ringwright.operator.apply.executor import Applier
from ringwright.operator.observe.cache import Written
from ringwright.operator.observe.ledger import CapacityLedger
from ringwright.operator.plan.isolation import (
    JOIN_TOKEN_DIR,
    harden,
    join_token_secret,
    network_policy,
    new_token,
)
from ringwright.operator.plan.manifests import JOB_LABEL, READINESS_PORT, pod
from ringwright.operator.settings import OperatorSettings
from ringwright.world import DEFAULT_METRICS_PORT, Env

JOB: Obj = {
    "apiVersion": "ringwright.dev/v1alpha1", "kind": "TrainingJob",
    "metadata": {"name": "tj", "namespace": "ns", "uid": "uid-tj"},
    "spec": {"workers": {"min": 1, "replicas": 2, "template": {"spec": {"containers": [
        {"name": "train", "image": "img"},
        {"name": "sidecar", "image": "side"}]}}}},
}


def test_tokens_are_random_and_the_secret_is_owned_by_the_job() -> None:
    assert new_token() != new_token() and len(new_token()) >= 43
    secret = join_token_secret(JOB, "t0k")
    assert secret["metadata"]["name"] == "tj-join-token"
    assert secret["metadata"]["ownerReferences"][0]["uid"] == "uid-tj"
    assert secret["stringData"] == {"token": "t0k"}


def test_the_token_is_mounted_into_the_training_container_only() -> None:
    built = harden(JOB, pod(JOB, "worker", 0, {}))
    spec = built["spec"]
    volume = next(v for v in spec["volumes"] if v["name"] == "ringwright-join-token")
    assert volume["secret"]["secretName"] == "tj-join-token"
    train, sidecar = spec["containers"]
    assert [m["mountPath"] for m in train["volumeMounts"]] == ["/dev/shm", JOIN_TOKEN_DIR]
    assert "volumeMounts" not in sidecar
    env = {e["name"]: e.get("value") for e in train["env"]}
    assert env[Env.JOIN_TOKEN_FILE] == f"{JOIN_TOKEN_DIR}/token"
    # Building twice (a template that already carries it) keeps one of each.
    again = harden(JOB, built)["spec"]
    assert len(again["volumes"]) == 2 and len(again["containers"][0]["volumeMounts"]) == 2


def test_the_policy_admits_own_pods_everywhere_the_operator_to_readiness_anyone_to_metrics(
) -> None:
    policy = network_policy(JOB, "ringwright-system")
    spec = policy["spec"]
    assert spec["podSelector"] == {"matchLabels": {JOB_LABEL: "tj"}}
    assert spec["policyTypes"] == ["Ingress"]
    own, operator, metrics = spec["ingress"]
    assert own == {"from": [{"podSelector": {"matchLabels": {JOB_LABEL: "tj"}}}]}
    assert operator["ports"] == [{"protocol": "TCP", "port": READINESS_PORT}]
    assert operator["from"][0]["namespaceSelector"]["matchLabels"] == {
        "kubernetes.io/metadata.name": "ringwright-system"}
    assert metrics == {"ports": [{"protocol": "TCP", "port": DEFAULT_METRICS_PORT}]}
    assert policy["metadata"]["ownerReferences"][0]["uid"] == "uid-tj"
    # Outside the cluster the operator has no pods to admit.
    assert len(network_policy(JOB, "")["spec"]["ingress"]) == 2


class ScaffoldWrites:
    """What the applier sends, by kind; the Secret's create answers 409 when told to."""

    def __init__(self, secret_exists: bool = False) -> None:
        self.applied: list[str] = []
        self.created: list[Obj] = []
        self.secret_exists = secret_exists

    def apply(self, path: str, body: Obj) -> Obj:
        self.applied.append(body["kind"])
        return body

    def create(self, path: str, body: Obj) -> Obj:
        self.created.append(body)
        if self.secret_exists:
            raise ApiError(409, "AlreadyExists", "exists", path)
        return body


def nothing_seen(kind: str, namespace: str, name: str) -> Obj | None:
    """The watch cache of a scaffold not made yet."""
    return None


def applier(writes: ScaffoldWrites, **settings: Any) -> Applier:
    kube: Any = writes
    return Applier(kube, lambda: 0.0, pool=ThreadPoolExecutor(1),
                   events=EventRecorder(kube, lambda: 0.0), ledger=CapacityLedger(),
                   written=Written(), settings=OperatorSettings(**settings))


@pytest.mark.parametrize("enabled", [True, False])
def test_the_scaffold_carries_the_policy_when_enabled_and_creates_the_token_once(
        enabled: bool) -> None:
    writes = ScaffoldWrites()
    apply = applier(writes, network_policy=enabled)
    apply.ensure_scaffold(JOB, nothing_seen)
    apply.ensure_scaffold(JOB, nothing_seen, force=True)  # the token stays as created
    assert ("NetworkPolicy" in writes.applied) is enabled
    assert [c["kind"] for c in writes.created] == ["Secret"]
    assert writes.created[0]["metadata"]["name"] == "tj-join-token"


def test_an_existing_token_is_kept() -> None:
    writes = ScaffoldWrites(secret_exists=True)
    assert applier(writes).ensure_scaffold(JOB, nothing_seen) == []
    assert "ServiceAccount" in writes.applied  # the 409 is not an error


class MeetingWrites(ScaffoldWrites):
    """Every write waits until all ``parties`` writes are in flight together."""

    def __init__(self, parties: int) -> None:
        super().__init__()
        self.barrier = threading.Barrier(parties, timeout=30)

    def apply(self, path: str, body: Obj) -> Obj:
        self.barrier.wait()
        return super().apply(path, body)

    def create(self, path: str, body: Obj) -> Obj:
        self.barrier.wait()
        return super().create(path, body)


def test_a_new_jobs_scaffold_is_written_all_at_once() -> None:
    # The token Secret and the five scaffold objects with the NetworkPolicy: one after
    # another, the first would wait for the others forever (a broken barrier here).
    writes = MeetingWrites(parties=7)
    kube: Any = writes
    apply = Applier(kube, lambda: 0.0, pool=ThreadPoolExecutor(8),
                    events=EventRecorder(kube, lambda: 0.0), ledger=CapacityLedger(),
                    written=Written(), settings=OperatorSettings())
    assert apply.ensure_scaffold(JOB, nothing_seen) == []
    assert sorted(writes.applied) == sorted(
        ["ServiceAccount", "Role", "RoleBinding", "Service", "ConfigMap", "NetworkPolicy"])
    assert [c["kind"] for c in writes.created] == ["Secret"]
