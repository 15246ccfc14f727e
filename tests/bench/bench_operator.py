"""Operator at scale, in parts, each with its baseline measured in the same run:

1. ``plan``: one reconcile round's observe + plan for a 64-worker job with 10,000 nodes in
   memory, against the old round that rebuilt the inventory from every Node and Pod
   object (the LIST it also made is not even counted). Goal: p99 <= 50 ms.
2. ``throughput``: a 256-worker TrainingJob until it is Running, against a plain script
   creating the very pods the operator would (its own plan for the same free nodes: same
   placement, affinity, priority, labels, volumes) the way its apply step sends them,
   until every pod is Running. Three trials each, alternating, one fresh operator per
   trial; medians, ranges, the load, the phases of both as one watch saw them, the
   operator's rounds and kube-apiserver's ``apiserver_request_total``. Goal: <= 1.2x.
3. ``scale``: >= 2,000 KWOK nodes and >= 100 jobs of 4-32 workers applied at once, against
   the same pods created bare first (the operator's own plans, one job after another),
   with every gang whole and no node given more GPUs than it has checked once Running: API
   requests per reconcile round from kube-apiserver's own ``apiserver_request_total``
   (read before and after), LIST calls per round while nothing changes, reconcile
   latency p50/p99 (the operator's histogram), time until every job is Running, and the
   operator's peak RSS.
4. ``lists``: LIST (and GET) calls per reconcile round in steady state, 20 jobs, the
   operator as of ``--before`` (the last revision that listed per round) against this one.
5. ``refusals``: refused pod creates per second while a ResourceQuota refuses a job's
   last pod and the job is touched every 0.2 s (each touch wakes a round), against the
   touches per second (what retrying on every wake-up would cost), with the test suite's
   backoff (0.2 s doubling to a 1 s cap). Goal: <= 1.5 refused creates per second.

Prints figures and ratios; asserts nothing on time. Exits non-zero when a baseline
fails (the ratios would mean nothing).

    python tests/bench/bench_operator.py [plan] [throughput] [scale] [lists] [steady]
        [refusals] [--workers 256] [--nodes 10000] [--jobs 100] [--touches 40]
        [--throughput-before REV] [--throughput-inventory large|wide|xxlarge] [--trials 3]

The clusters of the scale runs (``scale``, and ``throughput`` on the 2,000- or
10,000-node inventories) renew KWOK's node Leases every few minutes instead of every
5 s, which two cores could not keep up with at that many nodes; no node fails in them.
"""

from __future__ import annotations

import argparse
import copy
import gc
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from ringwright.devcluster.control_plane import NODE_LEASE_SECONDS, Cluster  # noqa: E402
from ringwright.devcluster.install import install_api  # noqa: E402
from ringwright.devcluster.inventory import Inventory, RackGroup, node_manifests  # noqa: E402
from ringwright.kube import ApiError, KubeClient, api_path  # noqa: E402
from ringwright.objects import Obj  # noqa: E402
from ringwright.operator.api.base import API_VERSION  # noqa: E402
from ringwright.operator.api.schedulingpolicy import SchedulingPolicySpec  # noqa: E402
from ringwright.operator.apply.executor import MAX_IN_FLIGHT, slow_start  # noqa: E402
from ringwright.operator.heap import settle  # noqa: E402
from ringwright.operator.observe.cache import (  # noqa: E402
    JOB_CONFIGMAPS,
    NODES,
    POD_SLOTS,
    PODS_BY_JOB,
    POLICIES,
    PRIORITIES,
    IndexCache,
    Written,
)
from ringwright.operator.observe.job import observe  # noqa: E402
from ringwright.operator.observe.ledger import CapacityLedger, PodSlot, node_record, pod_slots  # noqa: E402
from ringwright.operator.plan.isolation import new_token, with_report_key  # noqa: E402
from ringwright.operator.plan.manifests import (  # noqa: E402
    JOB_LABEL,
    PLANNED_NODE_ANNOTATION,
    scaffold,
)
from ringwright.operator.plan.placement.inventory import Inventory as PlannerInventory  # noqa: E402
from ringwright.operator.plan.placement.inventory import inventory_from_objects  # noqa: E402
from ringwright.operator.plan.placement.placer import place  # noqa: E402
from ringwright.operator.plan.reconcile import Observed, Placement, Plan, plan  # noqa: E402
from ringwright.operator.settings import OperatorSettings  # noqa: E402
from ringwright.world import WORLD_KEY, world_configmap_name  # noqa: E402
from tests.procstat import cpu_seconds, peak_rss_bytes  # noqa: E402

WAIT_S = 1200.0
ROUNDS_METRIC = "ringwright_operator_reconcile_seconds"
"""The operator's round histogram (named ringwright_reconcile_seconds before c2ee691: a
bench reading the old name counted no rounds at all)."""
IMAGE = "ringwright/training:dev"
POLICY = SchedulingPolicySpec()


def wait_until(what: str, probe: Callable[[], bool], interval: float = 0.5) -> float:
    """Poll ``probe``; return the wall time at which it first held."""
    deadline = time.monotonic() + WAIT_S
    while not probe():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(interval)
    return time.time()


def drop_namespace(kube: KubeClient, ns: str) -> None:
    """Delete ``ns`` and wait until it is gone (call while the operator still runs: it
    releases its jobs' finalizers)."""
    kube.delete(api_path("v1", "namespaces", name=ns))

    def gone() -> bool:
        return kube.get_or_none(api_path("v1", "namespaces", name=ns)) is None

    wait_until(f"namespace {ns} gone", gone)


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def job_manifest(name: str, workers: int) -> Obj:
    return {
        "apiVersion": API_VERSION, "kind": "TrainingJob", "metadata": {"name": name},
        "spec": {"gpusPerWorker": 1,
                 "workers": {"min": workers, "replicas": workers, "max": workers,
                             "template": {"spec": {"containers": [
                                 {"name": "train", "image": IMAGE}]}}}},
    }


# -- 1. plan with 10,000 nodes -------------------------------------------------------------


def plan_part(nodes: int, rounds: int) -> bool:
    racks = nodes // 32
    inventory = Inventory(groups=[
        RackGroup(racks=racks // 2, nodes_per_rack=32, gpus_per_node=8,
                  gpu_model="NVIDIA-H100-80GB-HBM3", nodes_per_nvlink_domain=4),
        RackGroup(racks=racks - racks // 2, nodes_per_rack=32, gpus_per_node=8,
                  gpu_model="NVIDIA-A100-SXM4-40GB", nodes_per_nvlink_domain=4)])
    node_objs = node_manifests(inventory)
    rng = random.Random(7)
    # Half the nodes run a 4-GPU pod of someone else's.
    pods = [{"metadata": {"name": f"other-{i}", "namespace": "x", "uid": f"u{i}"},
             "spec": {"nodeName": n["metadata"]["name"], "containers": [
                 {"name": "c", "resources": {"requests": {POLICY.gpu_resource: "4"}}}]},
             "status": {"phase": "Running"}} for i, n in enumerate(node_objs) if i % 2]
    job = job_manifest("big", 64)
    job["metadata"].update(namespace="jobs", uid="j1", generation=1)
    settings = OperatorSettings()

    def old_round() -> None:
        inv = inventory_from_objects(node_objs, pods, POLICY.node_labels,
                                     POLICY.gpu_resource)
        plan(Observed(job=job, pods=[], world=None, reports={}, policy=POLICY,
                      inventory=inv), settings, 1e9, place)

    nodes_ix: dict[str, list[Obj]] = {n["metadata"]["name"]: [node_record(n)]
                                       for n in node_objs}
    slots_ix: dict[str, list[PodSlot]] = {}
    for p in pods:
        for name, slot in pod_slots(p).items():
            slots_ix.setdefault(name, []).append(slot)
    ledger = CapacityLedger()
    jobs_ix: dict[tuple[str, str], list[Obj]] = {}
    cms_ix: dict[tuple[str, str], list[Obj]] = {}
    cache = IndexCache({NODES: nodes_ix, POD_SLOTS: slots_ix, PODS_BY_JOB: jobs_ix,
                        JOB_CONFIGMAPS: cms_ix, POLICIES: {"default": [{}]}, PRIORITIES: {}},
                       ledger, Written())
    names = list(nodes_ix)

    def churn() -> None:
        # Between two rounds a few pods came and went: their nodes are marked dirty.
        ledger.mark(rng.sample(names, 5))

    def scan_round() -> None:
        # What the planner did before (node) groups: every node walked in every round.
        churn()
        observed = observe(cache, job)
        fresh = replace(observed, inventory=PlannerInventory(observed.inventory.nodes))
        plan(fresh, settings, 1e9, place)

    def new_round() -> None:
        churn()
        plan(observe(cache, job), settings, 1e9, place)

    running = running_job(job, plan(observe(cache, job), settings, 1e9, place), settings)

    def steady_round() -> None:
        churn()
        jobs_ix[("jobs", "big")], cms_ix[("jobs", world_configmap_name("big"))] = running[1:]
        steady = plan(observe(cache, running[0]), settings, 1e9 + 60, forbidden_placer)
        assert not steady.create and steady.world is None, "a steady round changed something"

    results: dict[str, tuple[list[float], list[float]]] = {}
    for label, fn, frozen in (
            ("old: rebuild inventory + plan", old_round, False),
            ("scan: every node per plan", scan_round, False),
            ("new: groups, plain gc", new_round, False),
            ("new: groups + heap keeper", new_round, True),
            ("new: steady Running job", steady_round, True)):
        gc.unfreeze()
        gc.collect()
        fn()  # warm up (the ledger's first build)
        if frozen:
            # What the operator's heap keeper does every heapFreezeSeconds.
            settle(sweep=False)
        wall, cpu = [], []
        for _ in range(rounds):
            t0, c0 = time.perf_counter(), time.process_time()
            fn()
            wall.append((time.perf_counter() - t0) * 1000)
            cpu.append((time.process_time() - c0) * 1000)
        results[label] = (wall, cpu)
    gc.unfreeze()
    old = results["old: rebuild inventory + plan"][0]
    new_wall, new_cpu = results["new: groups + heap keeper"]
    print(f"\n1. one round's observe + plan, 64 workers, {len(node_objs):,} nodes, "
          f"{rounds} rounds (ms; CPU = time.process_time of this process)")
    print(f"{'':32} {'wall p50':>9} {'wall p99':>9} {'CPU p50':>8} {'CPU p99':>8} "
          f"{'p99 ratio':>10}")
    for label, (wall, cpu) in results.items():
        print(f"{label:32} {pct(wall, .5):9.1f} {pct(wall, .99):9.1f} {pct(cpu, .5):8.1f} "
              f"{pct(cpu, .99):8.1f} {pct(wall, .99) / pct(old, .99):10.3f}")
    print(f"load average (1, 5, 15 min): {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(f"goal p99 <= 50 ms: wall {'met' if pct(new_wall, .99) <= 50 else 'NOT met'}, "
          f"CPU {'met' if pct(new_cpu, .99) <= 50 else 'NOT met'}")
    return bool(old)


def forbidden_placer(*_: object) -> Placement:
    raise AssertionError("a Running job with every pod in place was placed again")


def running_job(job: Obj, first: Plan, settings: OperatorSettings
                ) -> tuple[Obj, list[Obj], list[Obj]]:
    """``job`` as it is once ``first``'s pods run on their planned nodes and a world is
    published: (job with status, its pods, its world ConfigMap)."""
    ready = [{"type": "Ready", "status": "True"}]
    bound = [{**p, "metadata": {**p["metadata"], "uid": p["metadata"]["name"],
                                "creationTimestamp": "2001-01-01T00:00:00Z"},
              "spec": {**p["spec"], "nodeName": p["metadata"]["annotations"][
                  PLANNED_NODE_ANNOTATION]},
              "status": {"phase": "Running", "podIP": f"127.0.1.{i % 250}",
                         "conditions": ready}}
             for i, p in enumerate(first.create)]
    base = {**job, "status": first.status}
    observed = Observed(job=base, pods=bound, world=None, reports={}, policy=POLICY,
                        inventory=PlannerInventory(()))
    settled = plan(observed, settings, 1e9 + settings.settle_seconds + 1, forbidden_placer)
    settled = plan(replace(observed, job={**job, "status": settled.status}), settings,
                   1e9 + 2 * settings.settle_seconds + 2, forbidden_placer)
    assert settled.world is not None, "the bench's job never got a world"
    world_cm = {"metadata": {"name": world_configmap_name("big"), "namespace": "jobs",
                             "resourceVersion": "1"},
                "data": {WORLD_KEY: settled.world.to_json()}}
    return {**job, "status": settled.status}, bound, [world_cm]


# -- cluster helpers ---------------------------------------------------------------------


def make_namespace(kube: KubeClient, name: str) -> str:
    kube.create(api_path("v1", "namespaces"), {"metadata": {"name": name}})
    wait_until(f"the default ServiceAccount in {name}", lambda: kube.get_or_none(
        api_path("v1", "serviceaccounts", name, "default")) is not None)
    return name


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class Operator:
    """``python -m ringwright.operator`` with a metrics port, as the bench runs it."""

    def __init__(self, cluster: Cluster, log: Path, env: dict[str, str] | None = None,
                 args: tuple[str, ...] = ()) -> None:
        self.port = free_port()
        env = {**os.environ, "KUBECONFIG": str(cluster.kubeconfig), **(env or {})}
        self.log = log
        with log.open("wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "ringwright.operator", "--metrics-port", str(self.port),
                 *args],
                env=env, stdout=out, stderr=subprocess.STDOUT, cwd="/")
        wait_until("the operator to log in", lambda: self.proc.poll() is not None or
                   "Initial authentication has finished" in log.read_text(errors="replace"))
        if self.proc.poll() is not None:
            raise RuntimeError(f"the operator exited:\n{log.read_text()[-3000:]}")

    @staticmethod
    def read_rounds(port: int) -> float:
        """Rounds so far of the operator serving metrics on ``port``."""
        return Operator.parse_rounds(port)[0]

    def rounds(self) -> tuple[float, list[tuple[float, float]]]:
        """Rounds so far and the histogram's cumulative (upper bound, count) buckets."""
        return self.parse_rounds(self.port)

    @staticmethod
    def parse_rounds(port: int) -> tuple[float, list[tuple[float, float]]]:
        """Rounds so far and the histogram's cumulative (upper bound, count) buckets."""
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics").read().decode()
        buckets: list[tuple[float, float]] = []
        count = 0.0
        for family in text_string_to_metric_families(text):
            if family.name != ROUNDS_METRIC:
                continue
            for sample in family.samples:
                if sample.name.endswith("_bucket"):
                    buckets.append((float(sample.labels["le"]), sample.value))
                elif sample.name.endswith("_count"):
                    count = sample.value
        return count, sorted(buckets)

    def stop(self) -> float:
        rss = peak_rss_bytes(self.proc.pid) / 2**20
        self.proc.terminate()
        self.proc.wait(timeout=30)
        return rss


def histogram_quantile(q: float, buckets: list[tuple[float, float]]) -> float:
    """Prometheus' histogram_quantile over cumulative buckets (linear within a bucket)."""
    total = buckets[-1][1] if buckets else 0
    if not total:
        return float("nan")
    rank, lower, below = q * total, 0.0, 0.0
    for upper, count in buckets:
        if count >= rank:
            if upper == float("inf"):
                return lower
            return lower + (upper - lower) * (rank - below) / max(count - below, 1e-9)
        lower, below = upper, count
    return lower


def apiserver_requests(kube: KubeClient, subresources: bool = False
                       ) -> Counter[tuple[str, str]]:
    """``apiserver_request_total`` summed by (verb, resource[/subresource])."""
    totals: Counter[tuple[str, str]] = Counter()
    for family in text_string_to_metric_families(kube.get_text("/metrics")):
        if family.name != "apiserver_request":
            continue
        for sample in family.samples:
            if sample.name == "apiserver_request_total":
                resource = sample.labels.get("resource", "")
                if subresources and sample.labels.get("subresource"):
                    resource += "/" + sample.labels["subresource"]
                totals[(sample.labels.get("verb", ""), resource)] += int(sample.value)
    return totals


# -- 2. 256 workers against the same pods created bare ------------------------------------


TRIALS = 3
"""Baseline and operator trials each, alternating, in one run (``--trials``)."""
CPU = "cpu_seconds"
"""The operator's CPU time (user + system) in a trial, beside its own metrics."""
PLURALS = {"ServiceAccount": "serviceaccounts", "Role": "roles", "RoleBinding": "rolebindings",
           "Service": "services", "ConfigMap": "configmaps"}


class Timeline:
    """What the API server told a watch of one namespace, stamped on arrival (monotonic):
    each pod's creation, binding and readiness, the world ConfigMap and the job's Running.

    The same watch times the baseline and the operator, so both carry the same delay."""

    def __init__(self, cluster: Cluster, namespace: str, world: str) -> None:
        self.created: dict[str, float] = {}
        self.bound: dict[str, float] = {}
        self.ready: dict[str, float] = {}
        self.world: float | None = None
        self.running: float | None = None
        self.restarts = 0
        """Watches the API server dropped and this one started again."""
        self._closed = False
        self._world_name = world
        self._clients: list[KubeClient] = []
        self._threads = [threading.Thread(target=self._follow, args=(cluster, path, seen),
                                          daemon=True) for path, seen in (
            (api_path("v1", "pods", namespace), self._pod),
            (api_path("v1", "configmaps", namespace), self._configmap),
            (api_path(API_VERSION, "trainingjobs", namespace), self._job))]
        self._started = threading.Semaphore(0)
        for t in self._threads:
            t.start()
        for _ in self._threads:
            self._started.acquire()
        time.sleep(0.5)  # the watch requests are sent once each thread iterates

    def _follow(self, cluster: Cluster, path: str, seen: Callable[[Obj, float], None]) -> None:
        kube = cluster.client()
        self._clients.append(kube)
        self._started.release()
        version = ""
        while not self._closed:
            try:
                for event in kube.watch(path, resource_version=version, timeout_seconds=1800):
                    obj = event.get("object") or {}
                    if event.get("type") == "ERROR":
                        version = ""  # expired: start again from the current state
                        break
                    version = obj.get("metadata", {}).get("resourceVersion", version)
                    if event.get("type") in ("ADDED", "MODIFIED"):
                        seen(obj, time.monotonic())
            except (ApiError, RuntimeError):
                # The API server drops a watch that falls behind; close() cuts it.
                self.restarts += 0 if self._closed else 1

    def _pod(self, pod: Obj, now: float) -> None:
        name = pod["metadata"]["name"]
        self.created.setdefault(name, now)
        if pod["spec"].get("nodeName"):
            self.bound.setdefault(name, now)
        status = pod.get("status") or {}
        if status.get("phase") == "Running" and any(
                c.get("type") == "Ready" and c.get("status") == "True"
                for c in status.get("conditions") or []):
            self.ready.setdefault(name, now)

    def _configmap(self, cm: Obj, now: float) -> None:
        if self.world is None and cm["metadata"]["name"] == self._world_name and (
                cm.get("data") or {}).get(WORLD_KEY):
            self.world = now

    def _job(self, job: Obj, now: float) -> None:
        if self.running is None and (job.get("status") or {}).get("phase") == "Running":
            self.running = now

    def close(self) -> None:
        self._closed = True
        for kube in self._clients:
            kube.close()


@dataclass
class Trial:
    """One trial's figures, in seconds from the first request of the trial."""

    label: str
    load: float
    first_create: float
    last_create: float
    last_bound: float
    last_ready: float
    world: float | None
    running: float | None
    requests: Counter[tuple[str, str]]
    metrics: dict[str, float]
    watch_restarts: int

    @property
    def done(self) -> float:
        """Until every pod is Running (baseline) or the job is Running (operator)."""
        return self.running if self.running is not None else self.last_ready


def trial_figures(label: str, load: float, t0: float, tl: Timeline,
                  requests: Counter[tuple[str, str]], metrics: dict[str, float]) -> Trial:
    return Trial(label, load, min(tl.created.values()) - t0, max(tl.created.values()) - t0,
                 max(tl.bound.values()) - t0, max(tl.ready.values()) - t0,
                 None if tl.world is None else tl.world - t0,
                 None if tl.running is None else tl.running - t0, requests, metrics,
                 tl.restarts)


def operator_metrics(port: int) -> dict[str, float]:
    """Every sample the operator serves, summed over labels, by sample name."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics").read().decode()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if not sample.name.endswith("_bucket"):
                out[sample.name] = out.get(sample.name, 0.0) + sample.value
    return out


def defaulted_job(kube: KubeClient, workers: int) -> Obj:
    """The bench's TrainingJob as the API server stores it (schema defaults filled in),
    read back from a namespace no operator reconciles and deleted again."""
    ns = make_namespace(kube, "job-defaults")
    job = kube.create(api_path(API_VERSION, "trainingjobs", ns), job_manifest("big", workers))
    drop_namespace(kube, ns)
    return job


def operator_pods(kube: KubeClient, stored: Obj, namespace: str) -> list[Obj]:
    """The pods the operator's first round creates for ``stored`` in ``namespace`` on
    the cluster's free nodes: its own observe-free plan (same placement, affinity,
    priority, labels, volumes, hardening), with a report key each as its apply step
    adds, and without the controller reference (no job owns them: the garbage collector
    would delete them)."""
    job = copy.deepcopy(stored)
    job["metadata"]["namespace"] = namespace
    nodes = kube.list(api_path("v1", "nodes"))
    inventory = inventory_from_objects(nodes, [], POLICY.node_labels, POLICY.gpu_resource)
    decided = plan(Observed(job=job, pods=[], world=None, reports={}, policy=POLICY,
                            inventory=inventory), OperatorSettings(), time.time(), place)
    pods = []
    for pod in decided.create:
        pod["metadata"].pop("ownerReferences", None)
        pods.append(with_report_key(pod, new_token()))
    return pods


def baseline_trial(cluster: Cluster, kube: KubeClient, stored: Obj, ns: str,
                   pool: ThreadPoolExecutor) -> Trial:
    """The operator's pods created by a plain script, as the operator's apply step sends
    them (slow-start batches up to the same cap); done when every pod is Running."""
    name = stored["metadata"]["name"]
    pods = operator_pods(kube, stored, ns)
    # The job's scaffold, made before the clock starts (the operator makes it inside its
    # own time): admission wants the pods' ServiceAccount, and the headless Service
    # makes the cluster's controllers follow the pods as they do the operator's.
    job = {**stored, "metadata": {**stored["metadata"], "namespace": ns}}
    for obj in scaffold(job):
        obj["metadata"].pop("ownerReferences")
        kube.create(api_path(obj["apiVersion"], PLURALS[obj["kind"]], ns), obj)
    tl = Timeline(cluster, ns, world_configmap_name(name))
    try:
        load, before = os.getloadavg()[0], apiserver_requests(kube)
        t0 = time.monotonic()

        def create(pod: Obj) -> None:
            kube.create(api_path("v1", "pods", ns), pod)

        _, refusal = slow_start(pods, create, pool)
        if refusal is not None:
            raise RuntimeError(f"baseline create refused: {refusal.error}")
        wait_until("every baseline pod Running", lambda: len(tl.ready) == len(pods), 0.1)
        requests = apiserver_requests(kube) - before
    finally:
        tl.close()
    return trial_figures("baseline", load, t0, tl, requests, {})


def operator_trial(cluster: Cluster, kube: KubeClient, stored: Obj, ns: str, label: str,
                   env: dict[str, str], log: Path) -> tuple[Trial, float]:
    """A fresh operator (with ``env``) reconciles the job until it is Running; returns
    the trial and the operator's peak RSS."""
    name = stored["metadata"]["name"]
    # One operator after another: none waits out the last one's Lease.
    op = Operator(cluster, log, env, ("--no-leader-election",))
    try:
        time.sleep(2)  # its watches list what exists
        tl = Timeline(cluster, ns, world_configmap_name(name))
        try:
            load, before = os.getloadavg()[0], apiserver_requests(kube)
            metrics0 = operator_metrics(op.port)
            cpu0 = cpu_seconds(op.proc.pid)
            t0 = time.monotonic()
            kube.create(api_path(API_VERSION, "trainingjobs", ns),
                        job_manifest(name, int(stored["spec"]["workers"]["replicas"])))
            wait_until("the job Running", lambda: tl.running is not None, 0.1)
            requests = apiserver_requests(kube) - before
            metrics = {k: v - metrics0.get(k, 0.0)
                       for k, v in operator_metrics(op.port).items()}
            metrics[CPU] = cpu_seconds(op.proc.pid) - cpu0
        finally:
            tl.close()
        drop_namespace(kube, ns)  # while the operator runs: it releases the finalizer
    finally:
        rss = op.stop()
    return trial_figures(label, load, t0, tl, requests, metrics), rss


def spread(values: list[float]) -> str:
    """Median and range of ``values``."""
    return f"{statistics.median(values):6.2f} ({min(values):.2f}-{max(values):.2f})"


SCALE_INVENTORIES = {"xlarge", "xxlarge"}
"""The 2,000- and 10,000-node inventories."""


def lease_seconds(inventory: str) -> int:
    """KWOK's node Lease duration for a cluster of ``inventory``: 10 minutes for the
    scale inventories (one renewal per node every 150 s: 13 writes a second at 2,000
    nodes, 67 at 10,000), the devcluster's default otherwise."""
    return 600 if inventory in SCALE_INVENTORIES else NODE_LEASE_SECONDS


def throughput_part(work: Path, workers: int, before: str = "",
                    inventory: str = "large", repeats: int = TRIALS,
                    variants: Sequence[str] = ()) -> bool:
    """Baseline and operator trials in turn, three each; with ``before`` (a git revision),
    that revision's operator takes a turn in each round too, and so does this operator
    with each of ``variants`` (``LABEL:VAR=VALUE,...``: its environment, e.g. a setting)."""
    cluster = Cluster(name="bench-operator", root=work / "throughput",
                      node_lease_seconds=lease_seconds(inventory))
    print(f"\n2. starting a cluster with the {inventory} inventory in {work} ...", flush=True)
    cluster.up(inventory=inventory, timeout=900)
    operators = [(f"operator {before}", {"PYTHONPATH": str(old_tree(work, before))})
                 ] if before else []
    operators.append(("operator", {}))
    for variant in variants:
        label, _, assignments = variant.partition(":")
        operators.append((label, dict(a.split("=", 1) for a in assignments.split(","))))
    trials: list[Trial] = []
    rss: dict[str, float] = {}
    try:
        with cluster.client() as kube, ThreadPoolExecutor(MAX_IN_FLIGHT) as pool:
            install_api(kube)
            stored = defaulted_job(kube, workers)
            kinds: list[tuple[str, dict[str, str]] | None] = [None, *operators]
            for i in range(repeats):
                # Each kind takes each place in the order once: the load drifts.
                for k, kind in enumerate(kinds[i % len(kinds):] + kinds[:i % len(kinds)]):
                    ns = make_namespace(kube, f"trial-{i}-{k}")
                    if kind is None:
                        trials.append(baseline_trial(cluster, kube, stored, ns, pool))
                        drop_namespace(kube, ns)
                        continue
                    label, env = kind
                    trial, peak = operator_trial(cluster, kube, stored, ns, label, env,
                                                 work / f"throughput-operator-{i}-{k}.log")
                    trials.append(trial)
                    rss[label] = max(rss.get(label, 0.0), peak)
                print(f"  round {i + 1}: " + ", ".join(
                    f"{t.label} {t.done:.2f} s (load {t.load:.2f})"
                    for t in trials[-len(kinds):]), flush=True)
    finally:
        cluster.down()
    groups = {label: [t for t in trials if t.label == label]
              for label in ["baseline", *(label for label, _ in operators)]}
    plain = statistics.median(t.done for t in groups["baseline"])
    print(f"\n{workers} workers on the {inventory} inventory, {repeats} trials each, "
          f"alternating; the same pod manifests "
          f"(the operator's plan), at most {MAX_IN_FLIGHT} creates in flight (slow start)")
    print(f"{'seconds from the first request: median (range)':48}"
          + "".join(f"{label:>22}" for label in groups))
    rows: list[tuple[str, Callable[[Trial], float | None]]] = [
        ("first pod created (observe, scaffold, plan)", lambda t: t.first_create),
        ("last pod created", lambda t: t.last_create),
        ("last pod bound by the scheduler", lambda t: t.last_bound),
        ("last pod Running and Ready", lambda t: t.last_ready),
        ("world ConfigMap published", lambda t: t.world),
        ("job Running (status written)", lambda t: t.running)]
    for row, get in rows:
        cells = []
        for group in groups.values():
            values = [v for v in (get(t) for t in group) if v is not None]
            cells.append(spread(values) if values else "-")
        print(f"{row:48}" + "".join(f"{c:>22}" for c in cells))
    ratios = [f"{'':>22}"]
    for group in list(groups.values())[1:]:
        done = [t.done for t in group]
        ratios.append(f"{statistics.median(done) / plain:6.2f} ({min(done) / plain:.2f}-"
                      f"{max(done) / plain:.2f})")
    print(f"{'ratio: job Running / baseline pods Running':48}"
          + "".join(f"{c:>22}" for c in ratios))
    loads = [t.load for t in trials]
    print(f"load average (1 min) at the trials' starts: {min(loads):.2f}-{max(loads):.2f} "
          f"(now {' '.join(f'{x:.2f}' for x in os.getloadavg())})")
    for label, group in list(groups.items())[1:]:
        rounds = [t.metrics.get(f"{ROUNDS_METRIC}_count", 0.0) for t in group]
        round_s = [t.metrics.get(f"{ROUNDS_METRIC}_sum", 0.0) for t in group]
        plan_s = [t.metrics.get("ringwright_operator_planning_seconds_sum", 0.0)
                  for t in group]
        cpu = [t.metrics.get(CPU, 0.0) for t in group]
        print(f"{label}: CPU seconds per trial {spread(cpu)}; rounds {spread(rounds)}, "
              f"seconds in rounds {spread(round_s)}, of which planning {spread(plan_s)}; "
              f"peak RSS {rss[label]:.0f} MiB")
    print("kube-apiserver requests per trial (all clients), median:")
    keys = sorted({k for t in trials for k in t.requests},
                  key=lambda k: -max(t.requests.get(k, 0) for t in trials))
    for key in keys[:12]:
        counts = [statistics.median(t.requests.get(key, 0) for t in g) for g in groups.values()]
        print(f"  {key[0] + ' ' + key[1]:46}" + "".join(f"{c:>22.0f}" for c in counts))
    totals = [statistics.median(sum(t.requests.values()) for t in g) for g in groups.values()]
    print(f"  {'all':46}" + "".join(f"{c:>22.0f}" for c in totals))
    print(f"watches the API server dropped and the bench resumed: "
          f"{sum(t.watch_restarts for t in trials)}")
    return True


# -- 3. 2,000 nodes, 100 jobs -------------------------------------------------------------


def bare_scale(cluster: Cluster, kube: KubeClient, stored: Obj, sizes: list[int], ns: str,
               pool: ThreadPoolExecutor) -> float:
    """The pods the operator would make for jobs of ``sizes`` workers, placed one job after
    another (each plan counts the pods planned before it), created bare: 16 jobs at a
    time as the bench applies them, each job's pods in the operator's slow-start window
    on one shared pool of its size; seconds until every pod is Running."""
    nodes = kube.list(api_path("v1", "nodes"))
    planned: list[Obj] = []
    by_job: list[list[Obj]] = []
    for i, size in enumerate(sizes):
        job = copy.deepcopy(stored)
        job["metadata"].update(name=f"job-{i}", namespace=ns, uid=f"bare-{i}")
        job["spec"]["workers"].update(min=size, replicas=size, max=size)
        inventory = inventory_from_objects(nodes, planned, POLICY.node_labels,
                                           POLICY.gpu_resource)
        decided = plan(Observed(job=job, pods=[], world=None, reports={}, policy=POLICY,
                                inventory=inventory), OperatorSettings(), time.time(), place)
        if len(decided.create) != size:
            raise RuntimeError(f"job-{i}: the plan made {len(decided.create)} of {size} pods")
        for pod in decided.create:
            pod["metadata"].pop("ownerReferences", None)
            planned.append({"spec": {**pod["spec"], "nodeName": pod["metadata"][
                "annotations"][PLANNED_NODE_ANNOTATION]}})
        by_job.append([with_report_key(p, new_token()) for p in decided.create])
        for obj in scaffold(job):
            obj["metadata"].pop("ownerReferences")
            kube.create(api_path(obj["apiVersion"], PLURALS[obj["kind"]], ns), obj)
    tl = Timeline(cluster, ns, "")
    try:
        t0 = time.monotonic()

        def create(pod: Obj) -> None:
            kube.create(api_path("v1", "pods", ns), pod)

        def one_job(pods: list[Obj]) -> None:
            _, refusal = slow_start(pods, create, pool)
            if refusal is not None:
                raise RuntimeError(f"baseline create refused: {refusal.error}")

        with ThreadPoolExecutor(16) as jobs_pool:
            list(jobs_pool.map(one_job, by_job))
        total = sum(sizes)
        wait_until("every bare pod Running", lambda: len(tl.ready) == total, 0.5)
        return max(tl.ready.values()) - t0
    finally:
        tl.close()


def gangs_and_booking(kube: KubeClient, ns: str, sizes: list[int]) -> tuple[int, int]:
    """(jobs whose every worker runs on a node, nodes given more GPUs than they have)."""
    pods = kube.list(api_path("v1", "pods", ns))
    running: Counter[str] = Counter()
    gpus: Counter[str] = Counter()
    for pod in pods:
        node = pod["spec"].get("nodeName")
        if node and (pod.get("status") or {}).get("phase") == "Running":
            running[pod["metadata"]["labels"][JOB_LABEL]] += 1
            for c in pod["spec"]["containers"]:
                gpus[node] += int(((c.get("resources") or {}).get("limits") or {}).get(
                    POLICY.gpu_resource, 0))
    capacity = {n["metadata"]["name"]: int(n["status"]["allocatable"].get(
        POLICY.gpu_resource, 0)) for n in kube.list(api_path("v1", "nodes"))}
    whole = sum(running[f"job-{i}"] == size for i, size in enumerate(sizes))
    return whole, sum(used > capacity.get(node, 0) for node, used in gpus.items())


def scale_part(work: Path, jobs: int, steady_s: float) -> bool:
    cluster = Cluster(name="bench-operator-scale", root=work / "scale",
                      node_lease_seconds=lease_seconds("xlarge"))
    print(f"\n3. starting a cluster with the xlarge inventory in {work} ...", flush=True)
    cluster.up(inventory="xlarge", timeout=900)
    rng = random.Random(11)
    sizes = [rng.randint(4, 32) for _ in range(jobs)]
    try:
        with cluster.client() as kube:
            install_api(kube)
            nodes = len(kube.list(api_path("v1", "nodes")))
            stored = defaulted_job(kube, 4)
            bare_ns = make_namespace(kube, "bare")
            load_bare = os.getloadavg()[0]
            with ThreadPoolExecutor(MAX_IN_FLIGHT) as pool:
                bare = bare_scale(cluster, kube, stored, sizes, bare_ns, pool)
            drop_namespace(kube, bare_ns)
            print(f"  the same pods bare: every pod Running after {bare:.1f} s (load "
                  f"{load_bare:.2f})", flush=True)
            ns = make_namespace(kube, "scale")
            op = Operator(cluster, work / "scale-operator.log")
            try:
                time.sleep(2)
                before = apiserver_requests(kube)
                rounds_before, _ = op.rounds()
                started = time.time()
                with ThreadPoolExecutor(16) as pool:
                    list(pool.map(lambda i: kube.create(
                        api_path(API_VERSION, "trainingjobs", ns),
                        job_manifest(f"job-{i}", sizes[i])), range(jobs)))

                def all_running() -> bool:
                    items = kube.list(api_path(API_VERSION, "trainingjobs", ns))
                    phases = [(j.get("status") or {}).get("phase") for j in items]
                    return phases.count("Running") == jobs

                load_op = os.getloadavg()[0]
                done = wait_until("every job Running", all_running, interval=2.0) - started
                whole, double_booked = gangs_and_booking(kube, ns, sizes)
                after = apiserver_requests(kube)
                rounds_after, buckets = op.rounds()
                # Steady state: nothing changes; the operator resyncs every job.
                time.sleep(steady_s)
                steady = apiserver_requests(kube)
                rounds_steady, buckets = op.rounds()
            finally:
                rss = op.stop()
    finally:
        cluster.down()
    rounds = rounds_after - rounds_before
    busy = after - before
    quiet = steady - after
    quiet_rounds = rounds_steady - rounds_after
    print(f"{nodes:,} nodes, {jobs} jobs of 4-32 workers ({sum(sizes)} pods), applied at once")
    print(f"time until every job Running: {done:.1f} s (load {load_op:.2f} at the start); "
          f"the same pods bare until every pod Running: {bare:.1f} s (load {load_bare:.2f}); "
          f"ratio {done / bare:.2f}")
    print(f"gangs whole (every worker Running on a node): {whole} of {jobs}; nodes given "
          f"more GPUs than they have: {double_booked}")
    print(f"reconcile rounds: {rounds:.0f} until Running, {quiet_rounds:.0f} in "
          f"{steady_s:.0f} s of steady state")
    print(f"reconcile latency: p50 {histogram_quantile(.5, buckets) * 1000:.1f} ms, "
          f"p99 {histogram_quantile(.99, buckets) * 1000:.1f} ms")
    print("kube-apiserver requests (all clients: operator, scheduler, KWOK, this bench):")
    for label, delta, n in (("until Running", busy, rounds), ("steady state", quiet,
                                                               quiet_rounds)):
        by_verb: Counter[str] = Counter()
        for (verb, _), value in delta.items():
            by_verb[verb] += int(value)
        total = sum(by_verb.values())
        lists = by_verb.get("LIST", 0)
        print(f"  {label:14} {total:7d} requests, {total / max(n, 1):6.2f} per round; "
              f"LIST {lists} ({lists / max(n, 1):.3f} per round); "
              + ", ".join(f"{v} {c}" for v, c in by_verb.most_common(6)))
    print(f"operator peak RSS: {rss:.0f} MiB")
    return True


# -- 4. LIST calls per round, before and after -----------------------------------------


def old_tree(work: Path, rev: str) -> Path:
    """The operator as of ``rev``, laid out as an importable ``ringwright`` package."""
    src, pkg = work / "before-src", work / "before-pkg"
    src.mkdir()
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev], check=True,
                             capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(src)], input=archive, check=True)
    (pkg / "ringwright").mkdir(parents=True)
    for item in (src / "src" / "ringwright").iterdir():
        (pkg / "ringwright" / item.name).symlink_to(item)
    for folder in ("operator", "runtime", "devcluster"):
        (pkg / "ringwright" / folder).symlink_to(src / folder)
    return pkg


def lists_part(work: Path, rev: str, jobs: int, window_s: float) -> bool:
    cluster = Cluster(name="bench-operator-lists", root=work / "lists")
    print(f"\n4. LIST calls per round, {jobs} jobs in steady state for {window_s:.0f} s: "
          f"the operator as of {rev} against this one", flush=True)
    cluster.up(inventory="large")
    resync = OperatorSettings().resync_seconds
    rows = []
    try:
        with cluster.client() as kube:
            install_api(kube)
            for label, pythonpath in (("before", str(old_tree(work, rev))), ("after", "")):
                ns = make_namespace(kube, f"lists-{label}")
                env = {**os.environ, "KUBECONFIG": str(cluster.kubeconfig)}
                args = [sys.executable, "-m", "ringwright.operator"]
                port = free_port()
                if pythonpath:
                    env["PYTHONPATH"] = pythonpath
                else:
                    args += ["--metrics-port", str(port)]
                log = work / f"lists-{label}.log"
                with log.open("wb") as out:
                    proc = subprocess.Popen(args, env=env, stdout=out,
                                            stderr=subprocess.STDOUT, cwd="/")
                try:
                    with ThreadPoolExecutor(8) as pool:
                        def create(i: int, ns: str = ns) -> Obj:
                            return kube.create(api_path(API_VERSION, "trainingjobs", ns),
                                               job_manifest(f"job-{i}", 4))

                        list(pool.map(create, range(jobs)))

                    def all_created(ns: str = ns) -> bool:
                        pods = kube.list(api_path("v1", "pods", ns))
                        return len(pods) >= 4 * jobs

                    # Steady state is what counts here, wherever the jobs landed.
                    wait_until("every pod created", all_created, interval=2.0)
                    time.sleep(resync)  # let the last events settle
                    start = apiserver_requests(kube)
                    rounds0 = None if pythonpath else Operator.read_rounds(port)
                    time.sleep(window_s)
                    delta = apiserver_requests(kube) - start
                    rounds = (jobs * window_s / resync if rounds0 is None
                              else Operator.read_rounds(port) - rounds0)
                    phases = [(j.get("status") or {}).get("phase") for j in
                              kube.list(api_path(API_VERSION, "trainingjobs", ns))]
                    unbound = sum(not p["spec"].get("nodeName")
                                  for p in kube.list(api_path("v1", "pods", ns)))
                    # While the operator runs: it releases its jobs' finalizers.
                    drop_namespace(kube, ns)
                finally:
                    proc.terminate()
                    proc.wait(timeout=30)
                lists = sum(v for (verb, _), v in delta.items() if verb == "LIST")
                gets = sum(v for (verb, _), v in delta.items() if verb == "GET")
                rows.append((label, rounds, lists, gets, rounds0 is None,
                             phases.count("Running"), unbound))
    finally:
        cluster.down()
    print(f"{'':8} {'rounds':>8} {'LIST':>6} {'per round':>10} {'GET':>6} {'per round':>10} "
          f"{'jobs Running':>13} {'pods unbound':>13}")
    for label, rounds, lists, gets, estimated, up, unbound in rows:
        mark = "*" if estimated else " "
        print(f"{label:8} {rounds:7.0f}{mark} {lists:6d} {lists / max(rounds, 1):10.2f} "
              f"{gets:6d} {gets / max(rounds, 1):10.2f} {up:>8d}/{jobs:<4d} {unbound:13d}")
    print("* rounds estimated as jobs x window / resyncSeconds (that operator has no metrics)")
    return bool(rows) and rows[0][2] > 0


# -- 5. requests per round in steady state, before and after ------------------------------


def steady_part(work: Path, rev: str, jobs: int, window_s: float) -> bool:
    """Requests per reconcile round while ``jobs`` Running jobs change nothing: the
    operator as of ``rev`` against this one, each alone on the same cluster."""
    cluster = Cluster(name="bench-operator-steady", root=work / "steady")
    print(f"\n5. API requests per round, {jobs} Running jobs in steady state for "
          f"{window_s:.0f} s: the operator as of {rev} against this one", flush=True)
    cluster.up(inventory="large")
    results: dict[str, tuple[float, Counter[tuple[str, str]]]] = {}
    try:
        with cluster.client() as kube:
            install_api(kube)
            for label, pythonpath in ((f"before ({rev})", str(old_tree(work, rev))),
                                      ("after", "")):
                ns = make_namespace(kube, f"steady-{len(results)}")
                env = {**os.environ, "KUBECONFIG": str(cluster.kubeconfig)}
                if pythonpath:
                    env["PYTHONPATH"] = pythonpath
                port = free_port()
                log = work / f"steady-{len(results)}.log"
                with log.open("wb") as out:
                    proc = subprocess.Popen(
                        [sys.executable, "-m", "ringwright.operator", "--metrics-port",
                         str(port), "--no-leader-election"],
                        env=env, stdout=out, stderr=subprocess.STDOUT, cwd="/")
                try:
                    with ThreadPoolExecutor(8) as pool:
                        list(pool.map(lambda i, ns=ns: kube.create(
                            api_path(API_VERSION, "trainingjobs", ns),
                            job_manifest(f"job-{i}", 4)), range(jobs)))

                    def all_running(ns: str = ns) -> bool:
                        items = kube.list(api_path(API_VERSION, "trainingjobs", ns))
                        return [(j.get("status") or {}).get("phase")
                                for j in items].count("Running") == jobs

                    wait_until("every job Running", all_running, interval=2.0)
                    time.sleep(OperatorSettings().resync_seconds)  # the last events settle
                    start, rounds0 = apiserver_requests(kube, True), Operator.read_rounds(port)
                    time.sleep(window_s)
                    delta = apiserver_requests(kube, True) - start
                    results[label] = (Operator.read_rounds(port) - rounds0, delta)
                    # While the operator runs: it releases its jobs' finalizers.
                    drop_namespace(kube, ns)
                finally:
                    proc.terminate()
                    proc.wait(timeout=30)
    finally:
        cluster.down()
    keys = sorted({k for _, d in results.values() for k in d},
                  key=lambda k: -max(d.get(k, 0) for _, d in results.values()))
    print(f"{'requests per round (all clients)':34}"
          + "".join(f"{label:>22}" for label in results))
    print(f"{'rounds in the window':34}" + "".join(f"{r:22.0f}" for r, _ in results.values()))
    print(f"{'rounds per job per 10 s':34}" + "".join(
        f"{r / jobs / window_s * 10:22.2f}" for r, _ in results.values()))
    for verb, resource in keys[:14]:
        print(f"{verb + ' ' + resource:34}" + "".join(
            f"{d.get((verb, resource), 0) / max(r, 1):22.3f}" for r, d in results.values()))
    print(f"{'all requests':34}" + "".join(
        f"{sum(d.values()) / max(r, 1):22.3f}" for r, d in results.values()))
    return len(results) == 2 and all(r > 0 for r, _ in results.values())


# -- 5. refused creates are retried after a backoff, not on every wake-up ----------------


def refused_creates(port: int, namespace: str) -> float:
    """Pod creates the API server refused in ``namespace``, by the operator's counter."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics").read().decode()
    return sum(s.value for family in text_string_to_metric_families(text)
               for s in family.samples
               if s.name == "ringwright_operator_writes_refused_total"
               and s.labels.get("namespace") == namespace and s.labels.get("kind") == "Pod")


def refusals_part(work: Path, touches: int) -> bool:
    cluster = Cluster(name="bench-operator-refusals", root=work / "refusals")
    print(f"\n5. starting a cluster in {work} ...", flush=True)
    cluster.up("default")
    try:
        with cluster.client() as kube:
            install_api(kube)
            ns = make_namespace(kube, "quota")
            kube.create(api_path("v1", "resourcequotas", ns), {
                "apiVersion": "v1", "kind": "ResourceQuota", "metadata": {"name": "q"},
                "spec": {"hard": {"pods": "3"}}})
            wait_until("the quota's usage counted", lambda: bool(
                (kube.get(api_path("v1", "resourcequotas", ns, "q")).get("status") or {})
                .get("used")))
            op = Operator(cluster, work / "refusals-operator.log", env={
                "RINGWRIGHT_BACKOFF_BASE_SECONDS": "0.2",
                "RINGWRIGHT_BACKOFF_CAP_SECONDS": "1", "RINGWRIGHT_RESYNC_SECONDS": "2"})
            try:
                job = {"apiVersion": API_VERSION, "kind": "TrainingJob",
                       "metadata": {"name": "quota"},
                       "spec": {"workers": {"min": 2, "replicas": 4, "max": 16, "template": {
                           "spec": {"containers": [{"name": "train", "image": IMAGE}]}}}}}
                kube.create(api_path(API_VERSION, "trainingjobs", ns), job)
                wait_until("a refused create", lambda: refused_creates(op.port, ns) >= 1)
                start, started = refused_creates(op.port, ns), time.monotonic()
                for i in range(touches):
                    kube.merge_patch(api_path(API_VERSION, "trainingjobs", ns, "quota"),
                                     {"metadata": {"annotations": {"bench/touch": str(i)}}})
                    time.sleep(0.2)
                seconds = time.monotonic() - started
                refused = refused_creates(op.port, ns) - start
            finally:
                op.stop()
    finally:
        cluster.down()
    print(f"{'':44} {'per s':>8}")
    print(f"{f'touches (each wakes a round), {touches}':44} {touches / seconds:8.2f}")
    print(f"{'refused pod creates (goal <= 1.5)':44} {refused / seconds:8.2f}")
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("parts", nargs="*",
                        choices=["plan", "throughput", "scale", "lists", "steady", "refusals",
                                 []],
                        default=[])
    parser.add_argument("--before", default="513f6db",
                        help="git revision of the operator to compare LIST calls with")
    parser.add_argument("--steady-before", default="78854eb",
                        help="git revision of the operator to compare steady requests with")
    parser.add_argument("--throughput-before", default="",
                        help="git revision of an operator to alternate with this one in "
                        "the throughput part (before/after in one run)")
    parser.add_argument("--throughput-inventory", default="large",
                        help="devcluster inventory of the throughput part (wide: 160 "
                        "nodes, room for 1,000 workers on one GPU model; xxlarge: "
                        "10,000 nodes)")
    parser.add_argument("--throughput-variant", action="append", default=[],
                        help="LABEL:VAR=VALUE,...: this operator with that environment "
                        "takes a turn too (e.g. a setting: RINGWRIGHT_ROUND_SPACING_SECONDS=0)")
    parser.add_argument("--trials", type=int, default=TRIALS,
                        help="trials of each kind in the throughput part")
    parser.add_argument("--steady-jobs", type=int, default=20)
    parser.add_argument("--workers", type=int, default=256)
    parser.add_argument("--nodes", type=int, default=10_000)
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--jobs", type=int, default=100)
    parser.add_argument("--steady-seconds", type=float, default=30.0)
    parser.add_argument("--touches", type=int, default=40)
    args = parser.parse_args(argv)
    parts = args.parts or ["plan", "throughput", "scale", "lists", "refusals"]
    work = Path(tempfile.mkdtemp(prefix="ringwright-bench-operator-"))
    ok = True
    if "plan" in parts:
        ok &= plan_part(args.nodes, args.rounds)
    if "throughput" in parts:
        ok &= throughput_part(work, args.workers, args.throughput_before,
                              args.throughput_inventory, args.trials, args.throughput_variant)
    if "scale" in parts:
        ok &= scale_part(work, args.jobs, args.steady_seconds)
    if "lists" in parts:
        ok &= lists_part(work, args.before, 20, args.steady_seconds)
    if "steady" in parts:
        ok &= steady_part(work, args.steady_before, args.steady_jobs, args.steady_seconds)
    if "refusals" in parts:
        ok &= refusals_part(work, args.touches)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
