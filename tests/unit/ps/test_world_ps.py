"""The world lists parameter servers by their pod index, and their changes bump the generation."""

from __future__ import annotations

import pytest

from ringwright.operator.plan.pods import PodState, PodView
from ringwright.operator.plan.worldplan import build_world, decide, world_digest
from ringwright.runtime.ps.env import DOWN_ADDRESS, ps_addresses
from ringwright.world import CheckpointSettings, JobRef, LRScaling, World


def _pod(role: str, index: int, ip: str, uid: str = "u") -> PodView:
    return PodView(f"j-{role}-{index}", f"{uid}{index}", role, index, PodState.READY, ip,
                   "", None, 0)


def _world(workers: list[PodView], ps: list[PodView], generation: int = 1) -> World:
    return build_world(JobRef(namespace="n", name="j"), generation, workers, None, {},
                       backend="torch", mode="ParameterServer", store_port=29400,
                       lr=LRScaling(), checkpoint=CheckpointSettings(), ps=ps, ps_replicas=3)


def test_ps_rank_is_the_pod_index_and_a_missing_server_leaves_a_hole() -> None:
    workers = [_pod("worker", 0, "10.0.0.1")]
    world = _world(workers, [_pod("ps", 2, "10.0.1.3"), _pod("ps", 0, "10.0.1.1")])
    assert [(m.rank, m.pod) for m in world.ps] == [(0, "j-ps-0"), (2, "j-ps-2")]
    assert world.ps_count == 3
    assert ps_addresses(world, 7) == ["10.0.1.1:7", DOWN_ADDRESS, "10.0.1.3:7"]


def test_a_replaced_ps_is_a_membership_change() -> None:
    workers = [_pod("worker", 0, "10.0.0.1")]
    ps = [_pod("ps", 0, "10.0.1.1"), _pod("ps", 1, "10.0.1.2")]
    current = _world(workers, ps)
    assert decide(current, workers, 1, 1, None, 0.0, 5.0, False, ps)[0] is False
    replaced = [_pod("ps", 0, "10.0.1.9", uid="new"), ps[1]]
    assert decide(current, workers, 1, 1, None, 0.0, 5.0, False, replaced)[0] is True
    assert decide(current, workers, 1, 1, None, 0.0, 5.0, False, ps[1:])[0] is True
    assert world_digest(current) != world_digest(_world(workers, replaced))


def test_world_refuses_duplicate_or_out_of_range_ps_indices() -> None:
    workers = [_pod("worker", 0, "10.0.0.1")]
    with pytest.raises(ValueError, match="share an index"):
        _world(workers, [_pod("ps", 1, "a"), _pod("ps", 1, "b")])
    with pytest.raises(ValueError, match="out of range"):
        _world(workers, [_pod("ps", 3, "a")])
