"""Property tests of packing and the placement planner against brute force on small inventories."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from itertools import combinations

from hypothesis import given, settings
from hypothesis import strategies as st

from ringwright.operator.api.schedulingpolicy import SchedulingPolicySpec
from ringwright.operator.plan.placement.inventory import Inventory, NodeInfo
from ringwright.operator.plan.placement.packing import fewest_tightest
from ringwright.operator.plan.placement.planner import (
    PlacementPlan,
    PlacementRequest,
    Unschedulable,
    plan_placement,
)
from ringwright.operator.plan.placement.resources import Resources

GI = 1024**3
MODELS = ("A100", "H100")

# --- packing -------------------------------------------------------------------------------

groups_st = st.lists(st.integers(0, 12), max_size=8).map(
    lambda caps: [(f"g{i}", c) for i, c in enumerate(caps)]
)


@given(groups_st, st.integers(1, 60), st.one_of(st.none(), st.integers(1, 4)))
def test_fewest_tightest_uses_the_fewest_groups(
    groups: list[tuple[str, int]], need: int, limit: int | None
) -> None:
    picks = fewest_tightest(groups, need, limit=limit)
    caps = dict(groups)
    assert len({k for k, _ in picks}) == len(picks)
    assert all(0 < take <= caps[k] for k, take in picks)
    usable = [c for _, c in groups if c > 0]
    best = 0
    fewest = 0
    for n in range(len(usable) + 1):
        if limit is not None and n > limit:
            break
        for combo in combinations(usable, n):
            placed = min(need, sum(combo))
            if placed > best:
                best, fewest = placed, n
    assert sum(t for _, t in picks) == best
    assert len(picks) == fewest


# --- planner -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Scenario:
    inventory: Inventory
    request: PlacementRequest
    policy: SchedulingPolicySpec


@st.composite
def scenarios(draw: st.DrawFn) -> Scenario:
    nodes = []
    for r in range(draw(st.integers(1, 5))):
        for n in range(draw(st.integers(1, 4))):
            nodes.append(NodeInfo(
                name=f"r{r}-n{n}",
                rack=f"r{r}",
                nvlink_domain=f"r{r}-d{n // 2}",
                gpu_model=draw(st.sampled_from(MODELS)),
                spine=f"s{r % 2}",
                free=Resources(
                    draw(st.integers(0, 16)) * 1000, 64 * GI, draw(st.integers(0, 8)),
                    draw(st.integers(0, 10)),
                ),
                preemptible=Resources(draw(st.integers(0, 8)) * 1000, 16 * GI, 0, 2),
            ))
    gpus = draw(st.integers(0, 4))
    workers = draw(st.integers(0, 30))
    allowed = draw(st.lists(st.sampled_from(MODELS), unique=True, max_size=2))
    requested = draw(st.one_of(st.none(), st.sampled_from(allowed or MODELS)))
    request = PlacementRequest(
        workers=workers,
        min_new_workers=draw(st.integers(0, workers)),
        worker_pod=Resources(draw(st.integers(1, 4)) * 1000, GI, gpus, 1),
        gpu_model=requested,
        ps=draw(st.integers(0, 3)),
        ps_pod=Resources(draw(st.integers(1, 4)) * 1000, 4 * GI, 0, 1),
        max_racks=draw(st.one_of(st.none(), st.integers(1, 3))),
    )
    policy = SchedulingPolicySpec(allowed_gpu_models=allowed)
    return Scenario(Inventory(tuple(nodes)), request, policy)


def _candidates(s: Scenario) -> list[str]:
    if s.request.worker_pod.gpus == 0:
        return [""]
    if s.request.gpu_model is not None:
        return [s.request.gpu_model]
    present = sorted({n.gpu_model for n in s.inventory.nodes})
    return list(s.policy.allowed_gpu_models) or present


def brute_force(s: Scenario) -> tuple[int, int]:
    """(most workers that fit, fewest racks that hold that many), over every model and rack set."""
    req = s.request
    best = (0, 0)
    for model in _candidates(s):
        room: dict[str, int] = defaultdict(int)
        for node in s.inventory.nodes:
            if not model or node.gpu_model == model:
                room[node.rack] += node.free.count_fitting(req.worker_pod)
        racks = sorted(r for r, c in room.items() if c > 0)
        for n in range(len(racks) + 1):
            if req.max_racks is not None and n > req.max_racks:
                break
            for combo in combinations(racks, n):
                placed = min(req.workers, sum(room[r] for r in combo))
                if (placed, -n) > (best[0], -best[1]):
                    best = (placed, n)
    return best


@settings(max_examples=300, deadline=None)
@given(scenarios())
def test_planner_is_optimal_in_racks_and_never_overcommits(s: Scenario) -> None:
    plan = plan_placement(s.request, s.inventory, s.policy)
    most, fewest = brute_force(s)
    if isinstance(plan, Unschedulable):
        assert plan.reason == "InsufficientCapacity"
        if most >= s.request.min_new_workers:
            assert "ps pods" in plan.message  # the workers fit; the ps pods did not
        return
    assert most >= s.request.min_new_workers
    assert len(plan.workers) == most
    assert len(plan.racks) == fewest
    assert plan.shortfall == s.request.workers - most
    if s.request.max_racks is not None:
        assert len(plan.racks) <= s.request.max_racks

    # Homogeneous: one model, the requested or an allowed one.
    nodes = {n.name: n for n in s.inventory.nodes}
    if s.request.worker_pod.gpus:
        assert {nodes[w.node].gpu_model for w in plan.workers} <= {plan.gpu_model}
        if s.request.gpu_model:
            assert plan.gpu_model == s.request.gpu_model
        if s.policy.allowed_gpu_models and plan.workers:
            assert plan.gpu_model in s.policy.allowed_gpu_models

    # Capacity: what a node gets never exceeds its free room (plus preemptible for ps).
    used: dict[str, Resources] = defaultdict(Resources)
    for w in plan.workers:
        used[w.node] = used[w.node] + s.request.worker_pod
    for p in plan.ps:
        used[p.node] = used[p.node] + s.request.ps_pod
    for name, total in used.items():
        limit = nodes[name].free
        if any(p.preempts and p.node == name for p in plan.ps):
            limit = limit + nodes[name].preemptible
        left = limit - total
        assert min(left.cpu_milli, left.memory, left.gpus, left.pods) >= 0, (name, left)
    assert len(plan.ps) == s.request.ps
    keys = [(w.rack, w.nvlink_domain, w.node) for w in plan.workers]
    assert keys == sorted(keys)


@settings(max_examples=150, deadline=None)
@given(scenarios(), st.randoms(use_true_random=False))
def test_planner_is_deterministic_whatever_the_node_order(s: Scenario, rnd: object) -> None:
    first = plan_placement(s.request, s.inventory, s.policy)
    assert plan_placement(s.request, s.inventory, s.policy) == first
    shuffled = list(s.inventory.nodes)
    rnd.shuffle(shuffled)  # type: ignore[attr-defined]
    again = plan_placement(s.request, Inventory(tuple(shuffled)), s.policy)
    if isinstance(first, PlacementPlan):
        assert isinstance(again, PlacementPlan)
        assert again.workers == first.workers and again.ps == first.ps
    else:
        assert again == first
