"""Checkpoint triggers: step and time intervals, and SIGTERM as a flag with a deadline."""

from __future__ import annotations

import os
import signal
import threading

import pytest

from ringwright.runtime.checkpoint.policy import CheckpointPolicy, TerminationSignal
from ringwright.world import CheckpointSettings


class FakeClock:
    def __init__(self, now: float = 100.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.mark.parametrize(
    ("policy", "step", "now", "due"),
    [
        (CheckpointPolicy(interval_steps=10), 19, 0.0, False),
        (CheckpointPolicy(interval_steps=10), 20, 0.0, True),
        (CheckpointPolicy(interval_steps=10), 35, 0.0, True),
        (CheckpointPolicy(interval_seconds=60), 11, 59.9, False),
        (CheckpointPolicy(interval_seconds=60), 11, 60.0, True),
        (CheckpointPolicy(interval_steps=100, interval_seconds=60), 12, 61.0, True),
        (CheckpointPolicy(interval_steps=5, interval_seconds=600), 15, 1.0, True),
        (CheckpointPolicy(), 10_000, 1e9, False),
        # never twice for one step, nor for a step at or before the last checkpoint
        (CheckpointPolicy(interval_seconds=1), 10, 100.0, False),
        (CheckpointPolicy(interval_steps=1), 9, 100.0, False),
    ],
)
def test_due(policy: CheckpointPolicy, step: int, now: float, due: bool) -> None:
    assert policy.due(step=step, now=now, last_step=10, last_time=0.0) is due


def test_policy_from_the_world_settings() -> None:
    settings = CheckpointSettings.model_validate(
        {"path": "/ckpt", "intervalSteps": 500, "intervalSeconds": 900, "keep": 2}
    )
    policy = CheckpointPolicy.from_settings(settings)
    assert policy == CheckpointPolicy(500, 900.0)
    assert policy.periodic
    assert not CheckpointPolicy.from_settings(CheckpointSettings()).periodic


def test_negative_intervals_are_refused() -> None:
    with pytest.raises(ValueError, match="intervalSteps=-1"):
        CheckpointPolicy(interval_steps=-1)


def test_trigger_sets_the_flag_once_and_starts_the_deadline() -> None:
    clock = FakeClock()
    seen: list[int] = []
    stop = TerminationSignal(grace_seconds=30, margin_seconds=2, clock=clock, callback=seen.append)
    assert not stop.requested and stop.signum is None
    assert stop.remaining() == 28.0  # the whole budget while nothing has arrived
    clock.now += 5  # nothing arrived: time passing does not spend the budget
    assert stop.remaining() == 28.0
    stop.trigger(signal.SIGTERM)
    clock.now += 10
    stop.trigger(signal.SIGINT)  # a second signal changes nothing
    assert stop.requested and stop.signum == signal.SIGTERM
    assert seen == [signal.SIGTERM]
    assert stop.remaining() == 18.0
    clock.now += 100
    assert stop.remaining() == 0.0


def test_a_real_sigterm_sets_the_flag_and_uninstall_restores_the_handler() -> None:
    before = signal.getsignal(signal.SIGTERM)
    with TerminationSignal() as stop:
        assert signal.getsignal(signal.SIGTERM) != before
        os.kill(os.getpid(), signal.SIGTERM)
        # Python runs handlers between bytecodes of the main thread; this loop
        # yields such points until the handler has run.
        for _ in range(1_000_000):
            if stop.requested:
                break
        assert stop.requested and stop.signum == signal.SIGTERM
    assert signal.getsignal(signal.SIGTERM) == before


def test_install_rules() -> None:
    stop = TerminationSignal().install()
    try:
        with pytest.raises(RuntimeError, match="already installed"):
            stop.install()
    finally:
        stop.uninstall()
    errors: list[BaseException] = []

    def install_off_main() -> None:
        try:
            TerminationSignal().install()
        except RuntimeError as exc:
            errors.append(exc)

    thread = threading.Thread(target=install_off_main)
    thread.start()
    thread.join()
    assert len(errors) == 1 and "main thread" in str(errors[0])
    with pytest.raises(ValueError, match="grace_seconds"):
        TerminationSignal(grace_seconds=0)
