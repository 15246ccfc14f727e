"""The operator's lifecycle under faults, on the real control plane: lost or corrupted
worlds, operator restarts, lost nodes, control-plane restarts."""

from __future__ import annotations

import functools
import random
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from ringwright.devcluster.control_plane import NODE_DOWN_ANNOTATION, Cluster
from ringwright.devcluster.demo import current_world
from ringwright.kube import ApiError, KubeClient, RetryPolicy, api_path, load_kubeconfig
from ringwright.operator.api.base import API_VERSION
from ringwright.operator.api.conditions import rfc3339
from ringwright.operator.api.schedulingpolicy import (
    NodeLoss,
    SchedulingPolicy,
    SchedulingPolicySpec,
)
from ringwright.operator.apply.events import EventRecorder
from ringwright.operator.apply.executor import Applier
from ringwright.operator.observe.cache import Written
from ringwright.operator.observe.ledger import CapacityLedger
from ringwright.operator.plan.generations import GENERATION_ANNOTATION
from ringwright.operator.plan.health.nodeloss import NOT_READY_TAINT, UNREACHABLE_TAINT
from ringwright.operator.plan.manifests import INDEX_LABEL, JOB_LABEL, ROLE_LABEL
from ringwright.operator.plan.reconcile import Plan
from ringwright.runtime.membership.kube_source import KubeMembershipSource
from ringwright.world import ContractError, World, parse_world, world_configmap_name
from tests.cluster.test_operator import events_of, wait_world, world_now
from tests.jobs import OperatorProcess, get_status, reconciled, tj_path, training_job
from tests.waiting import wait_for

pytestmark = pytest.mark.cluster


@pytest.fixture()
def follower(cluster: Cluster) -> Iterator[Any]:
    """Makes runtime membership sources (the pods' own watch code) and closes them."""
    sources: list[KubeMembershipSource] = []

    def make(namespace: str, job: str) -> KubeMembershipSource:
        source = KubeMembershipSource(cluster.client, namespace, world_configmap_name(job))
        sources.append(source)
        return source

    yield make
    for source in sources:
        source.close()


def _world_path(namespace: str, job: str) -> str:
    return api_path("v1", "configmaps", namespace, world_configmap_name(job))


def readable_world(kube: KubeClient, namespace: str, job: str) -> World | None:
    """The job's world, or None while it is missing or unreadable."""
    cm = kube.get_or_none(_world_path(namespace, job))
    try:
        return parse_world(((cm or {}).get("data") or {}).get("world.json") or "")
    except ContractError:
        return None


def wait_readable_world(kube: KubeClient, namespace: str, job: str, size: int, after: int,
                        timeout: float = 30) -> World:
    """A readable world of ``size`` members above generation ``after``."""
    def probe() -> World | None:
        world = readable_world(kube, namespace, job)
        return world if world is not None and world.size == size and world.generation > after \
            else None

    return wait_for(probe, f"a readable world of size {size} after generation {after}",
                    timeout=timeout)


def test_generations_only_go_up_across_a_deleted_or_corrupted_world_and_operator_restarts(
    kube: KubeClient, namespace: str, operator: OperatorProcess, follower: Any,
) -> None:
    kube.create(tj_path(namespace), training_job("generations", replicas=2, minimum=1))
    first = wait_world(kube, namespace, "generations", 2)
    runtime = follower(namespace, "generations")
    wait_for(lambda: (w := runtime.latest()) is not None and w.generation >= first.generation,
             "the runtime to follow the first world")
    generations = [first.generation]

    def next_world(what: str) -> None:
        world = wait_readable_world(kube, namespace, "generations", 2, after=generations[-1])
        generations.append(world.generation)
        # The pods' watch code takes it: the new generation is above the one it follows.
        wait_for(lambda: (w := runtime.latest()) is not None and w.generation == world.generation,
                 f"the runtime to follow generation {world.generation} after {what}", timeout=30)
        status = wait_for(lambda: (s := get_status(kube, namespace, "generations"))
                          .get("world", {}).get("generation") == world.generation and s,
                          f"status to mirror generation {world.generation}")
        assert status["phase"] == "Running"

    try:
        kube.delete(_world_path(namespace, "generations"))
        next_world("the world ConfigMap was deleted")

        kube.merge_patch(_world_path(namespace, "generations"),
                         {"data": {"world.json": "{not a world"}})
        next_world("the world document was corrupted")

        # Corrupted document and annotation, while the operator is down: the status still
        # remembers the generation.
        operator.kill()
        kube.merge_patch(_world_path(namespace, "generations"), {
            "metadata": {"annotations": {GENERATION_ANNOTATION: "garbage"}},
            "data": {"world.json": "[]"}})
        operator.start()
        next_world("a corrupted world met a restarted operator")

        operator.kill()
        kube.delete(_world_path(namespace, "generations"))
        operator.start()
        next_world("the world was deleted while the operator was down")

        # Another writer published far ahead: the operator's next world goes above it.
        kube.merge_patch(_world_path(namespace, "generations"), {
            "metadata": {"annotations": {GENERATION_ANNOTATION: str(generations[-1] + 50)}},
            "data": {"world.json": "{}"}})
        next_world("another writer went ahead")
        assert generations[-1] > generations[-2] + 50
    except AssertionError as err:
        raise AssertionError(f"{err}\ngenerations {generations}\noperator log:\n{operator.tail(40)}"
                             ) from err
    assert generations == sorted(set(generations)), generations


def test_a_world_write_over_a_stale_version_is_refused(
    kube: KubeClient, namespace: str, operator: OperatorProcess,
) -> None:
    """The operator's world write, against the real API server: a plan decided from an
    older version of the world gets 409 and changes nothing."""
    kube.create(tj_path(namespace), training_job("fenced", replicas=1, minimum=1))
    world = wait_world(kube, namespace, "fenced", 1)
    job = kube.get(tj_path(namespace, "fenced"))
    current = kube.get(_world_path(namespace, "fenced"))
    other = world.model_copy(update={"generation": world.generation + 1, "members": ()})
    with ThreadPoolExecutor(2) as pool:
        applier = Applier(kube, time.time, pool=pool, events=EventRecorder(kube, time.time),
                          ledger=CapacityLedger(), written=Written())
        stale = str(int(current["metadata"]["resourceVersion"]) - 1)
        for version in (stale, ""):  # an older version; "none exists" when one does
            with pytest.raises(ApiError) as refused:
                applier.perform(job, Plan(world=other, world_version=version))
            assert refused.value.status == 409
    after = current_world(kube, namespace, "fenced")
    assert after is not None and after.generation == world.generation and after.size == 1


@pytest.fixture()
def fast_node_loss(kube: KubeClient, namespace: str) -> Iterator[str]:
    """A SchedulingPolicy of this test's own that gives up on lost nodes in seconds."""
    name = f"{namespace}-node-loss"
    policy = SchedulingPolicy(metadata={"name": name}, spec=SchedulingPolicySpec(
        node_loss=NodeLoss(toleration_seconds=10, unready_seconds=4)))
    kube.create(api_path(API_VERSION, "schedulingpolicies"), policy.to_wire())
    yield name
    kube.delete(api_path(API_VERSION, "schedulingpolicies", name=name))


def _set_node_down(kube: KubeClient, node: str, down: bool) -> None:
    kube.merge_patch(api_path("v1", "nodes", name=node),
                     {"metadata": {"annotations": {NODE_DOWN_ANNOTATION: "true" if down
                                                   else None}}})


def test_a_member_on_a_lost_node_is_replaced_on_another_node(
    kube: KubeClient, namespace: str, operator: OperatorProcess, fast_node_loss: str,
) -> None:
    kube.create(tj_path(namespace), training_job("nodeloss", replicas=3, minimum=2,
                                                 schedulingPolicyName=fast_node_loss))
    before = wait_world(kube, namespace, "nodeloss", 3)
    victim = before.members[1]
    pod = kube.get(api_path("v1", "pods", namespace, victim.pod))
    tolerations = {t["key"]: t.get("tolerationSeconds") for t in pod["spec"]["tolerations"]
                   if t.get("effect") == "NoExecute"}
    assert tolerations == {NOT_READY_TAINT: 10, UNREACHABLE_TAINT: 10}

    _set_node_down(kube, victim.node, True)
    try:
        # KWOK reports the node NotReady; the node lifecycle controller taints it.
        wait_for(lambda: any(t["key"] == NOT_READY_TAINT for t in kube.get(
            api_path("v1", "nodes", name=victim.node))["spec"].get("taints") or ()),
            "the node lifecycle controller to taint the lost node", timeout=30)
        healed = wait_world(kube, namespace, "nodeloss", 3, after=before.generation, timeout=60)
        replacement = next(m for m in healed.members if m.pod == victim.pod)
        assert replacement.pod_uid != victim.pod_uid and replacement.node != victim.node
        status = wait_for(lambda: (s := get_status(kube, namespace, "nodeloss"))
                          .get("phase") == "Running" and s, "the job to be Running again")
        # Every pod on the lost node counts once.
        assert status["restarts"] == sum(1 for m in before.members if m.node == victim.node)
        assert "NodeNotReady" in events_of(kube, namespace, "nodeloss")
    except AssertionError as err:
        raise AssertionError(f"{err}\noperator log:\n{operator.tail(40)}") from err
    finally:
        _set_node_down(kube, victim.node, False)


def _ago(seconds: float) -> str:
    """An RFC 3339 time ``seconds`` before now, as the kubelet writes it."""
    return rfc3339(time.time() - seconds)


def test_an_unready_member_is_replaced_and_crash_loops_show_and_count(
    kube: KubeClient, namespace: str, operator: OperatorProcess, fast_node_loss: str,
) -> None:
    kube.create(tj_path(namespace), training_job("flaky", replicas=3, minimum=2,
                                                 schedulingPolicyName=fast_node_loss))
    before = wait_world(kube, namespace, "flaky", 3)
    crashing, stuck = before.members[0].pod, before.members[2]
    now = rfc3339(time.time())
    # The kubelet restarted one container twice and now backs off; another pod's
    # readiness probe fails (KWOK leaves pods whose Ready condition a test set alone).
    kube.merge_patch(api_path("v1", "pods", namespace, crashing, "status"), {"status": {
        "containerStatuses": [{"name": "train", "image": "ringwright/training:dev",
                               "ready": False, "restartCount": 2, "imageID": "",
                               "state": {"waiting": {"reason": "CrashLoopBackOff"}}}]}})
    # Its container had run (and been Ready) for a while: a hung member, no startup grace.
    kube.merge_patch(api_path("v1", "pods", namespace, stuck.pod, "status"), {"status": {
        "conditions": [{"type": "Ready", "status": "False", "lastTransitionTime": now}],
        "containerStatuses": [{"name": "train", "image": "ringwright/training:dev",
                               "ready": False, "restartCount": 0, "imageID": "",
                               "state": {"running": {"startedAt": _ago(30)}}}]}})
    try:
        def looping() -> str | None:
            return next((c["message"] for c in get_status(kube, namespace, "flaky")
                         .get("conditions") or []
                         if c["type"] == "CrashLoopBackOff" and c["status"] == "True"), None)

        assert crashing in wait_for(looping, "the CrashLoopBackOff condition")
        healed = wait_world(kube, namespace, "flaky", 3, after=before.generation, timeout=60)
        replacement = next(m for m in healed.members if m.pod == stuck.pod)
        assert replacement.pod_uid != stuck.pod_uid
        reasons = events_of(kube, namespace, "flaky")
        assert {"MemberUnready", "ContainerRestarted", "CrashLoopBackOff"} <= set(reasons)
        # Two container restarts and one lost member, each counted once.
        wait_for(lambda: get_status(kube, namespace, "flaky").get("restarts") == 3,
                 "restarts to count the container restarts and the lost member")
    except AssertionError as err:
        raise AssertionError(f"{err}\noperator log:\n{operator.tail(40)}") from err


def test_a_slow_start_within_its_grace_is_kept_and_not_counted(
    kube: KubeClient, namespace: str, operator: OperatorProcess, fast_node_loss: str,
) -> None:
    # The policy's unready limit is 4 s; spec.workers.startupGraceSeconds keeps its default.
    kube.create(tj_path(namespace), training_job("slow", replicas=3, minimum=2,
                                                 schedulingPolicyName=fast_node_loss))
    before = wait_world(kube, namespace, "slow", 3)
    slow = before.members[1]
    path = api_path("v1", "pods", namespace, slow.pod, "status")
    # As the kubelet shows a container that just (re)started and still loads its data:
    # Running, not Ready since long before the limit, the container started now.
    kube.merge_patch(path, {"status": {
        "conditions": [{"type": "Ready", "status": "False", "lastTransitionTime": _ago(60)}],
        "containerStatuses": [{"name": "train", "image": "ringwright/training:dev",
                               "ready": False, "restartCount": 0, "imageID": "",
                               "state": {"running": {"startedAt": _ago(0)}}}]}})
    try:
        # The round that took it out of the world also judged it, past the unready limit.
        smaller = wait_world(kube, namespace, "slow", size=None, after=before.generation)
        assert {m.pod for m in smaller.members} == {m.pod for m in before.members} - {slow.pod}
        kept = kube.get(api_path("v1", "pods", namespace, slow.pod))
        assert kept["metadata"]["uid"] == slow.pod_uid
        assert "deletionTimestamp" not in kept["metadata"]
        assert get_status(kube, namespace, "slow").get("restarts", 0) == 0
        assert not {"MemberUnready", "MemberNeverReady", "MemberLost"} & set(
            events_of(kube, namespace, "slow"))
        # Ready at last: the same pod rejoins, and nothing was counted.
        kube.merge_patch(path, {"status": {
            "conditions": [{"type": "Ready", "status": "True", "lastTransitionTime": _ago(0)}]}})
        healed = wait_world(kube, namespace, "slow", 3, after=smaller.generation)
        assert (slow.pod, slow.pod_uid) in {(m.pod, m.pod_uid) for m in healed.members}
        assert get_status(kube, namespace, "slow").get("restarts", 0) == 0
    except AssertionError as err:
        raise AssertionError(f"{err}\noperator log:\n{operator.tail(40)}") from err


class GenerationLog:
    """Reads every world of a namespace a few times a second, on a thread of its own, and
    notes what would break the runtime: a generation going back, or one generation published with
    two different memberships. Read errors (a restarting API server) are skipped, and kept
    for the message of a test whose log fell behind."""

    def __init__(self, cluster: Cluster, namespace: str) -> None:
        self.cluster, self.namespace = cluster, namespace
        self.seen: dict[str, list[tuple[int, str]]] = {}
        self._sizes: dict[str, dict[int, int]] = {}
        self.violations: list[str] = []
        self.errors: list[str] = []
        self.polls = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> GenerationLog:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def wait_seen(self, job: str, generation: int, timeout: float = 30) -> None:
        """Wait until the log has read ``generation`` of ``job``: its reads run on their
        own thread and may be a poll behind the test's."""
        try:
            wait_for(lambda: generation in self.generations(job),
                     f"the generation log to read {job}'s generation {generation}",
                     timeout=timeout, interval=0.1)
        except AssertionError as err:
            raise AssertionError(
                f"{err} (it read {self.generations(job)}): {self.polls} reads, thread "
                f"{'alive' if self._thread.is_alive() else 'dead'}, "
                f"{len(self.errors)} read errors, last {self.errors[-3:]}") from err

    def generations(self, job: str) -> list[int]:
        return [generation for generation, _ in self.seen.get(job, [])]

    def sizes(self, job: str) -> dict[int, int]:
        """The number of workers in each generation of ``job`` seen."""
        return dict(self._sizes.get(job, {}))

    def _run(self) -> None:
        # A read that hangs (an API server restarting under it) is given up on soon,
        # not retried for minutes while the worlds it should see go by.
        with KubeClient(load_kubeconfig(self.cluster.kubeconfig), timeout=5,
                        retry=RetryPolicy(attempts=1)) as kube:
            while not self._stop.wait(0.15):
                try:
                    maps = kube.list(api_path("v1", "configmaps", self.namespace),
                                     labelSelector=JOB_LABEL)
                except (ApiError, OSError, ValueError) as err:
                    self.errors.append(repr(err))
                    continue
                self.polls += 1
                for cm in maps:
                    self._note(cm)

    def _note(self, cm: dict[str, Any]) -> None:
        text = (cm.get("data") or {}).get("world.json")
        try:
            world = parse_world(text or "")
        except ContractError:
            return
        members = "|".join(f"{m.pod}/{m.pod_uid}" for m in (*world.members, *world.ps))
        seen = self.seen.setdefault(world.job.name, [])
        if seen and seen[-1][0] == world.generation:
            if seen[-1][1] != members:
                self.violations.append(f"{world.job.name}: generation {world.generation} published "
                                       f"with two memberships")
            return
        if seen and world.generation < seen[-1][0]:
            self.violations.append(
                f"{world.job.name}: generation {seen[-1][0]} -> {world.generation}")
        seen.append((world.generation, members))
        self._sizes.setdefault(world.job.name, {})[world.generation] = world.size


def _supervise(operator: OperatorProcess) -> None:
    """Start the operator again if it exited, as its Deployment would."""
    if operator.proc is None or operator.proc.poll() is not None:
        operator.start()


def _live_workers(kube: KubeClient, namespace: str, job: str) -> list[dict[str, Any]]:
    return [p for p in kube.list(api_path("v1", "pods", namespace),
                                 labelSelector=f"{JOB_LABEL}={job},{ROLE_LABEL}=worker")
            if not p["metadata"].get("deletionTimestamp")]


def _no_orphans_or_duplicates(kube: KubeClient, namespace: str,
                              replicas: dict[str, int]) -> None:
    jobs = {j["metadata"]["name"]: j["metadata"]["uid"]
            for j in kube.list(tj_path(namespace))}
    for p in kube.list(api_path("v1", "pods", namespace)):
        meta = p["metadata"]
        owner = meta["labels"].get(JOB_LABEL, "")
        assert owner in jobs, f"orphan pod {meta['name']}"
        assert [r["uid"] for r in meta.get("ownerReferences") or []] == [jobs[owner]], \
            f"pod {meta['name']} is not owned by its job"
    for job, want in replicas.items():
        indices = sorted(int(p["metadata"]["labels"][INDEX_LABEL])
                         for p in _live_workers(kube, namespace, job))
        assert indices == list(range(want)), f"{job}: worker indices {indices}"


def _world_is_the_live_pods(kube: KubeClient, namespace: str, job: str) -> bool:
    world = readable_world(kube, namespace, job)
    live = {(p["metadata"]["name"], p["metadata"]["uid"])
            for p in _live_workers(kube, namespace, job)}
    return world is not None and {(m.pod, m.pod_uid) for m in world.members} == live


def test_the_operator_killed_twenty_times_leaves_every_job_where_it_should_be(
    cluster: Cluster, kube: KubeClient, namespace: str, operator: OperatorProcess, seed: int,
) -> None:
    rng = random.Random(seed)  # the victims and the gaps between kills (tests/seeds.py)
    for name, replicas in (("grow", 2), ("lose", 3), ("done", 2), ("nap", 2)):
        kube.create(tj_path(namespace), training_job(
            name, replicas=replicas, minimum=1, runPolicy={"backoffLimit": 50}))
    for name, size in (("grow", 2), ("lose", 3), ("done", 2), ("nap", 2)):
        wait_world(kube, namespace, name, size)

    lost: list[str] = []

    def lose_a_member() -> None:
        # A member of the world as published, whose pod is that very pod (not a
        # replacement under the same name that has not joined yet).
        world = world_now(kube, namespace, "lose")
        uids = {p["metadata"]["name"]: p["metadata"]["uid"]
                for p in _live_workers(kube, namespace, "lose")}
        members = [m for m in world.members if uids.get(m.pod) == m.pod_uid]
        if members:
            victim = rng.choice(members)
            if kube.delete(api_path("v1", "pods", namespace, victim.pod), grace=0,
                           precondition_uid=victim.pod_uid):
                lost.append(victim.pod)

    def finish() -> None:
        rank0 = world_now(kube, namespace, "done").members[0].pod
        kube.merge_patch(api_path("v1", "pods", namespace, rank0, "status"),
                         {"status": {"phase": "Succeeded"}})

    actions = {
        1: lambda: kube.merge_patch(tj_path(namespace, "grow", "scale"),
                                    {"spec": {"replicas": 4}}),
        3: lose_a_member,
        6: lambda: kube.merge_patch(tj_path(namespace, "nap"),
                                    {"spec": {"runPolicy": {"suspend": True}}}),
        9: lose_a_member,
        11: finish,
        13: lambda: kube.merge_patch(tj_path(namespace, "grow", "scale"),
                                     {"spec": {"replicas": 5}}),
        16: lose_a_member,
    }
    with GenerationLog(cluster, namespace) as log:
        try:
            for kill in range(20):
                _supervise(operator)
                if kill in actions:
                    actions[kill]()
                time.sleep(rng.uniform(0.2, 4.0))
                operator.kill()
            _supervise(operator)
            wait_readable_world(kube, namespace, "grow", 5, after=0, timeout=90)
            wait_for(lambda: [get_status(kube, namespace, j).get("phase")
                              for j in ("grow", "lose", "done", "nap")]
                     == ["Running", "Running", "Succeeded", "Suspended"],
                     "every job in its phase", timeout=90)
            wait_for(lambda: not _live_workers(kube, namespace, "nap")
                     and len(_live_workers(kube, namespace, "done")) == 1,
                     "pods of the suspended and finished jobs gone", timeout=60)
            # Settled: one pod per index, every pod owned by its job.
            wait_for(lambda: len(_live_workers(kube, namespace, "grow")) == 5
                     and len(_live_workers(kube, namespace, "lose")) == 3, "pods settled")
            _no_orphans_or_duplicates(kube, namespace, {"grow": 5, "lose": 3})
            # The world names the pods that live now, not those the kills replaced.
            for job in ("grow", "lose"):
                wait_for(functools.partial(_world_is_the_live_pods, kube, namespace, job),
                         f"{job}'s world to name its live pods", timeout=60)
            # Each loss counted once, however the kills fell.
            assert lost and get_status(kube, namespace, "lose")["restarts"] == len(lost)
            assert world_now(kube, namespace, "grow").size == 5
            for job in ("grow", "lose"):
                log.wait_seen(job, world_now(kube, namespace, job).generation)
        except AssertionError as err:
            raise AssertionError(f"{err}\nlost {lost}\noperator log:\n"
                                 f"{operator.tail(40)}") from err
    assert not log.violations, log.violations
    for job in ("grow", "lose"):
        seen = log.generations(job)
        assert seen == sorted(set(seen)), (job, seen)
    assert len(log.generations("lose")) >= 2 and len(log.generations("grow")) >= 2


def test_restarted_api_server_and_etcd_leave_running_jobs_alone_and_the_operator_catches_up(
    cluster: Cluster, kube: KubeClient, namespace: str, operator: OperatorProcess,
) -> None:
    kube.create(tj_path(namespace), training_job("steady", replicas=3, minimum=2))
    before = wait_world(kube, namespace, "steady", 3)
    uids = sorted(p["metadata"]["uid"] for p in _live_workers(kube, namespace, "steady"))
    with GenerationLog(cluster, namespace) as log:
        try:
            cluster.restart("kube-apiserver")
            cluster.restart("etcd")
            # The operator's watches and Lease ride out the gap, or it exits and is started
            # again; either way it reconciles the job once more, and nothing happened to it:
            # same pods, same world.
            reconciled(kube, namespace, "steady", meanwhile=lambda: _supervise(operator))
            assert sorted(p["metadata"]["uid"]
                          for p in _live_workers(kube, namespace, "steady")) == uids
            world = world_now(kube, namespace, "steady")
            assert world.generation == before.generation and world.size == 3
            # The operator follows changes again.
            kube.merge_patch(tj_path(namespace, "steady", "scale"), {"spec": {"replicas": 4}})
            grown = wait_world(kube, namespace, "steady", 4, after=before.generation, timeout=60)
            wait_for(lambda: (s := get_status(kube, namespace, "steady")).get("phase")
                     == "Running" and s.get("world", {}).get("generation") == grown.generation,
                     "the status to follow the world")
        except AssertionError as err:
            raise AssertionError(f"{err}\noperator log:\n{operator.tail(40)}") from err
        finally:
            _supervise(operator)
    assert not log.violations, log.violations
