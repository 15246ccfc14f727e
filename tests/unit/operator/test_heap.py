"""The heap keeper: survivors leave the collector's sight; a sweep still frees frozen cycles."""

from __future__ import annotations

import gc
import threading
import weakref
from collections.abc import Iterator

import pytest

from ringwright.operator.heap import keep_heap, settle


class Node:
    """A stand-in for a cached object that is part of a reference cycle."""

    def __init__(self) -> None:
        self.me = self


@pytest.fixture(autouse=True)
def unfrozen() -> Iterator[None]:
    yield
    gc.unfreeze()


def test_settle_freezes_survivors_out_of_later_collections() -> None:
    kept = [Node() for _ in range(100)]
    settle(sweep=False)
    assert gc.get_freeze_count() >= len(kept)


def test_only_a_sweep_frees_a_cycle_that_was_frozen() -> None:
    cycle = Node()
    alive = weakref.ref(cycle)
    settle(sweep=False)
    del cycle
    settle(sweep=False)
    assert alive() is not None  # frozen: an ordinary settle does not see it
    settle(sweep=True)
    assert alive() is None


def test_keep_heap_settles_until_stopped() -> None:
    stop = threading.Event()
    thread = threading.Thread(target=keep_heap, args=(stop, 0.01, 1000), daemon=True)
    thread.start()
    try:
        for _ in range(1000):
            if gc.get_freeze_count() or stop.wait(0.01):
                break
        assert gc.get_freeze_count() > 0
    finally:
        stop.set()
        thread.join(5)
    assert not thread.is_alive()
