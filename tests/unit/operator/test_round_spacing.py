"""A job's rounds are spaced: a wake-up right after a round waits out the spacing, one
after a quiet spell does not, and stopping the daemon ends either wait."""

from __future__ import annotations

import asyncio

from ringwright.operator.handlers import wait_for_round


async def _waited(woken: bool, spacing: float, stop_after: float | None = None) -> float:
    loop = asyncio.get_running_loop()
    waker, stopped = asyncio.Event(), asyncio.Event()
    if woken:
        waker.set()  # an event came in during the round
    if stop_after is not None:
        loop.call_later(stop_after, stopped.set)
    start = loop.time()
    await wait_for_round(waker, stopped, 60.0, not_before=start + spacing)
    return loop.time() - start


def test_a_wake_up_right_after_a_round_waits_for_the_spacing() -> None:
    assert asyncio.run(_waited(True, 0.2)) >= 0.2


def test_a_wake_up_after_the_spacing_has_passed_starts_the_round_at_once() -> None:
    # The previous round began longer ago than the spacing: no wait at all.
    assert asyncio.run(_waited(True, -1.0)) < 1.0


def test_stopping_ends_the_spacing_wait() -> None:
    assert asyncio.run(_waited(True, 30.0, stop_after=0.05)) < 30.0
