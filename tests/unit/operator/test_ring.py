"""Ring order: topological, stable for survivors, one rack crossing per rack."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ringwright.operator.plan.ring import RingSlot, cross_rack_edges, order_ring


def slot(pod: str, rack: str, domain: str = "", node: str = "", index: int = 0) -> RingSlot:
    return RingSlot(pod=pod, rack=rack, nvlink_domain=domain, node=node or f"{rack}-node",
                    index=index)


def pods(ring: list[RingSlot]) -> list[str]:
    return [s.pod for s in ring]


def test_fresh_ring_is_sorted_by_rack_domain_node_index() -> None:
    slots = [
        slot("w3", "r2", "d0", "n5", 3),
        slot("w0", "r1", "d1", "n2", 0),
        slot("w2", "r1", "d0", "n1", 2),
        slot("w1", "r1", "d0", "n1", 1),
    ]
    assert pods(order_ring(slots)) == ["w1", "w2", "w0", "w3"]


def test_any_iterable_of_slots_will_do() -> None:
    slots = [slot("b", "r2"), slot("a", "r1")]
    assert pods(order_ring(iter(slots))) == ["a", "b"]
    assert pods(order_ring(iter(slots), ["b"])) == ["a", "b"]


@pytest.mark.parametrize(
    ("previous", "slots", "expected"),
    [
        # A newcomer joins its node's neighbours, not the end of the ring.
        (["a", "b", "c"],
         [slot("a", "r1", node="n1"), slot("b", "r1", node="n2"), slot("c", "r2"),
          slot("new", "r1", node="n1", index=5)],
         ["a", "new", "b", "c"]),
        # A newcomer in a rack nobody uses goes between the racks around it.
        (["a", "c"], [slot("a", "r1"), slot("c", "r3"), slot("new", "r2")], ["a", "new", "c"]),
        (["b"], [slot("b", "r2"), slot("new", "r1")], ["new", "b"]),
        (["b"], [slot("b", "r2"), slot("new", "r3")], ["b", "new"]),
        # Survivors keep their order even where it is no longer sorted.
        (["z", "a"], [slot("a", "r1"), slot("z", "r9"), slot("m", "r5")], ["z", "a", "m"]),
        # Leavers simply drop out.
        (["a", "gone", "b"], [slot("a", "r1"), slot("b", "r1", index=1)], ["a", "b"]),
    ],
    ids=["same-node", "new-rack-between", "new-rack-first", "new-rack-last", "unsorted",
         "leaver"],
)
def test_generation_to_generation(previous: list[str], slots: list[RingSlot],
                                  expected: list[str]) -> None:
    assert pods(order_ring(slots, previous)) == expected


@pytest.mark.parametrize(
    ("racks", "edges"),
    [([], 0), (["a"], 0), (["a", "a", "a"], 0), (["a", "b"], 2), (["a", "a", "b", "b", "c"], 3),
     (["a", "b", "a", "b"], 4)],
)
def test_cross_rack_edges(racks: list[str], edges: int) -> None:
    assert cross_rack_edges(racks) == edges


slot_st = st.builds(
    RingSlot,
    pod=st.just(""),
    rack=st.sampled_from(["r1", "r2", "r3", "r4", ""]),
    nvlink_domain=st.sampled_from(["d1", "d2", ""]),
    node=st.sampled_from(["n1", "n2", "n3"]),
    index=st.integers(0, 50),
)
slots_st = st.lists(slot_st, max_size=24).map(
    lambda ss: [RingSlot(f"p{i}", s.rack, s.nvlink_domain, s.node, s.index)
                for i, s in enumerate(ss)]
)


@given(slots_st, st.lists(st.integers(0, 40), unique=True), st.randoms(use_true_random=False))
def test_survivors_keep_their_relative_order(
    slots: list[RingSlot], previous_ids: list[int], rnd: object
) -> None:
    previous = [f"p{i}" for i in previous_ids]
    ring = order_ring(slots, previous)
    assert sorted(pods(ring)) == sorted(pods(slots))
    present = set(pods(slots))
    assert [p for p in pods(ring) if p in set(previous)] == [p for p in previous if p in present]


@given(slots_st, slots_st)
def test_growing_a_sorted_ring_keeps_it_sorted(old: list[RingSlot], extra: list[RingSlot]) -> None:
    joined = old + [RingSlot(f"x{s.pod}", s.rack, s.nvlink_domain, s.node, s.index) for s in extra]
    previous = pods(order_ring(old))
    ring = order_ring(joined, previous)
    assert [s.key for s in ring] == sorted(s.key for s in joined)


@given(slots_st)
def test_a_sorted_ring_crosses_each_rack_boundary_once(slots: list[RingSlot]) -> None:
    racks = {s.rack for s in slots}
    ring = order_ring(slots)
    edges = cross_rack_edges([s.rack for s in ring])
    assert edges == (len(racks) if len(racks) > 1 else 0)


@given(slots_st, st.randoms(use_true_random=False))
def test_no_order_crosses_fewer_rack_boundaries(slots: list[RingSlot], rnd: object) -> None:
    shuffled = list(slots)
    rnd.shuffle(shuffled)  # type: ignore[attr-defined]
    best = cross_rack_edges([s.rack for s in order_ring(slots)])
    assert cross_rack_edges([s.rack for s in shuffled]) >= best
