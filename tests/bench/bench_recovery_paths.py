"""One fault on three paths, as the operator sees it: real kubelet nodes, the KWOK cluster
with the pod host, and the local launcher, measured in one run.

The fault: SIGKILL of the training process in one of 4 worker pods (not the pod). The
kubelet (or what stands in for it) starts the container again in the same pod, and it
rejoins. Per trial: seconds from the signal to (a) the first training step completed by
a world of 3, (b) the first step completed by a world of 4 again.

Every path runs the same worker (``tests/runtime/elastic_worker.py``) with the same
workload, commit interval and collective timeout (:data:`recovery_common.WORKLOAD`,
:data:`recovery_common.PG_TIMEOUT_S`; a job's ``faultTolerance.collectiveTimeoutSeconds``
on the clusters), the runtime's default failure detection, and the same settle window
(the tests' operator settings, :data:`tests.jobs.FAST`; the local launcher is given
the same). "Step completed" is the worker's ``stepped`` trace line on every path
(written after the step's allreduce, stamped with the host's clock: containers share
it), read from the pods' trace files: on real nodes a hostPath volume holds them (the
image carries no tests, so the worker is staged in that folder too).

* ``realnode``: two real nodes (kubelet, containerd, runc; ``make demo-real``'s pair)
  running containers of the ``training`` image, which the bench builds or finds in the
  cache; the operator is the tests' operator process (``python -m ringwright.operator``
  on this machine, as ``make demo`` runs it), not the chart's Deployment, so both
  cluster paths share one operator and its settings. The signal goes to the container's
  processes, found by the container id in their cgroup.
* ``podhost``: the same cluster's KWOK nodes; the pod host starts a process per pod and
  restarts it in place when it dies (``restartPolicy: OnFailure``).
* ``local``: the local launcher, restarting the process under its name; it learns of
  a death from the survivors only (``recovery_ringwright.ClusterStyleJob``).

Trials kill a different pod each time while there is one not hit yet
(:func:`recovery_common.next_victim`): the kubelet delays the second restart of one
container by 10 s (its crash-loop back-off), which would be measured instead of the
recovery. A path that fails makes the bench exit 1.

    python tests/bench/bench_recovery_paths.py [--paths local,podhost,realnode] [--trials 2]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import statistics
import sys
import tempfile
import time
import traceback
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from ringwright.devcluster import images  # noqa: E402
from ringwright.devcluster.control_plane import Cluster  # noqa: E402
from ringwright.devcluster.demo import current_world  # noqa: E402
from ringwright.devcluster.demo_real import NODES  # noqa: E402
from ringwright.devcluster.install import install_api  # noqa: E402
from ringwright.devcluster.podhost import PodHost  # noqa: E402
from ringwright.devcluster.realnode import (  # noqa: E402
    crash_container,
    missing_requirements,
    requirements_message,
    start_real_nodes,
)
from ringwright.devcluster.realnode_only import real_nodes_only  # noqa: E402
from ringwright.kube import KubeClient, api_path  # noqa: E402
from ringwright.objects import Obj  # noqa: E402
from ringwright.world import World  # noqa: E402
from tests.bench import recovery_ringwright  # noqa: E402
from tests.bench.recovery_common import (  # noqa: E402
    IN_PLACE,
    KILL_AT_STEP,
    PG_TIMEOUT_S,
    REPLACED,
    WAIT_S,
    WORKLOAD,
    BaselineFailed,
    next_victim,
    shrink_and_heal,
    wait_until,
    whole_and_training,
)
from tests.e2e.test_elastic_job import WORKER, HostThread  # noqa: E402
from tests.jobs import FAST, OperatorProcess, fresh_namespace, tj_path, training_job  # noqa: E402
from tests.realnode.conftest import image_name  # noqa: E402
from tests.realnode.staging import hostpath_policy, run_staged_worker, stage_worker  # noqa: E402

PATHS = {"realnode": "real nodes (kubelet)", "podhost": "KWOK + pod host",
         "local": "local launcher"}
JOB = "bench-recovery"
POLL_S = 0.5
"""How often the bench reads the traces: the figures come from the traces' own stamps,
so this only sets how soon the bench moves on (and what its polling costs the CPUs)."""
START_S = 900.0
"""Bound for the first world of 4 to train: four containers importing torch on a
loaded machine."""
SETTLE_S = float(FAST["RINGWRIGHT_SETTLE_SECONDS"])

Trial = tuple[float, float, float, str]
"""Seconds to the world of 3, to the world of 4 again, the 1-minute load average at the
signal, and how the world became whole: :data:`IN_PLACE` or :data:`REPLACED`."""


def job_manifest(policy: str = "default") -> Obj:
    """The bench's job: 4 workers (at least 2), the workload as container environment,
    the bench's collective timeout as the job's fault tolerance setting."""
    manifest = training_job(JOB, replicas=4, minimum=2, gpusPerWorker=0, backend="torch",
                            schedulingPolicyName=policy,
                            faultTolerance={"collectiveTimeoutSeconds": int(PG_TIMEOUT_S)})
    container = manifest["spec"]["workers"]["template"]["spec"]["containers"][0]
    container["env"] = [{"name": k, "value": v} for k, v in sorted(WORKLOAD.items())]
    return manifest


def world_of(kube: KubeClient, namespace: str, size: int) -> World | None:
    """The job's current world when it has ``size`` members."""
    world = current_world(kube, namespace, JOB)
    return world if world is not None and world.size == size else None


def cluster_trials(kube: KubeClient, namespace: str, trace_dir: Path, trials: int,
                   kill: Callable[[str], None]) -> list[Trial]:
    """Per trial, once the job's world of 4 trains steadily, ``kill`` one member's
    training process and time the recovery (:func:`shrink_and_heal`)."""
    got = []
    killed: set[str] = set()
    for i in range(trials):
        world = whole_and_training(trace_dir, lambda: world_of(kube, namespace, 4),
                                   KILL_AT_STEP, START_S if i == 0 else WAIT_S, POLL_S)
        victim = next_victim(world, killed)
        killed.add(victim.pod)
        load = os.getloadavg()[0]
        since = time.time()
        kill(victim.pod)
        down, back = shrink_and_heal(trace_dir, since, WAIT_S, POLL_S)
        healed = world_of(kube, namespace, 4)
        # The operator replaces a member its peers name dead before it is back.
        how = IN_PLACE if healed is not None and (victim.pod, victim.pod_uid) in {
            (m.pod, m.pod_uid) for m in healed.members} else REPLACED
        got.append((down, back, load, how))
        print(f"  trial {i + 1}: {victim.pod} -> 3 in {down:.2f} s, -> 4 in {back:.2f} s, "
              f"{how} (load {load:.1f})", flush=True)
    return got


@contextlib.contextmanager
def job_in(kube: KubeClient, manifest: Obj) -> Iterator[str]:
    """``manifest`` created in a fresh namespace (its name); job and namespace deleted
    after, the job first while the operator still runs (it removes its finalizer)."""
    with fresh_namespace(kube) as namespace:
        path = tj_path(namespace, JOB)
        kube.create(tj_path(namespace), manifest)
        try:
            yield namespace
        finally:
            if kube.delete(path, propagation="Foreground"):
                wait_until("the job to go", lambda: kube.get_or_none(path) is None, 300, 1)


def podhost_path(kube: KubeClient, work: Path, trials: int) -> list[Trial]:
    """The fault on KWOK nodes, the pod host restarting the killed process."""
    with job_in(kube, job_manifest()) as namespace:
        trace_dir = work / "pods" / "trace"
        host = PodHost(kube, namespace, JOB, [sys.executable, str(WORKER)], work / "pods",
                       extra_env={"TRACE_DIR": str(trace_dir)}, readiness_grace=120)
        runner = HostThread(host)
        try:
            return cluster_trials(kube, namespace, trace_dir, trials,
                                  lambda pod: host.kill(pod, signal.SIGKILL))
        finally:
            runner.close()


def realnode_path(cluster: Cluster, kube: KubeClient, work: Path, trials: int) -> list[Trial]:
    """The fault in a container of the training image on real nodes."""
    missing = missing_requirements()
    if missing:
        raise BaselineFailed(requirements_message(missing))
    archive = images.build(["training"])[0].archive
    folder = work / "bench"
    traces = stage_worker(folder)
    policy = hostpath_policy(kube, "bench", folder)
    manifest = job_manifest(policy)
    run_staged_worker(manifest["spec"]["workers"]["template"]["spec"], image_name("training"),
                      folder, {})
    nodes = start_real_nodes(kube, cluster.dir, cluster.kubeconfig, NODES, images=[archive])
    try:
        with real_nodes_only(kube, nodes.names), \
                job_in(kube, manifest) as namespace:

            def kill(pod: str) -> None:
                if not crash_container(kube.get(api_path("v1", "pods", namespace, pod))):
                    raise BaselineFailed(f"no process of {pod}'s container on this host")

            return cluster_trials(kube, namespace, traces, trials, kill)
    finally:
        nodes.stop(kube)
        kube.delete(api_path("ringwright.dev/v1alpha1", "schedulingpolicies", name=policy))


@contextlib.contextmanager
def operated_cluster(work: Path, settings: Mapping[str, str] = FAST) -> Iterator[Cluster]:
    """A local cluster of its own (the default inventory's KWOK nodes), the API
    installed, the operator process running with ``settings`` (the tests' short windows
    unless told; ``{}``: the operator's own defaults, which the chart keeps); all stopped
    after."""
    cluster = Cluster(name="bench-recovery-paths", root=work / "cluster")
    try:
        cluster.up("default", timeout=900)
        with cluster.client() as kube:
            install_api(kube)
        operator = OperatorProcess(cluster, work / "operator.log", settings=settings)
        operator.start()
        try:
            yield cluster
        finally:
            operator.stop()
    finally:
        cluster.down()


def spread(values: Sequence[float]) -> str:
    """Median and range."""
    return (f"{statistics.median(values):6.2f} s ({min(values):.2f}-{max(values):.2f})"
            if values else "-")


def report(results: dict[str, list[Trial] | str], started: str, command: str) -> None:
    """The table: per path, median and range of both figures and the load at the signals."""
    head = f"{'path':24}{'trials':>7}{'kill -> step at 3':>28}{'kill -> step at 4':>28}" \
           f"{'load (1 min)':>16}   back at 4 by"
    print(f"\n{started}; {command}\n{os.cpu_count()} CPUs; collective timeout "
          f"{PG_TIMEOUT_S:.0f} s; settle {SETTLE_S} s; commit every "
          f"{WORKLOAD['COMMIT_EVERY']} steps\n\n{head}\n{'-' * len(head)}")
    for path, got in results.items():
        if isinstance(got, str):
            print(f"{PATHS[path]:24}{got:>7}")
            continue
        loads = [t[2] for t in got]
        hows = ", ".join(f"{n} {how}" for how, n in Counter(t[3] for t in got).items())
        print(f"{PATHS[path]:24}{len(got):>7}{spread([t[0] for t in got]):>28}"
              f"{spread([t[1] for t in got]):>28}"
              f"{f'{min(loads):.1f}-{max(loads):.1f}':>16}   {hows}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--paths", default="local,podhost,realnode",
                        help=f"comma-separated, from {','.join(PATHS)}")
    parser.add_argument("--trials", type=int, default=2)
    args = parser.parse_args(argv)
    paths = [p for p in args.paths.split(",") if p]
    unknown = [p for p in paths if p not in PATHS]
    if unknown:
        parser.error(f"unknown: {unknown}")
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    work = Path(tempfile.mkdtemp(prefix="ringwright-bench-paths-"))
    print(f"workdir {work}", flush=True)
    results: dict[str, list[Trial] | str] = {}
    failed = []
    with contextlib.ExitStack() as stack:
        cluster: Cluster | None = None
        for path in paths:
            print(f"{PATHS[path]} ...", flush=True)
            try:
                if path == "local":
                    results[path] = recovery_ringwright.container_kill(
                        work / "local", args.trials, SETTLE_S, POLL_S)
                    continue
                if cluster is None:
                    cluster = stack.enter_context(operated_cluster(work))
                with cluster.client() as kube:
                    results[path] = (podhost_path(kube, work / path, args.trials)
                                     if path == "podhost" else
                                     realnode_path(cluster, kube, work / path, args.trials))
            except Exception as err:
                # A path that fails voids the comparison: exit 1 at the end.
                traceback.print_exc()
                results[path] = "FAILED"
                failed.append(f"{path}: {err}")
    report(results, started, "python tests/bench/bench_recovery_paths.py "
           f"--paths {','.join(paths)} --trials {args.trials}")
    if failed:
        print("\nFAILED:\n  " + "\n  ".join(failed), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
