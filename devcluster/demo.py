"""``make demo``: a local cluster, the operator, and an elastic job that survives a failure.

1. start (or reuse) the local control plane and show the simulated datacenter;
2. install the CRDs and the default policy, start the operator;
3. apply a TrainingJob; real runtime processes stand in for its pods (127.x pod IPs);
4. show where each worker landed and the ring order;
5. cordon the nodes, delete one worker's pod mid-training and show the new generation,
   the rebuilt ring, the rescaled learning rate and training continuing from the last
   commit; then uncordon them and show the replacement joining again;
6. print the log lines of every process merged by time, the recovery as the runtime's
   and the operator's Prometheus metrics count it, and draw a PNG timeline.
The cluster is left running (``python -m ringwright.devcluster down`` stops it).
Steps 3 to 6 are :func:`drive`, which ``make demo-real`` (:mod:`.demo_real`) runs too,
on real nodes, with pod logs read through the API.
Every step waits for what it reads: the world ConfigMap and the job's status are
written one after the other, so neither is read before it shows the awaited generation.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol, TypeVar

from ringwright.kube import ApiError, KubeClient, api_path
from ringwright.objects import Obj
from ringwright.operator.api.base import API_VERSION
from ringwright.world import (
    DEFAULT_METRICS_PORT,
    WORLD_KEY,
    ReportKind,
    World,
    parse_world,
    world_configmap_name,
)

from .control_plane import Cluster, free_port
from .example import EXAMPLE, example
from .install import install_api
from .inventory import describe
from .podhost import PodHost
from .scrape import Scrape, scrape
from .timeline import LogLine, draw, fields, merge, read_log, read_timeline

ROOT = Path(__file__).resolve().parents[1]
NAMESPACE = "demo"
PROGRESS = r" epoch_done "
"""The line rank 0 prints after every data epoch."""
SAMPLES = 1024
"""Samples per data epoch of the demo's training script."""
SHOWN = ("rolled_back", "lr_rescale", "world_ready", "left_world", "published world",
         "created pod", "MemberLost")
"""Log lines worth reading in the merged log (runtime events and operator decisions)."""
OPERATOR_SETTINGS = {"RINGWRIGHT_SETTLE_SECONDS": "1", "RINGWRIGHT_DRAIN_SECONDS": "15"}
"""The operator's settings in the demo (the rest are the defaults)."""
TAIL_LINES = 80
"""How many of the last log lines a demo that timed out prints."""
RUNTIME_SCRAPE_PATIENCE_S = 15.0
"""How long the demo asks a training process for its metrics before reporting none."""
T = TypeVar("T")


class DemoTimeout(RuntimeError):
    """Something the demo waits for did not happen in time."""


def say(text: str) -> None:
    print(f"\n==> {text}", flush=True)


def wait(probe: Callable[[], T | None], what: str, sync: Callable[[], None] | None = None,
         timeout: float = 180.0, interval: float = 0.2) -> T:
    """Poll ``probe`` (calling ``sync`` first, to keep a pod host in step) until it
    answers."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if sync is not None:
            sync()
        value = probe()
        if value:
            return value
        time.sleep(interval)
    raise DemoTimeout(f"demo: timed out waiting for {what} ({timeout:.0f} s)")


def current_world(kube: KubeClient, namespace: str, name: str) -> World | None:
    """Job ``name``'s world as the operator last published it; None before the first."""
    cm = kube.get_or_none(api_path("v1", "configmaps", namespace, world_configmap_name(name)))
    text = ((cm or {}).get("data") or {}).get(WORLD_KEY)
    return parse_world(text) if text else None


def world_summary(job: Obj | None, generation: int) -> Obj | None:
    """The job's status.world once the operator has written it for ``generation`` (or later).

    The operator publishes the world ConfigMap before it writes the status, so a
    reader that saw the world must wait for the status to catch up.
    """
    summary: Obj = ((job or {}).get("status") or {}).get("world") or {}
    if summary.get("generation", 0) >= generation and "crossRackEdges" in summary:
        return summary
    return None


def show_world(world: World, edges: int) -> None:
    print(f"world generation {world.generation}: {world.size} workers, store at "
          f"{world.store.address}:{world.store.port}")
    node = max([16, *(len(m.node) for m in world.members)]) + 2
    print(f"  {'RANK':<5}{'POD':<22}{'IP':<16}{'RACK':<9}{'NVLINK':<14}{'NODE':<{node}}GPU")
    for m in world.members:
        print(f"  {m.rank:<5}{m.pod:<22}{m.ip:<16}{m.rack:<9}{m.nvlink_domain:<14}"
              f"{m.node:<{node}}{m.gpu_model}")
    print("  ring: " + " -> ".join(f"{m.rank}({m.rack})" for m in world.members)
          + f" -> 0   cross-rack edges: {edges}")


def kubectl(cluster: Cluster, *args: str) -> None:
    exe = shutil.which("kubectl")
    if exe is None:
        return
    print(f"$ kubectl {' '.join(args)}")
    subprocess.run([exe, "--kubeconfig", str(cluster.kubeconfig), *args], check=False)


def set_cordoned(kube: KubeClient, nodes: list[str], cordoned: bool) -> None:
    """``kubectl cordon`` (or ``uncordon``) each of ``nodes``."""
    for node in nodes:
        kube.merge_patch(api_path("v1", "nodes", name=node),
                         {"spec": {"unschedulable": cordoned or None}})


def schedulable_nodes(kube: KubeClient) -> list[str]:
    """The nodes not cordoned now."""
    return sorted(n["metadata"]["name"] for n in kube.list(api_path("v1", "nodes"))
                  if not (n.get("spec") or {}).get("unschedulable"))


def pod_lines(host: PodHost) -> list[LogLine]:
    """Every pod process's timestamped log lines, merged by time."""
    return merge(read_log(path, path.stem) for path in sorted(host.workdir.glob("*.log")))


class Pods(Protocol):
    """The job's pods as the demo reads them, wherever they run."""

    def sync(self) -> None:
        """Keep the pods in step with the cluster (a pod host starts and stops them)."""

    def lines(self) -> list[LogLine]:
        """Every pod's timestamped log lines so far, merged by time."""

    def metrics_urls(self) -> dict[str, str]:
        """The runtime's /metrics URL of each pod, by pod name."""


@dataclass
class HostedPods:
    """Pods run by a :class:`PodHost` on this machine: logs in its folder."""

    host: PodHost

    def sync(self) -> None:
        self.host.sync()

    def lines(self) -> list[LogLine]:
        return pod_lines(self.host)

    def metrics_urls(self) -> dict[str, str]:
        return {pod: f"http://{hosted.ip}:{DEFAULT_METRICS_PORT}/metrics"
                for pod, hosted in sorted(self.host.pods.items())}


def grep(lines: list[LogLine], pattern: str) -> list[LogLine]:
    """The lines matching ``pattern``, in their order."""
    return [line for line in lines if re.search(pattern, line.text)]


def first_ready(lines: list[LogLine], generation: int, since: float = 0.0) -> float | None:
    """When the first member logged ``world_ready`` for ``generation`` (or a later one)
    at or after ``since``: training in that world starts with its next step."""
    for line in lines:
        found = fields(line.text, "world_ready") if line.at >= since else None
        if found is not None and int(found.get("generation", -1)) >= generation:
            return line.at
    return None


@dataclass(frozen=True)
class Recovery:
    """Seconds from the failure to training again in the smaller world (its first
    ``world_ready``), and to the whole world's first ``world_ready``."""

    smaller: float | None
    whole: float | None

    def show(self, where: str) -> str:
        """The figure as the demo prints it, saying where it was measured."""
        def secs(value: float | None) -> str:
            return f"{value:.1f} s" if value is not None else "not seen"

        return (f"recovery ({where}): pod deleted -> training at the smaller size "
                f"{secs(self.smaller)}, -> back at full size {secs(self.whole)}")


def recovery(lines: list[LogLine], failure_at: float, smaller: int, whole: int) -> Recovery:
    """The :class:`Recovery` of a failure at ``failure_at`` (seconds since the epoch)
    whose smaller world is generation ``smaller`` and whose healed one is ``whole``."""
    def since(generation: int) -> float | None:
        at = next((line.at for line in lines if line.at >= failure_at
                   and int((fields(line.text, "world_ready") or {}).get("generation", -1))
                   == generation), None)
        return at - failure_at if at is not None else None

    return Recovery(since(smaller), since(whole))


def stand_still(lines: list[LogLine], generation: int) -> dict[str, float]:
    """Seconds each member that trained before world ``generation`` stood still for it:
    from agreeing at a commit to leave its world for ``generation`` (its
    ``world_change_agreed``) to training in it (its ``world_ready``): group formation,
    state transfer, and whatever it waited for a newcomer. By pod (the log's source)."""
    agreed: dict[str, float] = {}
    still: dict[str, float] = {}
    for line in lines:
        change = fields(line.text, "world_change_agreed")
        if change is not None and int(change.get("next_generation", -1)) == generation:
            agreed.setdefault(line.source, line.at)
        ready = fields(line.text, "world_ready")
        if ready is not None and int(ready.get("generation", -1)) == generation \
                and line.source in agreed and line.source not in still:
            still[line.source] = line.at - agreed[line.source]
    return still


def show_merged(lines: list[LogLine], since: float) -> None:
    """The lines worth reading from ``since`` on, every process's, in time order."""
    for line in lines:
        if line.at >= since and any(key in line.text for key in SHOWN):
            show_line(line, 150)


def show_line(line: LogLine, width: int) -> None:
    """One log line: its time, its process, the first ``width`` characters."""
    stamp = time.strftime("%H:%M:%S", time.localtime(line.at))
    print(f"  {stamp}.{int(line.at * 1000) % 1000:03d} {line.source:<18} {line.text[:width]}")


def show_tail(lines: list[LogLine], count: int = TAIL_LINES) -> None:
    """The last ``count`` lines of every process, whatever they say, in time order."""
    say(f"the last {count} log lines of every process")
    for line in lines[-count:]:
        show_line(line, 200)


@dataclass
class DemoRun:
    """What the demo saw: the timeline it drew and the metrics it read at the end."""

    png: Path
    failure_at: float
    generations: list[int]
    runtime: dict[str, Scrape] = field(default_factory=dict)
    """The runtime metrics of every training process, by pod."""
    operator: Scrape | None = None
    recovery: Recovery | None = None


def show_metrics(run: DemoRun) -> None:
    """The recovery as the runtime and the operator count it."""
    for pod, got in sorted(run.runtime.items()):
        cause = ReportKind.COLLECTIVE_FAILED.value
        print(f"  {pod:<18} world generation {got.get('ringwright_runtime_world_generation'):.0f} "
              f"size {got.get('ringwright_runtime_world_size'):.0f}, "
              f"recoveries {got.get('ringwright_runtime_recoveries_total', cause=cause):.0f} "
              f"({got.get('ringwright_runtime_recovery_seconds_sum', cause=cause):.2f} s), "
              f"steps lost {got.get('ringwright_runtime_steps_lost_total'):.0f}, "
              f"mean step {_mean(got, 'ringwright_runtime_step_seconds') * 1000:.0f} ms")
    if run.operator is not None:
        op = run.operator
        print(f"  operator           generations published "
              f"{op.get('ringwright_operator_world_generations_published_total'):.0f}, "
              "members lost "
              f"{op.get('ringwright_operator_members_lost_total'):.0f}, pods created "
              f"{op.get('ringwright_operator_pods_created_total'):.0f}, reconcile rounds "
              f"{op.get('ringwright_operator_reconcile_seconds_count'):.0f}")


def _mean(got: Scrape, histogram: str) -> float:
    count = got.get(f"{histogram}_count")
    return got.get(f"{histogram}_sum") / count if count else 0.0


def main(argv: list[str] | None = None) -> int:
    """Run the demo end to end; returns a process exit code."""
    parser = argparse.ArgumentParser(prog="ringwright-demo", description=__doc__)
    parser.add_argument("--inventory", default="default")
    parser.add_argument("--png", type=Path, default=None,
                        help="where to write the timeline (default: in the demo's folder)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")

    cluster = Cluster()
    say("local control plane (etcd, kube-apiserver, controller-manager, scheduler, KWOK)")
    cluster.up(args.inventory)
    kube = cluster.client()
    print(describe(kube.list(api_path("v1", "nodes"))))
    kubectl(cluster, "get", "nodes", "-L", "ringwright.dev/rack,nvidia.com/gpu.product")

    say("installing CRDs, PriorityClasses and the default SchedulingPolicy")
    install_api(kube)
    work = cluster.dir / "demo"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    metrics_port = free_port()
    env = {**os.environ, "KUBECONFIG": str(cluster.kubeconfig), **OPERATOR_SETTINGS}
    operator_log = work / "operator.log"
    with operator_log.open("ab") as out:
        operator = subprocess.Popen(
            [sys.executable, "-m", "ringwright.operator", "--metrics-port", str(metrics_port),
             "--metrics-address", "127.0.0.1"],
            env=env, stdout=out, stderr=subprocess.STDOUT)
    print(f"operator pid {operator.pid}, log {operator_log}, "
          f"metrics http://127.0.0.1:{metrics_port}/metrics")
    try:
        run = run_job(cluster, kube, work, operator_log=operator_log,
                      operator_metrics=f"http://127.0.0.1:{metrics_port}/metrics",
                      png=args.png)
    except (ApiError, DemoTimeout) as err:
        print(f"demo: {err}", file=sys.stderr)
        return 1
    finally:
        operator.terminate()
        operator.wait(timeout=15)
    say(f"timeline: {run.png}")
    say(f"done. The cluster keeps running: export KUBECONFIG={cluster.kubeconfig}; "
        "stop it with: python -m ringwright.devcluster down")
    return 0


def run_job(cluster: Cluster, kube: KubeClient, work: Path, *, namespace: str = NAMESPACE,
            operator_log: Path | None = None, operator_metrics: str = "",
            png: Path | None = None,
            before_failure: Callable[[World], None] | None = None,
            after_recovery: Callable[[World], None] | None = None) -> DemoRun:
    """Apply the example job, its pods run by a pod host on this machine; show
    placement, inject a failure, show the recovery (:func:`drive`).

    Needs a running operator; ``operator_log`` and ``operator_metrics`` (its /metrics
    URL) are read when given. ``before_failure`` is called with the first world just
    before its last member's pod is deleted, ``after_recovery`` with the healed world
    once it trains, while every pod still runs. Raises :class:`DemoTimeout` when a step
    never comes.
    """
    manifest = example()
    # The pods run on this machine: the job's checkpoint path is a folder of the demo's.
    manifest["spec"]["checkpoint"]["path"] = str(work / "checkpoints")
    command = [sys.executable, str(ROOT / "examples" / "train_elastic.py"), "--epochs", "200",
               "--samples", str(SAMPLES)]
    host = PodHost(kube, namespace, manifest["metadata"]["name"], command, work / "pods",
                   readiness_grace=60)
    try:
        pods = HostedPods(host)
        apply_job(kube, namespace, manifest, f"kubectl apply -f {EXAMPLE.relative_to(ROOT)}",
                  pods.sync)
        return drive(cluster, kube, pods, manifest, Scenario(samples=SAMPLES),
                     namespace=namespace, png=png or work / "timeline.png",
                     operator_lines=(lambda: read_log(operator_log, "operator"))
                     if operator_log else None,
                     operator_metrics=(lambda: scrape(operator_metrics))
                     if operator_metrics else None,
                     before_failure=before_failure, after_recovery=after_recovery)
    finally:
        host.close()


def apply_job(kube: KubeClient, namespace: str, manifest: Obj, title: str,
              sync: Callable[[], None] | None = None, timeout: float = 180.0) -> None:
    """Create ``manifest`` in ``namespace`` (made if missing) after the previous demo
    job of its name is gone."""
    name = manifest["metadata"]["name"]
    if kube.get_or_none(api_path("v1", "namespaces", name=namespace)) is None:
        kube.create(api_path("v1", "namespaces"), {"metadata": {"name": namespace}})
    job_path = api_path(API_VERSION, "trainingjobs", namespace, name)
    if kube.delete(job_path, propagation="Foreground"):
        wait(lambda: kube.get_or_none(job_path) is None, "the previous demo job to go", sync,
             timeout)
    say(title)
    kube.create(api_path(API_VERSION, "trainingjobs", namespace), manifest)


@dataclass(frozen=True)
class Scenario:
    """How a demo runs the shared steps of :func:`drive`."""

    samples: int
    """Samples per data epoch of the job's script."""
    hold_replacement: bool = True
    """Cordon the schedulable nodes from the failure until the smaller world trains, so
    that it always comes before the replacement (see :func:`drive`)."""
    grace: int | None = 0
    """The deleted pod's grace period; None: its own (``kubectl delete pod``)."""
    timeout: float = 180.0
    """How long each step may take."""
    interval: float = 0.2
    """Between two looks at the cluster or the logs."""
    measured_on: str = ""
    """Where the recovery figure is measured, for its label; empty: not printed."""


def drive(cluster: Cluster, kube: KubeClient, pods: Pods, manifest: Obj, scenario: Scenario, *,
          namespace: str, png: Path,
          operator_lines: Callable[[], list[LogLine]] | None = None,
          operator_metrics: Callable[[], Scrape | None] | None = None,
          before_failure: Callable[[World], None] | None = None,
          after_recovery: Callable[[World], None] | None = None) -> DemoRun:
    """The demo's steps once the job ``manifest`` is applied: show placement, wait for
    training, delete the last member's pod, show the smaller world and the whole one
    again, the merged logs, the metrics, the recovery figure and the timeline."""
    name = manifest["metadata"]["name"]
    job_path = api_path(API_VERSION, "trainingjobs", namespace, name)
    replicas = manifest["spec"]["workers"]["replicas"]

    def waited(probe: Callable[[], T | None], what: str) -> T:
        try:
            return wait(probe, what, pods.sync, scenario.timeout, scenario.interval)
        except DemoTimeout:
            # What every process said last is what tells a stuck step from a slow one.
            logs = pods.lines()
            show_tail(merge([logs, operator_lines()]) if operator_lines else logs)
            raise

    def next_world(after: int, size: int | None = None) -> World:
        def probe() -> World | None:
            w = current_world(kube, namespace, name)
            ok = w is not None and w.generation > after and (size is None or w.size == size)
            return w if ok else None

        return waited(probe, f"a world after generation {after}"
                      + (f" with {size} workers" if size else ""))

    def show(world: World) -> None:
        summary = waited(lambda: world_summary(kube.get_or_none(job_path), world.generation),
                         f"the job status to show generation {world.generation}")
        show_world(world, int(summary["crossRackEdges"]))

    def trained_in(generation: int, epochs_done: int) -> None:
        ready = waited(lambda: first_ready(pods.lines(), generation),
                       f"training in generation {generation}")
        waited(lambda: sum(1 for line in grep(pods.lines(), PROGRESS) if line.at > ready)
               >= epochs_done, f"{epochs_done} data epochs in world generation {generation}")

    world = next_world(0, replicas)
    say("placement: one GPU model, fewest racks, ring in rack order")
    show(world)
    kubectl(cluster, "-n", namespace, "get", "tj", "-o", "wide")
    kubectl(cluster, "-n", namespace, "get", "pods", "-o", "wide")

    say("training: waiting for a few data epochs")
    trained_in(world.generation, 3)
    if before_failure is not None:
        before_failure(world)
    victim = world.members[-1].pod
    # With room for it, the replacement is Ready as soon as it runs, and the operator
    # publishes a full set of ready pods at once: when its round after the loss came
    # late, the ring went from 4 straight back to 4. Cordoned nodes take no
    # replacement, so the smaller world always comes first.
    cordoned = schedulable_nodes(kube) if scenario.hold_replacement else []
    if cordoned:
        say(f"kubectl cordon {' '.join(cordoned)}: the replacement must wait")
        set_cordoned(kube, cordoned, True)
    try:
        say(f"failure: kubectl delete pod {victim} (rank {world.members[-1].rank})")
        failure_at = time.time()
        kube.delete(api_path("v1", "pods", namespace, victim), grace=scenario.grace)
        shrunk = next_world(world.generation, replicas - 1)
        show(shrunk)
        trained_in(shrunk.generation, 1)
    finally:
        set_cordoned(kube, cordoned, False)
    if cordoned:
        say("kubectl uncordon: the operator places the replacement")
    healed = next_world(shrunk.generation, replicas)
    say("the replacement joined; the ring is whole again")
    show(healed)
    trained_in(healed.generation, 3)
    if after_recovery is not None:
        after_recovery(healed)

    say("what every process logged, merged by time")
    logs = pods.lines()
    everything = merge([logs, operator_lines()]) if operator_lines else logs
    show_merged(everything, since=failure_at - 2)
    run = DemoRun(png=png, failure_at=failure_at,
                  generations=[world.generation, shrunk.generation, healed.generation],
                  recovery=recovery(logs, failure_at, shrunk.generation, healed.generation))
    say("the recovery in Prometheus metrics (runtime on each pod, and the operator)")
    for pod, url in pods.metrics_urls().items():
        got = scrape(url, patience=RUNTIME_SCRAPE_PATIENCE_S)
        if got is None:
            say(f"{pod}: no metrics at {url} within {RUNTIME_SCRAPE_PATIENCE_S:.0f} s")
        else:
            run.runtime[pod] = got
    run.operator = operator_metrics() if operator_metrics else None
    show_metrics(run)
    if scenario.measured_on and run.recovery is not None:
        say(run.recovery.show(scenario.measured_on))
    still = stand_still(logs, healed.generation)
    if still:
        say(f"the rejoin stopped the {len(still)} members training meanwhile for "
            f"{min(still.values()):.2f}-{max(still.values()):.2f} s each (from agreeing "
            "on the new world at a commit to training in it)")

    timeline = read_timeline(logs, scenario.samples)
    draw(timeline, run.png, failure_at=failure_at, rejoin_generation=healed.generation,
         title=f"TrainingJob {name}: {victim} deleted, world {world.size} -> "
               f"{shrunk.size} -> {healed.size}")
    kubectl(cluster, "-n", namespace, "get", "tj", "-o", "wide")
    kubectl(cluster, "-n", namespace, "describe", "tj", name)
    return run


if __name__ == "__main__":
    sys.exit(main())
