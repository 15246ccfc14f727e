"""The trace audit helpers the process tests and the recovery bench rely on."""

from __future__ import annotations

from typing import Any

from tests.runtime.elastic_traces import Rollback, Traces


def start(t: float, generation: int, step: int, pid: int = 1) -> dict[str, Any]:
    return {"ev": "start", "t": t, "generation": generation, "step": step, "pid": pid, "size": 2}


def stepped(t: float, generation: int, step: int) -> dict[str, Any]:
    return {"ev": "stepped", "t": t, "generation": generation, "step": step, "size": 2}


def test_a_world_that_resumes_below_completed_steps_is_one_rollback() -> None:
    traces = Traces({
        "a": [start(0, 0, 0, pid=10), stepped(1, 0, 1), stepped(2, 0, 2), stepped(3, 0, 3),
              start(5, 1, 2, pid=10), stepped(6, 1, 3)],
        "b": [start(0, 0, 0, pid=20), stepped(1, 0, 1), stepped(2, 0, 2), stepped(3, 0, 3),
              start(5.5, 1, 2, pid=21)],
    })
    assert traces.rollbacks() == [Rollback(generation=1, resumed=2, completed=3)]
    assert traces.rollbacks()[0].lost == 1
    assert traces.pids("b") == [20, 21]
    assert traces.trained(1) == {"a"}


def test_a_world_that_resumes_where_the_last_ended_is_no_rollback() -> None:
    traces = Traces({
        "a": [start(0, 0, 0), stepped(1, 0, 1), stepped(2, 0, 2), start(3, 1, 2)],
        "newcomer": [start(3, 1, 2, pid=2)],
    })
    assert traces.rollbacks() == []
