"""Parameter-server pods as the operator builds them: Guaranteed with whole CPUs in every
container, their own readiness probe, and their membership changes reaching the world."""

from __future__ import annotations

from typing import Any

from ringwright.objects import Obj
from ringwright.operator.api.conditions import rfc3339
from ringwright.operator.api.models import TrainingJobSpec
from ringwright.operator.api.schedulingpolicy import SchedulingPolicySpec
from ringwright.operator.plan.manifests import (
    HEALTH_FILE,
    INDEX_LABEL,
    JOB_LABEL,
    PS,
    ROLE_LABEL,
    WORKER,
    pod,
)
from ringwright.operator.plan.placement.placer import place
from ringwright.operator.plan.placement.resources import millicores
from ringwright.operator.plan.reconcile import Observed, plan
from ringwright.world import Member, World
from tests.unit.operator.test_placement import inventory, rack
from tests.unit.operator.test_reconcile import NODES, NOW, SETTINGS, FakePlacer, world_of

PS_TEMPLATE: Obj = {"spec": {
    "initContainers": [{"name": "fetch", "image": "busybox",
                        "resources": {"requests": {"cpu": "100m"}}}],
    "containers": [
        {"name": "ps", "image": "img", "resources": {"requests": {"cpu": "1500m",
                                                                 "memory": "2Gi"}}},
        {"name": "sidecar", "image": "img",
         "resources": {"requests": {"cpu": "250m"}, "limits": {"cpu": "2", "memory": "1Gi"}}},
        {"name": "bare", "image": "img"},
    ]}}


def ps_job(**spec: Any) -> Obj:
    return {
        "apiVersion": "ringwright.dev/v1alpha1", "kind": "TrainingJob",
        "metadata": {"name": "tj", "namespace": "ns", "uid": "uid-tj", "generation": 1},
        "spec": {"mode": "ParameterServer",
                 "workers": {"min": 1, "replicas": 2, "template": {"spec": {
                     "containers": [{"name": "train", "image": "img"}]}}},
                 "ps": {"replicas": 2, "template": PS_TEMPLATE}, **spec},
    }


def ps_pods() -> list[Obj]:
    body = ps_job()
    spec = TrainingJobSpec.model_validate(body["spec"])
    placed = place(spec, SchedulingPolicySpec(), inventory(rack("r", 4)), [])
    assert len(placed.ps) == 2, placed
    return [pod(body, PS, i, fragment) for i, fragment in enumerate(placed.ps)]


def test_every_container_of_a_ps_pod_is_guaranteed_with_whole_cpus() -> None:
    for built in ps_pods():
        containers = built["spec"]["initContainers"] + built["spec"]["containers"]
        assert [c["name"] for c in containers] == ["fetch", "ps", "sidecar", "bare"]
        for c in containers:
            res = c["resources"]
            assert res["requests"] == res["limits"], c["name"]  # Guaranteed
            assert millicores(res["requests"]["cpu"]) % 1000 == 0, c["name"]  # whole CPUs
            assert "memory" in res["requests"], c["name"]
        cpus = {c["name"]: c["resources"]["requests"]["cpu"] for c in containers}
        assert cpus == {"fetch": "1", "ps": "2", "sidecar": "2", "bare": "4"}


def test_a_ps_is_ready_by_its_health_file_and_a_worker_by_the_runtimes_endpoint() -> None:
    built = ps_pods()[0]
    main = built["spec"]["containers"][0]
    # Not a TCP connect to the shard port: a wedged PS still accepts connections there.
    # The PS's stall watchdog keeps the health file only while requests get served.
    assert main["readinessProbe"]["exec"] == {"command": ["test", "-f", HEALTH_FILE]}
    env = {e["name"]: e.get("value") for e in main["env"]}
    assert env["RINGWRIGHT_HEALTH_FILE"] == HEALTH_FILE
    body = ps_job()
    spec = TrainingJobSpec.model_validate(body["spec"])
    placed = place(spec, SchedulingPolicySpec(), inventory(rack("r", 4)), [])
    worker = pod(body, WORKER, 0, placed.workers[0])
    assert worker["spec"]["containers"][0]["readinessProbe"]["httpGet"]["path"] == "/readyz"


def _pod(role: str, index: int, uid: str, ready: bool = True) -> Obj:
    return {
        "metadata": {"name": f"tj-{role}-{index}", "uid": uid,
                     "labels": {JOB_LABEL: "tj", ROLE_LABEL: role, INDEX_LABEL: str(index)}},
        "spec": {"nodeName": "rack-0-node-0"},
        "status": {"phase": "Running", "podIP": f"127.20.{index}.{len(uid)}",
                   "conditions": [{"type": "Ready", "status": "True" if ready else "False",
                                   "lastTransitionTime": rfc3339(NOW)}]},
    }


def _world(ps_uids: list[str]) -> World:
    base = world_of([0, 1])
    ps = tuple(Member(rank=i, pod=f"tj-ps-{i}", pod_uid=uid, ip=f"127.20.{i}.{len(uid)}")
               for i, uid in enumerate(ps_uids))
    return base.model_copy(update={"ps": ps, "ps_replicas": 2, "mode": "ParameterServer"})


def _plan(pods: list[Obj], world: World) -> Any:
    workers = [_pod(WORKER, i, f"u{i}") for i in range(2)]
    for w in workers:
        w["status"]["podIP"] = f"127.10.0.{int(w['metadata']['labels'][INDEX_LABEL]) + 1}"
    observed = Observed(job=ps_job(status={"phase": "Running", "world": {"generation": 1}}),
                        pods=workers + pods, world=world, reports={},
                        policy=SchedulingPolicySpec(), inventory=NODES)
    return plan(observed, SETTINGS, NOW, FakePlacer())


def test_a_replaced_ps_reaches_the_world_in_a_new_generation() -> None:
    # tj-ps-1 came back as a new pod (new uid, new address): the world must say so.
    decided = _plan([_pod(PS, 0, "p0"), _pod(PS, 1, "p1-new")], _world(["p0", "p1-old"]))
    assert decided.world is not None and decided.world.generation == 2
    assert [(m.pod, m.pod_uid) for m in decided.world.ps] == [("tj-ps-0", "p0"),
                                                              ("tj-ps-1", "p1-new")]


def test_a_ps_that_is_not_ready_leaves_the_world() -> None:
    decided = _plan([_pod(PS, 0, "p0"), _pod(PS, 1, "p1", ready=False)], _world(["p0", "p1"]))
    assert decided.world is not None
    assert [m.pod for m in decided.world.ps] == ["tj-ps-0"]


def test_an_unchanged_ps_membership_publishes_nothing() -> None:
    decided = _plan([_pod(PS, 0, "p0"), _pod(PS, 1, "p1")], _world(["p0", "p1"]))
    assert decided.world is None


def test_a_ready_ps_worker_joins_without_an_announcement() -> None:
    # Its peers do not wait for it (each pushes to the servers on its own), and a PS
    # worker waits for a world that lists it without reporting.
    decided = _plan([_pod(PS, 0, "p0"), _pod(PS, 1, "p1")],
                    _world(["p0", "p1"]).model_copy(update={"members": world_of([0]).members}))
    assert decided.world is not None and decided.world.size == 2


def _slow_ps(started: float, ready_changed: float) -> Obj:
    """tj-ps-1 Running and not Ready since its ``ps`` container started at ``started``."""
    body = _pod(PS, 1, "p1", ready=False)
    body["spec"]["containers"] = PS_TEMPLATE["spec"]["containers"]
    body["status"]["conditions"][0]["lastTransitionTime"] = rfc3339(ready_changed)
    body["status"]["containerStatuses"] = [
        {"name": name, "restartCount": 0, "state": {"running": {"startedAt": rfc3339(at)}}}
        for name, at in (("sidecar", NOW - 900), ("ps", started))]
    return body


def test_a_slow_starting_ps_gets_the_ps_startup_grace() -> None:
    def decide(grace: int) -> Any:
        body = ps_job(status={"phase": "Running", "world": {"generation": 1}})
        body["spec"]["ps"]["startupGraceSeconds"] = grace
        workers = [_pod(WORKER, i, f"u{i}") for i in range(2)]
        observed = Observed(job=body, pods=[*workers, _pod(PS, 0, "p0"),
                                            _slow_ps(started=NOW - 120, ready_changed=NOW - 400)],
                            world=_world(["p0", "p1"]), reports={},
                            policy=SchedulingPolicySpec(), inventory=NODES)
        return plan(observed, SETTINGS, NOW, FakePlacer())

    # Unready past the policy's 60 s, but its container started 120 s ago, within 300 s
    # of grace (the sidecar's earlier start does not count): kept.
    assert decide(300).delete == []
    # With 30 s of grace, 30 + 60 s after the container's start: lost.
    lost = decide(30)
    assert lost.delete == ["tj-ps-1"]
    assert "MemberNeverReady" in [e.reason for e in lost.events]
