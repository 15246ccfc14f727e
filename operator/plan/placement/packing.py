"""Choosing the fewest groups (racks, NVLink domains, nodes) that hold a number of pods.

Every level of placement asks the same question: given groups with a free capacity
(in pods), which groups should take ``need`` pods? The answer here uses the fewest
groups possible and, among those, fills the smallest groups that still make the
count work, so large free blocks stay whole for the next big job.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Collection, Sequence

Pick = tuple[str, int]
"""(group key, pods it takes)."""


def fewest_tightest(
    groups: Sequence[tuple[str, int]], need: int, *, limit: int | None = None
) -> list[Pick]:
    """Pick the fewest groups that hold ``need`` pods, tightest fit first.

    With ``k`` the fewest groups that can hold ``need``, each of the ``k`` steps picks
    the smallest group that still lets the remaining steps finish: the smallest
    capacity ``c`` with ``c + (sum of the largest j others) >= remaining``, ``j`` being
    the steps left after this one. That keeps ``k`` minimal (the largest-``j`` sum
    stays large enough) while leaving the big groups free. Ties go to the smaller key.

    When ``need`` cannot be met (too little room, or more than ``limit`` groups
    needed), the largest ``limit`` groups are taken whole: as many pods as possible.
    Returned picks take ``min(need, room)`` pods in total.
    """
    items = [(key, cap) for key, cap in groups if cap > 0]
    if need <= 0 or not items:
        return []
    largest_first = sorted(items, key=lambda kc: (-kc[1], kc[0]))
    count, room = 0, 0
    for _, cap in largest_first:
        if room >= need:
            break
        count, room = count + 1, room + cap
    if room < need or (limit is not None and count > limit):
        best = largest_first if limit is None else largest_first[:limit]
        return list(best)

    # Buckets of equal capacity, so each step costs O(distinct capacities), not O(groups):
    # at the node level there are thousands of nodes but only a handful of slot counts.
    buckets: dict[int, list[str]] = {}
    for key, cap in sorted(items, key=lambda kc: kc[0], reverse=True):
        buckets.setdefault(cap, []).append(key)  # pop() then yields the smallest key
    caps = sorted(buckets)
    picks: list[Pick] = []
    remaining = need
    for step in range(count):
        after = count - step - 1
        threshold = max(1, remaining - _largest_sum(buckets, caps, after))
        cap = caps[bisect_left(caps, threshold)]
        key = buckets[cap].pop()
        if not buckets[cap]:
            del buckets[cap]
            caps.remove(cap)
        take = min(cap, remaining)
        picks.append((key, take))
        remaining -= take
        if remaining == 0:
            break
    return picks


def fill(
    groups: Sequence[tuple[str, int]],
    need: int,
    *,
    preferred: Collection[str] = (),
    extra_limit: int | None = None,
) -> list[Pick]:
    """Like :func:`fewest_tightest`, but groups in ``preferred`` are used up first.

    Used for scale-up (the job's current racks, domains and nodes come first) and for
    rack limits: at most ``extra_limit`` groups outside ``preferred`` are added.
    """
    mine = [(k, c) for k, c in groups if k in preferred and c > 0]
    room = sum(c for _, c in mine)
    if room >= need:
        return fewest_tightest(mine, need)
    others = [(k, c) for k, c in groups if k not in preferred]
    return mine + fewest_tightest(others, need - room, limit=extra_limit)


def _largest_sum(buckets: dict[int, list[str]], caps: list[int], n: int) -> int:
    total = 0
    for cap in reversed(caps):
        if n <= 0:
            break
        used = min(n, len(buckets[cap]))
        total += used * cap
        n -= used
    return total
