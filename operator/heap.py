"""Keeping the cyclic garbage collector's pauses short in a process that holds a large cache.

The watch caches keep every Node and Pod of the cluster in memory: hundreds of thousands
of long-lived dicts. CPython's full (generation 2) collection walks all of them, and with
10,000 nodes that pause (~90 ms of CPU) lands in some reconcile round: it was the p99 of
a round, not the planning. Objects that survived a collection are therefore moved to
the permanent generation (``gc.freeze``) now and then, so later collections walk only
what is new. Cyclic garbage among frozen objects would never be freed, so every
``sweep_every``-th settle first unfreezes everything and does one full collection.
"""

from __future__ import annotations

import gc
import logging
import threading

log = logging.getLogger("ringwright.operator.heap")

HEAP_SETTLE_SECONDS = 30.0
"""How often the operator settles its heap: rarely enough that the collection it does is
cheap (only what is new since), often enough that new cache entries join the frozen."""
HEAP_SWEEP_EVERY = 20
"""Every 20th settle (10 minutes) is a full sweep: one long pause, frees frozen cycles."""


def settle(*, sweep: bool) -> int:
    """Collect the unfrozen objects (all of them with ``sweep``), then freeze the survivors.

    Returns how many unreachable objects the collection found.
    """
    if sweep:
        gc.unfreeze()
    found = gc.collect()
    gc.freeze()
    return found


def keep_heap(stop: threading.Event, every_seconds: float, sweep_every: int) -> None:
    """Settle the heap every ``every_seconds`` until ``stop`` is set; a full sweep every
    ``sweep_every``-th time (meant for a daemon thread)."""
    count = 0
    while not stop.wait(every_seconds):
        count += 1
        found = settle(sweep=count % sweep_every == 0)
        log.debug("heap settled: %d unreachable, %d frozen", found, gc.get_freeze_count())
