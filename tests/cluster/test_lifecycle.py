"""The job lifecycle under faults, on the real control plane with the operator running.

Refused writes (a ResourceQuota), suspend and resume, ownership against hijacked labels and
same-name re-creation, policy trouble, events and time limits.
"""

from __future__ import annotations

import urllib.request
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from ringwright.devcluster.demo import current_world
from ringwright.kube import ApiError, KubeClient, api_path
from ringwright.operator.api.base import API_VERSION
from ringwright.operator.plan.manifests import INDEX_LABEL, JOB_LABEL, ROLE_LABEL
from ringwright.world import World, world_configmap_name
from tests.cluster.test_operator import events_of, pods_of, wait_world
from tests.jobs import OperatorProcess, get_status, reconciled, tj_path, training_job
from tests.waiting import wait_for

pytestmark = pytest.mark.cluster


def condition(kube: KubeClient, ns: str, name: str, type_: str) -> dict[str, Any] | None:
    conds = get_status(kube, ns, name).get("conditions") or []
    return next((c for c in conds if c["type"] == type_), None)


def events(kube: KubeClient, ns: str, name: str) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = kube.list(api_path("v1", "events", ns),
                                          fieldSelector=f"involvedObject.name={name}")
    return out


def metric(operator: OperatorProcess, name: str, **labels: str) -> float:
    """The sum of a counter's samples whose labels include ``labels``."""
    with urllib.request.urlopen(operator.metrics_url, timeout=10) as response:
        text = response.read().decode()
    return sum(s.value for family in text_string_to_metric_families(text)
               for s in family.samples
               if s.name == f"{name}_total" and labels.items() <= s.labels.items())


def quota(kube: KubeClient, ns: str, hard: dict[str, str]) -> None:
    """A ResourceQuota, once the quota controller has counted what the namespace holds."""
    kube.create(api_path("v1", "resourcequotas", ns),
                {"apiVersion": "v1", "kind": "ResourceQuota", "metadata": {"name": "q"},
                 "spec": {"hard": hard}})
    wait_for(lambda: (kube.get(api_path("v1", "resourcequotas", ns, "q")).get("status") or {})
             .get("used"), "the quota's usage counted")


def test_a_quota_refusal_is_reported_retried_and_the_round_goes_on(
    kube: KubeClient, namespace: str, operator: OperatorProcess
) -> None:
    quota(kube, namespace, {"pods": "3"})
    kube.create(tj_path(namespace), training_job("quota", replicas=4, minimum=2))

    refused = wait_for(lambda: (c := condition(kube, namespace, "quota", "WritesAccepted"))
                       and c["status"] == "False" and c, "WritesAccepted=False")
    assert refused["reason"] == "FailedCreate"
    assert "exceeded quota" in refused["message"]
    warning = wait_for(lambda: next((e for e in events(kube, namespace, "quota")
                                     if e["reason"] == "FailedCreate"), None),
                       "a FailedCreate event")
    assert warning["type"] == "Warning" and "exceeded quota" in warning["message"]
    # The three pods the quota admits still form a world.
    before = wait_world(kube, namespace, "quota", 3)

    # Refused creates are tried again in later rounds (that they wait out a backoff
    # rather than go on every wake-up is tests/unit/operator/test_refusals.py's, and its
    # rate is measured by `bench_operator.py refusals`). Counted in this namespace only:
    # jobs of earlier tests may still be refused while they go.
    refused_here = {"kind": "Pod", "namespace": namespace}
    start = metric(operator, "ringwright_operator_writes_refused", **refused_here)
    wait_for(lambda: metric(operator, "ringwright_operator_writes_refused", **refused_here)
             > start, "the refused create tried again")

    # A member dies: it is still dropped from the world and counted in the status.
    victim = before.members[1]
    kube.delete(api_path("v1", "pods", namespace, victim.pod), grace=0)
    def without_victim() -> World | None:
        world = current_world(kube, namespace, "quota")
        return world if world is not None and world.generation > before.generation \
            and victim.pod_uid not in {m.pod_uid for m in world.members} else None

    after = wait_for(without_victim, "the dead member dropped from the world")
    assert after.size >= 2
    # The status follows (the loss is counted a round before the world settles).
    wait_for(lambda: (s := get_status(kube, namespace, "quota")).get("restarts", 0) >= 1
             and s["world"]["generation"] >= after.generation,
             "the loss and the generation in status")
    # One series for the refusal, however many times it was retried.
    assert sum(1 for e in events(kube, namespace, "quota") if e["reason"] == "FailedCreate") == 1


def test_a_refused_world_does_not_stop_pods_or_status_and_clears_when_allowed(
    kube: KubeClient, namespace: str, operator: OperatorProcess
) -> None:
    # Room for the reports ConfigMap but not the world's. The namespace's root CA ConfigMap is
    # published by the controller manager some time after the namespace is made: count it too.
    configmaps = api_path("v1", "configmaps", namespace)
    wait_for(lambda: "kube-root-ca.crt" in {c["metadata"]["name"] for c in kube.list(configmaps)},
             "the namespace's kube-root-ca.crt published")
    present = len(kube.list(configmaps))
    quota(kube, namespace, {"configmaps": str(present + 1)})
    kube.create(tj_path(namespace), training_job("noroom", replicas=2, minimum=1))

    refused = wait_for(lambda: (c := condition(kube, namespace, "noroom", "WritesAccepted"))
                       and c["status"] == "False" and c, "WritesAccepted=False")
    assert refused["reason"] == "FailedCreate" and "noroom-world" in refused["message"]
    # The rest of the round went on: pods made, the status written from them.
    status = wait_for(lambda: (s := get_status(kube, namespace, "noroom"))
                      .get("workers", {}).get("ready") == 2 and s, "2 ready workers in status")
    assert status["phase"] == "Pending" and current_world(kube, namespace, "noroom") is None

    kube.delete(api_path("v1", "resourcequotas", namespace, "q"))
    wait_world(kube, namespace, "noroom", 2)
    accepted = wait_for(lambda: (c := condition(kube, namespace, "noroom", "WritesAccepted"))
                        and c["status"] == "True" and c, "WritesAccepted=True again")
    assert accepted["reason"] == "Accepted"
    assert wait_for(lambda: get_status(kube, namespace, "noroom").get("phase") == "Running",
                    "Running")


def test_an_admission_policy_refusal_is_reported_and_lifted(
    kube: KubeClient, namespace: str, operator: OperatorProcess
) -> None:
    admission = "admissionregistration.k8s.io/v1"
    name = f"no-gated-pods-{namespace}"
    policies = api_path(admission, "validatingadmissionpolicies")
    bindings = api_path(admission, "validatingadmissionpolicybindings")
    kube.create(policies, {
        "apiVersion": admission, "kind": "ValidatingAdmissionPolicy", "metadata": {"name": name},
        "spec": {"failurePolicy": "Fail", "matchConstraints": {"resourceRules": [{
            "apiGroups": [""], "apiVersions": ["v1"], "operations": ["CREATE"],
            "resources": ["pods"]}]},
            "validations": [{"expression": f"!has(object.metadata.labels) || "
                             f"object.metadata.labels[?'{JOB_LABEL}'].orValue('') != 'gated'",
                             "message": "pods of job gated are not admitted here"}]}})
    kube.create(bindings, {
        "apiVersion": admission, "kind": "ValidatingAdmissionPolicyBinding",
        "metadata": {"name": name},
        "spec": {"policyName": name, "validationActions": ["Deny"], "matchResources": {
            "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": namespace}}}}})
    try:
        # The policy takes effect once the API server has loaded it.
        probe = {"apiVersion": "v1", "kind": "Pod", "metadata": {
            "generateName": "probe-", "labels": {JOB_LABEL: "gated"}},
            "spec": {"containers": [{"name": "c", "image": "busybox"}]}}

        def denied() -> bool:
            try:
                made = kube.create(api_path("v1", "pods", namespace), probe)
            except ApiError:
                return True
            kube.delete(api_path("v1", "pods", namespace, made["metadata"]["name"]), grace=0)
            return False

        wait_for(denied, "the admission policy in force")
        kube.create(tj_path(namespace), training_job("gated", replicas=2, minimum=1))
        refused = wait_for(lambda: (c := condition(kube, namespace, "gated", "WritesAccepted"))
                           and c["status"] == "False" and c, "WritesAccepted=False")
        assert refused["reason"] == "FailedCreate"
        assert "pods of job gated are not admitted here" in refused["message"]
        assert get_status(kube, namespace, "gated")["phase"] == "Pending"
        assert pods_of(kube, namespace, "gated") == []
    finally:
        kube.delete(f"{bindings}/{name}")
        kube.delete(f"{policies}/{name}")
    wait_world(kube, namespace, "gated", 2, timeout=90)
    assert wait_for(lambda: (c := condition(kube, namespace, "gated", "WritesAccepted"))
                    and c["status"] == "True", "WritesAccepted=True again")


def test_suspend_is_not_failure_and_resume_keeps_restarts(
    kube: KubeClient, namespace: str, operator: OperatorProcess
) -> None:
    job = training_job("nap", replicas=8, minimum=8, runPolicy={"backoffLimit": 1})
    job["spec"]["workers"]["template"]["spec"]["terminationGracePeriodSeconds"] = 7
    kube.create(tj_path(namespace), job)
    first = wait_world(kube, namespace, "nap", 8, timeout=120)
    held = first.members[3].pod
    # A finalizer of the test's keeps one pod visible while it terminates; released even
    # when the test fails, or the namespace (and every later placement test) never empties.
    held_path = api_path("v1", "pods", namespace, held)
    kube.merge_patch(held_path, {"metadata": {"finalizers": ["test.ringwright.dev/hold"]}})
    try:
        restarts = get_status(kube, namespace, "nap").get("restarts", 0)
        kube.merge_patch(tj_path(namespace, "nap"), {"spec": {"runPolicy": {"suspend": True}}})
        empty = wait_world(kube, namespace, "nap", size=None, after=first.generation)
        assert empty.size == 0  # members learn they are out before their pods go
        terminating = wait_for(lambda: (p := kube.get(held_path))["metadata"].get(
            "deletionTimestamp") and p, "the held pod deleted")
        # Deleted with its own grace period: SIGTERM, and time to write the checkpoint.
        assert terminating["metadata"]["deletionGracePeriodSeconds"] == 7
    finally:
        if kube.get_or_none(held_path) is not None:
            kube.merge_patch(held_path, {"metadata": {"finalizers": None}})
    wait_for(lambda: not pods_of(kube, namespace, "nap"), "every pod gone")
    wait_for(lambda: get_status(kube, namespace, "nap").get("phase") == "Suspended",
             "phase Suspended")
    # A round that saw every pod gone, while suspended: still nothing lost.
    suspended = reconciled(kube, namespace, "nap")
    assert suspended["phase"] == "Suspended" and suspended["restarts"] == restarts

    kube.merge_patch(tj_path(namespace, "nap"), {"spec": {"runPolicy": {"suspend": False}}})
    resumed = wait_world(kube, namespace, "nap", 8, after=empty.generation, timeout=120)
    status = wait_for(lambda: (s := get_status(kube, namespace, "nap"))
                      .get("phase") == "Running" and s, "Running again")
    assert status["restarts"] == restarts
    assert not {m.pod_uid for m in resumed.members} & {m.pod_uid for m in first.members}
    phases = [h["phase"] for h in status["phaseHistory"]]
    assert phases[-4:] == ["Running", "Suspended", "Pending", "Running"]
    reasons = events_of(kube, namespace, "nap")
    assert {"Suspended", "Resumed"} <= set(reasons) and "MemberLost" not in reasons


def test_a_foreign_pod_with_the_job_label_is_not_a_member(
    kube: KubeClient, namespace: str, operator: OperatorProcess
) -> None:
    kube.create(tj_path(namespace), training_job("victim", replicas=2, minimum=1))
    before = wait_world(kube, namespace, "victim", 2)
    node = before.members[0].node
    kube.create(api_path("v1", "pods", namespace), {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "intruder", "labels": {
            JOB_LABEL: "victim", ROLE_LABEL: "worker", INDEX_LABEL: "7"}},
        "spec": {"nodeName": node, "containers": [{"name": "c", "image": "busybox"}]}})
    wait_for(lambda: any(c["type"] == "Ready" and c["status"] == "True" for c in
                         (kube.get(api_path("v1", "pods", namespace, "intruder"))
                          .get("status") or {}).get("conditions") or []), "intruder Ready")
    # A round that began after the intruder was Ready: the world is as it was, and no
    # other membership waits out its settle window to be published later.
    status = reconciled(kube, namespace, "victim")
    assert not status.get("candidate"), status
    after = current_world(kube, namespace, "victim")
    assert after is not None and after.generation == before.generation
    assert "intruder" not in {m.pod for m in after.members}
    assert status["workers"]["ready"] == 2
    assert kube.get_or_none(api_path("v1", "pods", namespace, "intruder")) is not None


def test_a_job_recreated_under_the_same_name_starts_clean(
    kube: KubeClient, namespace: str, operator: OperatorProcess
) -> None:
    kube.create(tj_path(namespace), training_job("again", replicas=3, minimum=1))
    wait_world(kube, namespace, "again", 3)
    # Scale down once so the old world is past generation 1.
    kube.merge_patch(tj_path(namespace, "again", "scale"), {"spec": {"replicas": 2}})
    old = wait_world(kube, namespace, "again", 2, after=1)
    wait_for(lambda: len(pods_of(kube, namespace, "again")) == 2, "the leaving pod gone")
    old_uids = {p["metadata"]["uid"] for p in pods_of(kube, namespace, "again")}
    old_job = kube.get(tj_path(namespace, "again"))["metadata"]["uid"]
    # The test's finalizers keep an old pod and the old world around (as a slow garbage
    # collector would) while the new job starts.
    held = [api_path("v1", "pods", namespace, old.members[0].pod),
            api_path("v1", "configmaps", namespace, world_configmap_name("again"))]
    for path in held:
        kube.merge_patch(path, {"metadata": {"finalizers": ["test.ringwright.dev/hold"]}})
    try:
        kube.delete(tj_path(namespace, "again"))
        wait_for(lambda: kube.get_or_none(tj_path(namespace, "again")) is None, "job deleted")
        kube.create(tj_path(namespace), training_job("again", replicas=2, minimum=1))
        new_job = kube.get(tj_path(namespace, "again"))["metadata"]["uid"]
        assert new_job != old_job
        fresh = wait_for(lambda: (w := current_world(kube, namespace, "again")) is not None
                         and w.job.uid == new_job and w, "the new job's world", timeout=120)
        assert fresh.generation == 1 < old.generation  # a new job, a new history
        assert not {m.pod_uid for m in fresh.members} & old_uids
    finally:  # released even when the test fails, or the namespace never empties
        for path in held:
            if kube.get_or_none(path) is not None:
                kube.merge_patch(path, {"metadata": {"finalizers": None}})
    wait_for(lambda: (w := current_world(kube, namespace, "again")) is not None and w.size == 2
             and w.job.uid == new_job and not {m.pod_uid for m in w.members} & old_uids,
             "both new workers in the world", timeout=120)
    status = get_status(kube, namespace, "again")
    told = [f"{e['reason']}: {e['message']}" for e in events(kube, namespace, "again")
            if e["involvedObject"].get("uid") == new_job]
    assert status.get("restarts", 0) == 0, told


def test_a_running_job_keeps_its_lifecycle_when_its_policy_goes(
    kube: KubeClient, namespace: str, operator: OperatorProcess
) -> None:
    policies = api_path(API_VERSION, "schedulingpolicies")
    policy = f"p-{namespace}"
    default = kube.get(f"{policies}/default")
    kube.create(policies, {"apiVersion": API_VERSION, "kind": "SchedulingPolicy",
                           "metadata": {"name": policy}, "spec": default["spec"]})
    try:
        kube.create(tj_path(namespace), training_job("orphan", replicas=3, minimum=1,
                                                     schedulingPolicyName=policy))
        before = wait_world(kube, namespace, "orphan", 3)
        kube.delete(f"{policies}/{policy}")
        gone = wait_for(lambda: (c := condition(kube, namespace, "orphan", "PolicyFound"))
                        and c["status"] == "False" and c, "PolicyFound=False")
        assert gone["reason"] == "PolicyNotFound"

        # A member dies: still dropped and counted, though nothing can be placed.
        victim = before.members[2]
        kube.delete(api_path("v1", "pods", namespace, victim.pod), grace=0)
        after = wait_world(kube, namespace, "orphan", 2, after=before.generation)
        assert victim.pod not in {m.pod for m in after.members}
        assert wait_for(lambda: get_status(kube, namespace, "orphan").get("restarts") == 1,
                        "the loss counted")
        # Suspend still works.
        kube.merge_patch(tj_path(namespace, "orphan"),
                         {"spec": {"runPolicy": {"suspend": True}}})
        wait_for(lambda: get_status(kube, namespace, "orphan").get("phase") == "Suspended"
                 and not pods_of(kube, namespace, "orphan"), "suspended without pods")
    finally:
        kube.delete(f"{policies}/{policy}")


def test_a_job_that_never_fits_times_out_with_a_reason_and_warns_once(
    kube: KubeClient, namespace: str, operator: OperatorProcess
) -> None:
    job = training_job("never", replicas=40, minimum=40, gpusPerWorker=8,
                       runPolicy={"activeDeadlineSeconds": 8})
    job["spec"]["workers"]["max"] = 40
    kube.create(tj_path(namespace), job)
    status = wait_for(lambda: (s := get_status(kube, namespace, "never"))
                      .get("phase") == "Failed" and s, "phase Failed", timeout=90)
    failed = next(c for c in status["conditions"] if c["type"] == "Failed")
    assert failed["reason"] == "NeverSchedulable"
    assert "activeDeadlineSeconds" in failed["message"] and "40" in failed["message"]
    assert pods_of(kube, namespace, "never") == []
    # Several resyncs passed while it waited: each warning reason is one Event series.
    warnings = [e for e in events(kube, namespace, "never") if e["type"] == "Warning"]
    reasons = [e["reason"] for e in warnings]
    assert "NeverSchedulable" in reasons
    assert len(reasons) == len(set(reasons)), reasons
