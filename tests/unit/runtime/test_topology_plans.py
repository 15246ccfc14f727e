"""Pure decisions of the topology features: the rack plan, shards, buckets."""

from __future__ import annotations

import pytest
import torch

from ringwright.runtime.collectives.buckets import (
    BucketSettings,
    Compression,
    GradientBuckets,
    plan_buckets,
)
from ringwright.runtime.collectives.hierarchical import AUTO_MAX_BYTES, rack_plan, shard_bounds
from ringwright.world import (
    HierarchicalAllReduce,
    JobRef,
    Member,
    StoreAddress,
    TopologySettings,
    World,
    parse_world,
)

AUTO, ON, OFF = (HierarchicalAllReduce.AUTO, HierarchicalAllReduce.ENABLED,
                 HierarchicalAllReduce.DISABLED)


def world(racks: str, mode: HierarchicalAllReduce = AUTO) -> World:
    members = tuple(Member(rank=i, pod=f"p{i}", ip=f"10.0.0.{i + 1}", rack=r)
                    for i, r in enumerate(racks))
    return World(job=JobRef(namespace="n", name="j"), generation=1, members=members,
                 store=StoreAddress(address="10.0.0.1"),
                 topology=TopologySettings(hierarchical_all_reduce=mode))


@pytest.mark.parametrize(("racks", "mode", "expected"), [
    ("aabb", AUTO, ((0, 1), (2, 3))),
    ("aaabbc", AUTO, ((0, 1, 2), (3, 4), (5,))),
    ("aaaa", AUTO, None),       # one rack: the flat ring already stays inside it
    ("aaaa", ON, None),
    ("abc", AUTO, None),        # one member per rack: both are the same ring
    ("abc", ON, ((0,), (1,), (2,))),
    ("aabb", OFF, None),
])
def test_rack_plan(racks: str, mode: HierarchicalAllReduce,
                   expected: tuple[tuple[int, ...], ...] | None) -> None:
    plan = rack_plan(world(racks, mode))
    assert (plan.racks if plan else None) == expected


def test_auto_goes_hierarchical_for_latency_bound_buffers_only() -> None:
    auto = rack_plan(world("aabb"))
    assert auto is not None
    assert auto.takes(AUTO_MAX_BYTES) and not auto.takes(AUTO_MAX_BYTES + 1)
    forced = rack_plan(world("aabb", HierarchicalAllReduce.ENABLED))
    assert forced is not None and forced.takes(1 << 30)


def test_under_nccl_auto_leaves_the_algorithm_to_nccl() -> None:
    assert rack_plan(world("aabb"), "nccl") is None
    assert rack_plan(world("aabb", OFF), "nccl") is None
    forced = rack_plan(world("aabb", ON), "nccl")
    assert forced is not None and forced.racks == ((0, 1), (2, 3))
    assert rack_plan(world("aabb"), "gloo") is not None


def test_a_cuda_state_asks_for_the_nccl_plan() -> None:
    # The backend names the library from the state's device alone (no GPU needed).
    from ringwright.runtime.collectives.torch_backend import TorchDistributedBackend
    from ringwright.runtime.settings import RuntimeSettings

    cuda = TorchDistributedBackend(torch.device("cuda"), RuntimeSettings(), environ={})
    cpu = TorchDistributedBackend(torch.device("cpu"), RuntimeSettings(), environ={})
    assert (cuda.name, cpu.name) == ("nccl", "gloo")
    assert rack_plan(world("aabb"), cuda.name) is None
    assert rack_plan(world("aabb"), cpu.name) is not None


def test_rack_plan_shards_and_cross_groups_follow_the_smallest_rack() -> None:
    plan = rack_plan(world("aaabbcccc"))
    assert plan is not None
    assert plan.shards == 2
    assert [plan.cross(j) for j in range(plan.shards)] == [(0, 3, 5), (1, 4, 6)]
    assert plan.rack_of(7) == (5, 6, 7, 8)


@pytest.mark.parametrize(("numel", "shards"), [(0, 3), (1, 3), (10, 3), (9, 3), (7, 1)])
def test_shard_bounds_cover_everything_once(numel: int, shards: int) -> None:
    bounds = shard_bounds(numel, shards)
    assert len(bounds) == shards
    assert [a for a, _ in bounds][1:] == [b for _, b in bounds][:-1]
    assert bounds[0][0] == 0 and bounds[-1][1] == numel
    sizes = [b - a for a, b in bounds]
    assert max(sizes) - min(sizes) <= 1


def test_world_topology_round_trips_and_defaults_to_auto() -> None:
    w = world("ab", ON)
    assert parse_world(w.to_json()).topology.hierarchical_all_reduce is ON
    assert '"hierarchicalAllReduce":"Enabled"' in w.to_json()
    legacy = w.to_json().replace(',"topology":{"hierarchicalAllReduce":"Enabled"}', "")
    assert parse_world(legacy).topology.hierarchical_all_reduce is AUTO


def test_plan_buckets_reverse_order_by_dtype_and_size() -> None:
    params = [torch.zeros(100), torch.zeros(10, dtype=torch.float64), torch.zeros(300),
              torch.zeros(50)]
    # 400 bytes per bucket: float32 [3, 2] closes at 1400 bytes, [0] stays open.
    assert plan_buckets(params, 400) == [[3, 2], [1], [0]] or \
        plan_buckets(params, 400) == [[3, 2], [0], [1]]
    assert plan_buckets(params, 10**9) == [[3, 2, 0], [1]]


class Tripler:
    """Stands in for a world of three identical ranks: the sum is three times ours."""

    def __init__(self) -> None:
        self.names: list[str] = []

    def allreduce_(self, flat: torch.Tensor, name: str) -> None:
        self.names.append(name)
        flat.mul_(3)


class Identity:
    """A world of one."""

    def allreduce_(self, flat: torch.Tensor, name: str) -> None:
        return


def net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))


def test_buckets_launch_during_backward_and_install_views() -> None:
    model, reducer = net(), Tripler()
    unused = torch.nn.Parameter(torch.ones(3))
    launches: list[int] = []

    def current() -> Tripler:
        launches.append(1)  # asked once per bucket launch, in the launching thread
        return reducer

    # Planned in reverse: [last layer] [first layer] [unused], 64 bytes per bucket.
    buckets = GradientBuckets([unused, *model.parameters()], current,
                              BucketSettings(bucket_bytes=64))
    try:
        expected = net()
        expected(torch.ones(5, 4)).sum().backward()
        model(torch.ones(5, 4)).sum().backward()
        launched_in_backward = len(launches)
        buckets.finish(average_over=3)
    finally:
        buckets.close()
    assert launched_in_backward == 2  # both layers' buckets went during backward
    assert reducer.names == ["bucket.0", "bucket.1", "bucket.2"]
    for p, q in zip(model.parameters(), expected.parameters(), strict=True):
        assert p.grad is not None and q.grad is not None
        torch.testing.assert_close(p.grad, q.grad)  # 3x summed, averaged over 3
    assert unused.grad is None


def test_compression_error_feedback_carries_the_rounding_over() -> None:
    p = torch.nn.Parameter(torch.zeros(1))
    reducer = Identity()
    buckets = GradientBuckets([p], lambda: reducer,
                              BucketSettings(compression=Compression.BF16))
    value = 1 + 2**-10  # not representable in bf16 (8 bits of mantissa)
    total = 0.0
    try:
        for _ in range(64):
            p.grad = None
            (p * value).sum().backward()  # type: ignore[no-untyped-call]
            buckets.finish(average_over=None)
            assert p.grad is not None
            total += float(p.grad)
    finally:
        buckets.close()
    # Without error feedback every step would lose the same 2**-10.
    assert abs(total - 64 * value) < 2 * 2**-7
