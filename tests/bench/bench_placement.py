"""Placement planner benchmark: speed at scale and placement quality. Prints; asserts nothing.

    python tests/bench/bench_placement.py [--seed N] [--inventories N] [--runs N]

1. Speed: planning a 1,000-worker job on a 10,000-node inventory (the goal is ≤ 100 ms),
   plus building that inventory from Node and Pod objects.
2. Quality over random inventories: racks the planner uses against the optimum (the
   fewest racks that hold the job, by exhaustive search over rack sets), how tight the
   chosen rack set is, and cross-rack ring edges against a simulation of the default
   kube-scheduler's spread (LeastAllocated + BalancedAllocation scoring, random ties).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from itertools import combinations
from typing import Any

from ringwright.operator.api.schedulingpolicy import SchedulingPolicySpec
from ringwright.operator.plan.placement.inventory import Inventory, NodeInfo, inventory_from_objects
from ringwright.operator.plan.placement.planner import (
    PlacementPlan,
    PlacementRequest,
    plan_placement,
)
from ringwright.operator.plan.placement.resources import Resources
from ringwright.operator.plan.ring import RingSlot, cross_rack_edges, order_ring

GI = 1024**3
POLICY = SchedulingPolicySpec()
MODELS = ("NVIDIA-H100-80GB-HBM3", "NVIDIA-A100-SXM4-40GB")


# --- speed ---------------------------------------------------------------------------------


def big_cluster(rng: random.Random, nodes: int = 10_000, per_rack: int = 32) -> list[NodeInfo]:
    """``nodes`` 8-GPU nodes, 32 to a rack, 4 to an NVLink domain, two models, partly busy."""
    out = []
    for i in range(nodes):
        rack = i // per_rack
        busy = rng.choice((0, 0, 0, 2, 4, 8))
        out.append(NodeInfo(
            name=f"node-{i:05d}", rack=f"rack-{rack:03d}",
            nvlink_domain=f"rack-{rack:03d}-nvl-{(i % per_rack) // 4}",
            gpu_model=MODELS[rack % 2],
            free=Resources((128 - busy * 12) * 1000, (2048 - busy * 200) * GI, 8 - busy,
                           110 - busy),
        ))
    return out


def node_objects(nodes: list[NodeInfo]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The same cluster as Node objects and one busy pod per used GPU pair."""
    node_objs, pod_objs = [], []
    for n in nodes:
        node_objs.append({
            "metadata": {"name": n.name, "labels": {
                POLICY.node_labels.rack: n.rack,
                POLICY.node_labels.nvlink_domain: n.nvlink_domain,
                POLICY.node_labels.gpu_model: n.gpu_model}},
            "status": {"allocatable": {"cpu": "128", "memory": "2048Gi",
                                       POLICY.gpu_resource: "8", "pods": "110"},
                       "conditions": [{"type": "Ready", "status": "True"}]},
        })
        for _ in range((8 - n.free.gpus) // 2):
            pod_objs.append({
                "spec": {"nodeName": n.name, "containers": [{"name": "c", "resources": {
                    "requests": {"cpu": "24", "memory": "400Gi", POLICY.gpu_resource: "2"}}}]},
                "status": {"phase": "Running"},
            })
    return node_objs, pod_objs


def timed(fn: Callable[[], object], runs: int) -> list[float]:
    out = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        out.append((time.perf_counter() - start) * 1000)
    return sorted(out)


def speed(seed: int, runs: int) -> None:
    rng = random.Random(seed)
    nodes = big_cluster(rng)
    inventory = Inventory(tuple(nodes))
    print(f"speed: {len(nodes)} nodes in {len({n.rack for n in nodes})} racks, "
          f"{sum(n.free.gpus for n in nodes)} free GPUs; {runs} runs each")
    print(f"  {'case':<52}{'min ms':>9}{'median':>9}{'max':>9}")
    cases = [
        ("1,000 workers x 1 GPU, model chosen by the planner", PlacementRequest(
            workers=1000, min_new_workers=1000, worker_pod=Resources(8000, 64 * GI, 1, 1))),
        ("1,000 workers x 8 GPU, H100 requested", PlacementRequest(
            workers=1000, min_new_workers=1000, worker_pod=Resources(8000, 64 * GI, 8, 1),
            gpu_model=MODELS[0])),
        ("1,000 workers x 1 GPU + 16 ps, at most 8 racks", PlacementRequest(
            workers=1000, min_new_workers=500, worker_pod=Resources(8000, 64 * GI, 1, 1),
            ps=16, ps_pod=Resources(16_000, 128 * GI, 0, 1), max_racks=8)),
        ("1,000 workers x 1 GPU, scale-up from 500 current", PlacementRequest(
            workers=1000, min_new_workers=0, worker_pod=Resources(8000, 64 * GI, 1, 1),
            current_worker_nodes=tuple(n.name for n in nodes[:4000:8]))),
    ]
    for name, req in cases:
        plan = plan_placement(req, inventory, POLICY)
        ms = timed(lambda req=req: plan_placement(req, inventory, POLICY), runs)  # type: ignore[misc]
        print(f"  {name:<52}{ms[0]:>9.1f}{statistics.median(ms):>9.1f}{ms[-1]:>9.1f}")
        outcome = plan.summary if isinstance(plan, PlacementPlan) else plan.message
        print(f"      -> {outcome[:110]}")
    node_objs, pod_objs = node_objects(nodes)
    ms = timed(lambda: inventory_from_objects(node_objs, pod_objs, POLICY.node_labels,
                                              POLICY.gpu_resource), max(3, runs // 4))
    print(f"  {'inventory from ' + f'{len(node_objs)} nodes + {len(pod_objs)} pods':<52}"
          f"{ms[0]:>9.1f}{statistics.median(ms):>9.1f}{ms[-1]:>9.1f}")


# --- quality -------------------------------------------------------------------------------


@dataclass
class Trial:
    racks: int
    optimum: int
    slack: int
    optimum_slack: int
    edges: int
    spread_racks: int
    spread_edges_index: int
    spread_edges_sorted: int


def small_cluster(rng: random.Random) -> list[NodeInfo]:
    nodes = []
    models = MODELS[: rng.choice((1, 2))]
    for r in range(rng.randint(3, 10)):
        model = rng.choice(models)
        for n in range(rng.randint(2, 8)):
            used = rng.choice((0, 0, 1, 2, 4, 6, 8))
            nodes.append(NodeInfo(
                name=f"r{r}-n{n}", rack=f"r{r}", nvlink_domain=f"r{r}-d{n // 2}",
                gpu_model=model,
                free=Resources((64 - used * 8) * 1000, (512 - used * 64) * GI, 8 - used, 110),
            ))
    return nodes


def optimum(nodes: list[NodeInfo], model: str, req: PlacementRequest) -> tuple[int, int]:
    """(fewest racks holding the job, least slack among rack sets of that size), exhaustively."""
    room: dict[str, int] = defaultdict(int)
    for n in nodes:
        if n.gpu_model == model:
            room[n.rack] += n.free.count_fitting(req.worker_pod)
    caps = [c for c in room.values() if c > 0]
    for k in range(1, len(caps) + 1):
        sums = [sum(c) for c in combinations(caps, k) if sum(c) >= req.workers]
        if sums:
            return k, min(sums) - req.workers
    raise AssertionError("the job was sized to fit")


def default_spread(nodes: list[NodeInfo], model: str, req: PlacementRequest,
                   rng: random.Random) -> list[NodeInfo]:
    """Where the default scheduler would put the workers: one pod at a time, highest score."""
    free = {n.name: n.free for n in nodes if n.gpu_model == model}
    alloc = {n.name: n.free for n in nodes}  # scoring relative to what was free at the start
    by_name = {n.name: n for n in nodes}
    placed = []
    pod = req.worker_pod
    for _ in range(req.workers):
        best: list[str] = []
        top = -1.0
        for name, room in free.items():
            if room.count_fitting(pod) < 1:
                continue
            base = alloc[name]
            left = room - pod
            fractions = [1 - left.cpu_milli / max(base.cpu_milli, 1),
                         1 - left.memory / max(base.memory, 1)]
            least_allocated = 100 * (2 - sum(fractions)) / 2
            balanced = 100 * (1 - abs(fractions[0] - fractions[1]) / 2)
            score = least_allocated + balanced
            if score > top + 1e-9:
                top, best = score, [name]
            elif abs(score - top) <= 1e-9:
                best.append(name)
        choice = rng.choice(best)
        free[choice] = free[choice] - pod
        placed.append(by_name[choice])
    return placed


def trial(rng: random.Random) -> Trial | None:
    nodes = small_cluster(rng)
    gpus = rng.choice((1, 2, 4, 8))
    pod = Resources(gpus * 4000, gpus * 32 * GI, gpus, 1)
    room_by_model: Counter[str] = Counter()
    for n in nodes:
        room_by_model[n.gpu_model] += n.free.count_fitting(pod)
    model, room = room_by_model.most_common(1)[0]
    if room < 2:
        return None
    req = PlacementRequest(workers=rng.randint(2, room), min_new_workers=1, worker_pod=pod,
                           gpu_model=model)
    plan = plan_placement(req, Inventory(tuple(nodes)), POLICY)
    assert isinstance(plan, PlacementPlan)
    best, best_slack = optimum(nodes, model, req)
    rack_room: Counter[str] = Counter()
    for n in nodes:
        if n.gpu_model == model and n.rack in plan.racks:
            rack_room[n.rack] += n.free.count_fitting(pod)
    ring = order_ring(RingSlot(f"w{i}", w.rack, w.nvlink_domain, w.node, i)
                      for i, w in enumerate(plan.workers))
    spread = default_spread(nodes, model, req, rng)
    sorted_spread = order_ring(RingSlot(f"w{i}", n.rack, n.nvlink_domain, n.name, i)
                               for i, n in enumerate(spread))
    return Trial(
        racks=len(plan.racks), optimum=best,
        slack=sum(rack_room.values()) - req.workers, optimum_slack=best_slack,
        edges=cross_rack_edges([s.rack for s in ring]),
        spread_racks=len({n.rack for n in spread}),
        spread_edges_index=cross_rack_edges([n.rack for n in spread]),
        spread_edges_sorted=cross_rack_edges([s.rack for s in sorted_spread]),
    )


def quality(seed: int, inventories: int) -> None:
    rng = random.Random(seed)
    trials: list[Trial] = []
    while len(trials) < inventories:
        t = trial(rng)
        if t is not None:
            trials.append(t)
    n = len(trials)

    def mean(f: Callable[[Trial], float]) -> str:
        return f"{sum(f(t) for t in trials) / n:.2f}"

    def share(f: Callable[[Trial], bool]) -> str:
        return f"{100 * sum(1 for t in trials if f(t)) / n:.1f}%"

    print(f"\nquality over {n} random inventories (3-10 racks of 2-8 nodes, 1-2 GPU models, "
          "partly busy; jobs of 1-8 GPUs per worker sized to fit):")
    rows = [
        ("", "ringwright", "optimum", "default spread"),
        ("racks used, mean", mean(lambda t: t.racks), mean(lambda t: t.optimum),
         mean(lambda t: t.spread_racks)),
        ("racks used = optimum", share(lambda t: t.racks == t.optimum), "100.0%",
         share(lambda t: t.spread_racks == t.optimum)),
        ("free slots left in used racks, mean", mean(lambda t: t.slack),
         mean(lambda t: t.optimum_slack), "-"),
        ("rack set as tight as the tightest", share(lambda t: t.slack == t.optimum_slack),
         "100.0%", "-"),
        ("cross-rack ring edges, mean (rank = pod index)", mean(lambda t: t.edges), "-",
         mean(lambda t: t.spread_edges_index)),
        ("cross-rack ring edges, mean (topology ring)", mean(lambda t: t.edges),
         mean(lambda t: t.optimum if t.optimum > 1 else 0),
         mean(lambda t: t.spread_edges_sorted)),
    ]
    for label, *cells in rows:
        print(f"  {label:<48}" + "".join(f"{c:>16}" for c in cells))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--inventories", type=int, default=1000)
    parser.add_argument("--runs", type=int, default=20)
    args = parser.parse_args()
    speed(args.seed, args.runs)
    quality(args.seed, args.inventories)


if __name__ == "__main__":
    main()
