"""What every system in the recovery benchmark shares: workload, timeouts, faults, metrics.

One definition of each interval, for every system:

* recovery: from the fault (the signal sent) to the first step completed by a world of
  the new size (``stepped`` in the workers' traces, written after the step's allreduce);
* partition: from cutting the node's link (its packets silently dropped, both ways) to
  the first step completed by a world of 3, each node in a network namespace of its own
  with an address of its own;
* join: from launching the newcomers' processes to the first step completed at size 4;
* rollbacks and steps lost: from the traces (:meth:`Traces.rollbacks`): a world that
  resumed below a step already completed, and by how many steps.

The same process-group timeout for every system (:data:`PG_TIMEOUT_S`), but for the
row that gives torchrun ringwright's failure detection time (:data:`DETECT_S`), and the
same liveness settings where a system has them (:data:`LIVENESS_INTERVAL_S` x
:data:`LIVENESS_ATTEMPTS`).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from ringwright.runtime.settings import RuntimeSettings
from ringwright.world import Member, World
from tests.runtime import netns
from tests.runtime.elastic_traces import Traces

KILL_AT_STEP = 25
"""Faults happen once training has completed this step: half a commit interval after
the last commit, so every system has the same work at stake."""

VICTIM = 2
"""The member (rank 2 of the first world; torchrun node 2) that a fault hits."""

PG_TIMEOUT_S = 60.0
"""One collective timeout for every system, given to the runtime, to torchrun's workers'
process group and to Horovod's gloo. Not ringwright's default (1800 s, which it can
afford because heartbeats find the dead): the baselines have no other detector for a
frozen peer, and with 1800 s they could not recover within the bench. 60 s is longer
than the straggler's pause, so a slow member is a failure for no one."""

DETECT_S = RuntimeSettings().failure_detect_s
"""ringwright's failure detection time at its defaults (a member silent this long is
dead). The ``tr-detect`` row gives torchrun's process group this timeout: the same
detection for a frozen peer, which a careful torchrun user can only get that way."""

LIVENESS_INTERVAL_S = 1
LIVENESS_ATTEMPTS = 3
"""Heartbeat period and misses before a member counts as gone, where a system has such
settings (torchrun's rendezvous keep-alives in its tuned row)."""

STRAGGLER_S = 30.0
"""How long the straggler pauses after step KILL_AT_STEP."""

STEPS_AFTER = 10
"""A straggler scenario ends once this many steps were completed after the pause."""

WAIT_S = 300.0
"""Bound for things that must happen (start-up, a baseline's SIGKILL recovery or join)."""

IN_PLACE = "restarted in its pod"
REPLACED = "pod replaced"
"""How a killed member's place is filled again: its container (process) started again
in the same pod, or a new pod (an operator replaces a member that its peers named dead
before it was back)."""

FAULT_WAIT_S = 2 * PG_TIMEOUT_S + 60.0
"""Bound for a recovery from a silent fault (SIGSTOP, straggler): past it the system
did not survive the fault, which is a result, not a harness failure."""

WORKLOAD = {
    "EPOCHS": "1",
    "SAMPLES": "200000",  # far more than a run trains: no epoch ends mid-measurement
    "BATCH": "4",
    "COMMIT_EVERY": "10",
    "STEP_SLEEP": "0.03",
    "OMP_NUM_THREADS": "1",
    "TORCH_CPP_LOG_LEVEL": "ERROR",
}


@contextlib.contextmanager
def node_network() -> Iterator[netns.NamespacedPods]:
    """One network namespace per node, on a bridge the benchmark can cut a node from."""
    reason = netns.available()
    if reason is not None:
        raise BaselineFailed(f"partition scenario: {reason}")
    nodes = netns.NamespacedPods()
    try:
        yield nodes
    finally:
        nodes.close()


def next_victim(world: World, killed: set[str]) -> Member:
    """The member of ``world`` that the next of several kills hits: never the one that
    hosts the world's store (losing it is another fault), rank VICTIM's, or, once its
    pod was hit, the lowest rank whose pod was not (a kubelet delays a second restart of
    one container by 10 s, its crash-loop back-off, which a figure must not include)."""
    return min((m for m in world.members if m.ip != world.store.address),
               key=lambda m: (m.pod in killed, m.rank != VICTIM, m.rank))


def straggler_env(workdir: Path) -> dict[str, str]:
    """Environment that makes rank VICTIM pause STRAGGLER_S once after KILL_AT_STEP."""
    return {"PAUSE_STEP": str(KILL_AT_STEP), "PAUSE_RANK": str(VICTIM),
            "PAUSE_SECONDS": str(STRAGGLER_S), "PAUSE_FILE": str(workdir / "paused")}


@dataclass
class Outcome:
    """One system in one scenario."""

    seconds: float | None
    """The scenario's interval; None when the system did not get there in time."""
    note: str
    rollbacks: int = 0
    steps_lost: int = 0
    extra: dict[str, str] = field(default_factory=dict)

    def cell(self) -> str:
        """The table cell."""
        if self.seconds is None:
            return "not survived"
        return f"{self.seconds:.2f} s"


class BaselineFailed(RuntimeError):
    """A peer failed at something it is built for: the benchmark's numbers are void."""


def wait_until(what: str, probe: Callable[[], bool], timeout: float = WAIT_S,
               interval: float = 0.05) -> None:
    """Poll ``probe`` every ``interval`` seconds until true; TimeoutError after
    ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not probe():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(interval)


def steps_done(trace_dir: Path) -> int:
    """Highest completed step any worker has recorded."""
    return max((r["step"] for _, r in Traces.load(trace_dir).events("stepped")), default=0)


def whole_and_training(trace_dir: Path, whole: Callable[[], World | None], steps: int,
                       timeout: float = WAIT_S, interval: float = 0.05) -> World:
    """Wait until the world that ``whole`` returns (None while the job's world is not
    whole) trained: every member completed a step in it, then ``steps`` more steps were
    completed with no other world published meanwhile. That world: a fault injected
    now hits steady training, not a world still forming (start-up publishes several)."""
    deadline = time.monotonic() + timeout
    while True:
        def trained() -> bool:
            world = whole()
            return world is not None and \
                {m.pod for m in world.members} <= Traces.load(trace_dir).trained(world.generation)

        wait_until("a whole world training", trained, deadline - time.monotonic(), interval)
        world = whole()
        trained_on(trace_dir, steps, interval)
        now = whole()
        if world is not None and now is not None and now.generation == world.generation:
            return now


def trained_on(trace_dir: Path, steps: int, interval: float = 0.05) -> None:
    """Wait until ``steps`` more steps than now were completed (training went on)."""
    target = steps_done(trace_dir) + steps
    wait_until(f"step {target}", lambda: steps_done(trace_dir) >= target, WAIT_S, interval)


def first_step_at(trace_dir: Path, size: int, after: float = 0.0) -> float | None:
    """When a world of ``size`` first completed a step after ``after``."""
    times = [r["t"] for _, r in Traces.load(trace_dir).events("stepped")
             if r["size"] == size and r["t"] > after]
    return min(times) if times else None


def time_to_size(trace_dir: Path, size: int, since: float, timeout: float
                 ) -> float | None:
    """Seconds from ``since`` to the first step at ``size``; None past ``timeout``."""
    try:
        wait_until(f"a step at size {size}",
                   lambda: first_step_at(trace_dir, size, since) is not None, timeout)
    except TimeoutError:
        return None
    done = first_step_at(trace_dir, size, since)
    assert done is not None
    return done - since


def shrink_and_heal(trace_dir: Path, since: float, timeout: float = WAIT_S,
                    interval: float = 0.05) -> tuple[float, float]:
    """Seconds from ``since`` (a member of a world of 4 lost) to the first step completed
    by a world of 3, and to the first step completed by a world of 4 after that one.
    BaselineFailed when either never comes within ``timeout``, or when a new world of 4
    trained before any world of 3 did (the lost member was back before the others
    re-formed without it: there is no figure to the smaller world)."""
    def generation_before() -> int:
        return max((r["generation"] for _, r in Traces.load(trace_dir).events("stepped")
                    if r["t"] <= since), default=-1)

    old = generation_before()

    def shrunk_or_skipped() -> bool:
        stepped = Traces.load(trace_dir).events("stepped")
        return any(r["t"] > since and (r["size"] == 3 or r["generation"] > old)
                   for _, r in stepped)

    try:
        wait_until("a step by a new world", shrunk_or_skipped, timeout, interval)
    except TimeoutError as err:
        raise BaselineFailed(f"no new world trained within {timeout:.0f} s of the fault; "
                             f"traces in {trace_dir}") from err
    at_three = first_step_at(trace_dir, 3, since)
    if at_three is None:
        raise BaselineFailed(f"a new world of 4 trained before any world of 3 (the lost "
                             f"member rejoined first); traces in {trace_dir}")
    try:
        wait_until("a step by a world of 4 again",
                   lambda: first_step_at(trace_dir, 4, at_three) is not None, timeout, interval)
    except TimeoutError as err:
        raise BaselineFailed(f"no world of 4 trained within {timeout:.0f} s of the world "
                             f"of 3; traces in {trace_dir}") from err
    healed = first_step_at(trace_dir, 4, at_three)
    assert healed is not None
    return at_three - since, healed - since


def losses(trace_dir: Path) -> tuple[int, int]:
    """(rollbacks, steps lost) from the traces."""
    rolled = Traces.load(trace_dir).rollbacks()
    return len(rolled), sum(r.lost for r in rolled)


def straggler_outcome(trace_dir: Path, paused_at: float) -> Outcome:
    """Wait for STEPS_AFTER more steps after the pause; count what it cost."""
    target = KILL_AT_STEP + STEPS_AFTER
    try:
        wait_until(f"step {target}", lambda: steps_done(trace_dir) >= target,
                   STRAGGLER_S + FAULT_WAIT_S)
    except TimeoutError:
        rollbacks, lost = losses(trace_dir)
        return Outcome(None, f"training stopped: no step {target} within "
                             f"{STRAGGLER_S + FAULT_WAIT_S:.0f} s", rollbacks, lost)
    done = min(r["t"] for _, r in Traces.load(trace_dir).events("stepped")
               if r["step"] == target)
    rollbacks, lost = losses(trace_dir)
    return Outcome(done - paused_at, f"step {target} reached", rollbacks, lost)


def signal_running(pids: Iterable[int], script: Path, sig: int) -> list[int]:
    """Send ``sig`` to each of ``pids`` that still runs ``script``; the ones signalled.

    A pid read from a trace may belong to any other process by now (pids are reused
    within minutes on a busy machine: a test run beside the bench starts thousands), and
    that process must never be signalled.
    """
    done = []
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            proc = psutil.Process(pid)
            if str(script) in proc.cmdline():
                proc.send_signal(sig)
                done.append(pid)
    return done
