"""Ring order: which rank each member gets, so the collective ring follows the topology.

Members are ordered by (rack, NVLink domain, node, pod index): a ring then enters and
leaves each rack once, so it crosses a rack boundary exactly once per rack used (and
not at all within one rack). Across generations, survivors keep their relative order and a
newcomer is slotted in next to its topological neighbours: nobody who stayed has to
rebuild more of its neighbourhood than the change demands.
"""

from __future__ import annotations

from bisect import bisect_left
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

RingKey = tuple[str, str, str, int]


@dataclass(frozen=True, slots=True)
class RingSlot:
    """A member as ring ordering sees it."""

    pod: str
    rack: str = ""
    nvlink_domain: str = ""
    node: str = ""
    index: int = 0
    """The pod's index within its role (from its name or label)."""

    @property
    def key(self) -> RingKey:
        return (self.rack, self.nvlink_domain, self.node, self.index)


def order_ring(slots: Iterable[RingSlot], previous_order: Sequence[str] = ()) -> list[RingSlot]:
    """``slots`` in ring order; ``previous_order`` is the last generation's pods, rank order.

    Survivors (pods in ``previous_order``) keep their relative order. Each newcomer
    goes next to the survivors it shares the longest topological prefix with (same
    node, else NVLink domain, else rack), at its sorted place among them; a newcomer
    in a rack no survivor uses goes between the racks around it. When the previous
    order was itself sorted by key, the result is exactly the sorted order.
    """
    position = {pod: i for i, pod in enumerate(previous_order)}
    members = list(slots)
    survivors = sorted((s for s in members if s.pod in position), key=lambda s: position[s.pod])
    newcomers = sorted((s for s in members if s.pod not in position), key=lambda s: s.key)
    if not survivors:
        return newcomers

    # Survivor positions by shared prefix: 1 = rack, 2 = + domain, 3 = + node.
    groups: list[dict[tuple[str | int, ...], list[int]]] = [defaultdict(list) for _ in range(4)]
    last_in_rack: dict[str, int] = {}
    for i, s in enumerate(survivors):
        for level in (1, 2, 3):
            groups[level][s.key[:level]].append(i)
        last_in_rack[s.rack] = i
    racks = sorted(last_in_rack)
    # latest[j]: the last survivor position among racks[:j + 1], for newcomers in new racks.
    latest: list[int] = []
    for rack in racks:
        latest.append(max(last_in_rack[rack], latest[-1] if latest else -1))

    before: dict[int, list[RingSlot]] = defaultdict(list)
    after: dict[int, list[RingSlot]] = defaultdict(list)
    for new in newcomers:
        group = next(
            (groups[lv][new.key[:lv]] for lv in (3, 2, 1) if new.key[:lv] in groups[lv]), None
        )
        if group is None:
            j = bisect_left(racks, new.rack)
            if j == 0:
                before[0].append(new)
            else:
                after[latest[j - 1]].append(new)
            continue
        lower = [i for i in group if survivors[i].key < new.key]
        if lower:
            after[max(lower)].append(new)
        else:
            before[group[0]].append(new)

    ordered: list[RingSlot] = []
    for i, survivor in enumerate(survivors):
        ordered.extend(before.get(i, ()))
        ordered.append(survivor)
        ordered.extend(after.get(i, ()))
    return ordered


def cross_rack_edges(racks: Sequence[str]) -> int:
    """Ring edges (including the wrap-around) joining members of different racks.

    ``racks`` holds each member's rack in ring order. For a ring grouped by rack this
    equals the number of racks used when that is two or more, and 0 for one rack.
    """
    n = len(racks)
    if n < 2:
        return 0
    return sum(1 for i in range(n) if racks[i] != racks[(i + 1) % n])
