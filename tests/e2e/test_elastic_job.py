"""Operator + real runtime processes on the local cluster: a job that survives failures.

The pod host starts the traced training worker (`tests/runtime/elastic_worker.py`) for
every Running pod of the job, with the pod's environment, its 127.x pod IP and a token
of the pod's ServiceAccount, so the runtime watches its world through the API exactly as
it would in a real pod. Facts are read from the workers' traces (which world generation
trained each step, with which learning rate and library) and from the pod host's
process start counts, not from log lines.
"""

from __future__ import annotations

import logging
import re
import signal
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ringwright.devcluster.podhost import HttpProbe, PodHost
from ringwright.kube import ApiError, KubeClient, api_path
from ringwright.world import World, parse_world, world_configmap_name
from tests.jobs import OperatorProcess, get_status, tj_path, training_job
from tests.runtime.elastic_traces import Traces
from tests.waiting import wait_for

log = logging.getLogger("tests.podhost")

pytestmark = [pytest.mark.cluster, pytest.mark.e2e]

WORKER = Path(__file__).resolve().parents[1] / "runtime" / "elastic_worker.py"
BASE_LR = 0.01
"""The worker's learning rate, meant for the job's baseWorldSize (3)."""


class HostThread:
    """Keeps a :class:`PodHost` in step with the cluster from a background thread."""

    def __init__(self, host: PodHost) -> None:
        self.host = host
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            try:
                self.host.sync()
            except (ApiError, OSError) as err:
                # A loaded API server can time a request out; a kubelet tries again
                # rather than leave its pods unattended.
                log.warning("pod host pass failed, retrying: %s", err)
            self.stop.wait(0.2)

    def close(self) -> None:
        self.stop.set()
        self.thread.join()
        self.host.close()

    def traces(self) -> Traces:
        return Traces.load(self.host.workdir / "trace")

    def log_lines(self, pattern: str) -> list[str]:
        """Lines of the pods' logs matching ``pattern``, each after its pod's name (for
        programs that keep no trace, such as the PS example)."""
        out = []
        for path in sorted(self.host.workdir.glob("*.log")):
            out += [f"{path.stem} {line}" for line in path.read_text(errors="replace")
                    .splitlines() if re.search(pattern, line)]
        return out

    def tails(self, lines: int = 15) -> str:
        """The last ``lines`` of every pod's log, for a failing test's message."""
        return "\n".join(
            f"--- {path.stem}\n" + "\n".join(path.read_text(errors="replace")
                                              .splitlines()[-lines:])
            for path in sorted(self.host.workdir.glob("*.log")))


@pytest.fixture(params=["torch", pytest.param("horovod", marks=pytest.mark.horovod)])
def job(kube: KubeClient, namespace: str, operator: OperatorProcess, tmp_path: Path,
        request: pytest.FixtureRequest) -> Iterator[tuple[str, HostThread]]:
    manifest = training_job("elastic", replicas=3, minimum=2, gpusPerWorker=0,
                            backend=request.param,
                            lrScaling={"rule": "linear", "baseWorldSize": 3})
    kube.create(tj_path(namespace), manifest)
    trace_env = {"TRACE_DIR": str(tmp_path / "pods" / "trace"), "EPOCHS": "400",
                 "SAMPLES": "1024", "BATCH": "4", "COMMIT_EVERY": "5", "STEP_SLEEP": "0.05",
                 "OMP_NUM_THREADS": "1"}
    host = PodHost(kube, namespace, "elastic", [sys.executable, str(WORKER)],
                   tmp_path / "pods", extra_env=trace_env, readiness_grace=120)
    runner = HostThread(host)
    yield namespace, runner
    runner.close()


def world(kube: KubeClient, ns: str) -> World | None:
    cm = kube.get_or_none(api_path("v1", "configmaps", ns, world_configmap_name("elastic")))
    text = ((cm or {}).get("data") or {}).get("world.json")
    return parse_world(text) if text else None


def world_where(kube: KubeClient, ns: str, size: int | None = None, after: int = 0
                ) -> World | None:
    """The current world when it has ``size`` members and a generation above ``after``."""
    current = world(kube, ns)
    if current is None or current.generation <= after or size not in (None, current.size):
        return None
    return current


def trained_at(runner: HostThread, world: World) -> bool:
    """Every member of ``world`` completed a step in it."""
    return {m.pod for m in world.members} <= runner.traces().trained(world.generation)


def assert_started_in(runner: HostThread, world: World, backend: str) -> None:
    """Every member started world ``world`` with its rank, the library's view of it and
    the learning rate rescaled for its size (linear, base world size 3)."""
    starts = runner.traces().starts(world.generation)
    assert set(starts) == {m.pod for m in world.members}
    for m in world.members:
        r = starts[m.pod]
        assert (r["rank"], r["lib_rank"], r["size"], r["lib_size"]) == \
            (m.rank, m.rank, world.size, world.size), r
        assert r["lib_backend"] == backend, r
        assert r["lr"] == pytest.approx(BASE_LR * world.size / 3), r


def test_deleted_pod_survivors_rebuild_and_scale_up_joins(
    kube: KubeClient, job: tuple[str, HostThread]
) -> None:
    ns, runner = job
    backend = request_backend(kube, ns)
    first = wait_for(lambda: world_where(kube, ns, 3), "the first world", timeout=120)
    wait_for(lambda: trained_at(runner, first), "every member to train in the first world",
             timeout=180)

    victim = first.members[-1]
    victim_pids = set(runner.traces().pids(victim.pod))
    kube.delete(api_path("v1", "pods", ns, victim.pod), grace=0)
    after = wait_for(lambda: world_where(kube, ns, after=first.generation), "a new generation",
                     timeout=60)
    # Its replacement may reuse the name: the deleted pod is known by its uid and pids.
    assert victim.pod_uid and victim.pod_uid not in [m.pod_uid for m in after.members]
    survivors = [m.pod for m in first.members if m.pod != victim.pod]
    assert set(survivors) <= {m.pod for m in after.members}
    wait_for(lambda: trained_at(runner, after),
             "survivors to rebuild the ring and train in the new generation", timeout=180)
    assert_started_in(runner, after, backend)
    replacement = runner.traces().starts(after.generation).get(victim.pod)
    assert replacement is None or replacement["pid"] not in victim_pids
    # The processes stayed alive: one process start per survivor, that trained in both.
    traces = runner.traces()
    for pod in survivors:
        assert runner.host.starts[pod] == 1, (pod, runner.host.starts)
        assert len(traces.pids(pod)) == 1, (pod, traces.pids(pod))

    kube.merge_patch(tj_path(ns, "elastic", "scale"), {"spec": {"replicas": 4}})
    grown = wait_for(lambda: world_where(kube, ns, 4), "a world of four", timeout=120)
    wait_for(lambda: trained_at(runner, grown),
             "the newcomer to join and everyone to train", timeout=180)
    assert_started_in(runner, grown, backend)
    status: dict[str, Any] = get_status(kube, ns, "elastic")
    assert status["phase"] == "Running"
    assert status["world"]["size"] == 4


# torch only: the Horovod variant timed out in start-up on a machine at load 35 and
# was not seen to pass (the SIGSTOP fault itself is covered for Horovod in
# tests/runtime/test_faults.py).
@pytest.mark.parametrize("job", ["torch"], indirect=True)
def test_frozen_pod_is_replaced_and_the_world_grows_back(
    kube: KubeClient, job: tuple[str, HostThread]
) -> None:
    """SIGSTOP one pod's training process: no exit, no TCP reset. Its readiness probe
    fails, its peers report it silent, the operator replaces the pod, and the job is
    back at full size and training."""
    ns, runner = job
    first = wait_for(lambda: world_where(kube, ns, 3), "the first world", timeout=120)
    wait_for(lambda: trained_at(runner, first), "every member to train in the first world",
             timeout=180)
    victim = first.members[1]
    pod = kube.get(api_path("v1", "pods", ns, victim.pod))
    probe = HttpProbe.of(pod)
    assert probe is not None, "the operator gives every worker an HTTP readiness probe"
    assert probe.passes(victim.ip)
    runner.host.kill(victim.pod, signal.SIGSTOP)
    # The probe the pod host runs, as a kubelet would: a frozen runtime cannot answer.
    assert not probe.passes(victim.ip)

    def without_victim() -> World | None:
        w = world_where(kube, ns, 3, after=first.generation)
        return w if w is not None and victim.pod_uid not in [m.pod_uid for m in w.members] \
            else None

    back = wait_for(without_victim, "a world of three without the frozen pod", timeout=180)
    wait_for(lambda: trained_at(runner, back), "the world of three to train", timeout=180)
    survivors = [m.pod for m in first.members if m.pod != victim.pod]
    for pod_name in survivors:
        assert runner.host.starts[pod_name] == 1, (pod_name, runner.host.starts)
    events = kube.list(api_path("v1", "events", ns))
    assert any(e.get("reason") == "MemberDead" and victim.pod in e.get("message", "")
               for e in events), [e.get("message") for e in events]


@pytest.mark.parametrize("job", ["torch"], indirect=True)
def test_a_killed_process_restarts_in_its_pod_and_joins_again(
    kube: KubeClient, job: tuple[str, HostThread], tmp_path: Path
) -> None:
    """SIGKILL one member's training process: the pod host starts it again in its pod
    (restartPolicy OnFailure, as a kubelet does). The pod is kept, not replaced: its
    peers name the dead process and go on without it, its new process joins again as a
    newcomer, and the one failure counts once toward backoffLimit."""
    ns, runner = job
    first = wait_for(lambda: world_where(kube, ns, 3), "the first world", timeout=120)
    wait_for(lambda: trained_at(runner, first), "every member to train in the first world",
             timeout=180)
    victim = first.members[1]
    # The restarted process waits at the gate before its runtime starts (a slow image
    # start), so the peers' verdict comes before anything the new process could say.
    gate = tmp_path / "restart-gate"
    gate.touch()
    runner.host.extra_env["START_GATE_FILE"] = str(gate)
    runner.host.kill(victim.pod, signal.SIGKILL)

    def without_victim() -> World | None:
        w = world_where(kube, ns, 2, after=first.generation)
        return w if w is not None and victim.pod not in w.pods else None

    smaller = wait_for(without_victim, "the survivors in a world of two", timeout=180)
    wait_for(lambda: trained_at(runner, smaller), "the survivors to train on", timeout=180)
    held = kube.get(api_path("v1", "pods", ns, victim.pod))
    assert held["metadata"]["uid"] == victim.pod_uid  # kept, not replaced
    assert not held["metadata"].get("deletionTimestamp")
    assert runner.host.starts[victim.pod] == 2, runner.host.starts  # restarted, held
    gate.unlink()

    def rejoined() -> World | None:
        w = world_where(kube, ns, 3, after=smaller.generation)
        return w if w is not None and victim.pod_uid in [m.pod_uid for m in w.members] \
            else None

    back = wait_for(rejoined, "the restarted process back in a world of three", timeout=180)
    wait_for(lambda: trained_at(runner, back), "the world of three to train", timeout=180)
    assert runner.host.starts[victim.pod] == 2, runner.host.starts
    survivors = [m.pod for m in first.members if m.pod != victim.pod]
    assert all(runner.host.starts[p] == 1 for p in survivors), runner.host.starts
    status = get_status(kube, ns, "elastic")
    events = kube.list(api_path("v1", "events", ns))
    told = [f"{e.get('reason')}: {e.get('message')}" for e in events]
    assert status["restarts"] == 1, (status, told)
    assert any(e.get("reason") == "MemberDead" and "joins again" in e.get("message", "")
               for e in events), told


def request_backend(kube: KubeClient, ns: str) -> str:
    """The collective library the job asked for (``torch`` runs gloo on CPU)."""
    backend: str = kube.get(tj_path(ns, "elastic"))["spec"]["backend"]
    return "gloo" if backend == "torch" else backend
