"""When a job is done: a pure rule per mode, read from the pods and the world.

Ring mode: the job succeeds when rank 0 exits 0; the other ranks end with it (one that
exits 0 first is done, not lost: nothing is replaced while rank 0 ends). The clean-up
gives the ones still running a grace to exit on their own (``clean_up`` in
``round/lifecycle.py``).

ParameterServer mode: a worker exits 0 only when the data-shard service says the last
generation is done (a planned leave carries the leaving annotation), so such a worker is
*finished*, not lost: it is neither replaced nor does the job wait for a new one. The
job succeeds once no worker is still running and every ps pod has exited, or
``ps_exit_grace`` after the last worker finished (the servers linger for the workers'
last pushes; a server that does not exit by then is deleted with the job's pods).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ringwright.world import Mode, World

from ..pods import PodState, PodView

RUNNING = frozenset({PodState.READY, PodState.UNREADY})


@dataclass(frozen=True)
class Completion:
    """What the completion rule says about a job this round."""

    succeeded: bool = False
    finishing: bool = False
    """The work is done but pods are still ending: replace nothing, publish nothing."""
    workers_finished_at: float | None = None
    """When the last worker finished (kept in status across rounds), or None."""
    message: str = ""
    wait: float | None = None
    """Seconds until the rule should be asked again (the ps exit grace running out)."""


def finished(p: PodView) -> bool:
    """A pod that exited 0 on its own (not because a scale-down asked it to leave)."""
    return p.state == PodState.SUCCEEDED and p.leaving_since is None


def completion(mode: Mode, world: World | None, workers: Sequence[PodView],
               ps: Sequence[PodView], workers_finished_at: float | None, now: float,
               ps_exit_grace: float) -> Completion:
    """The completion verdict for one round; ``workers_finished_at`` is the previous
    round's :attr:`Completion.workers_finished_at`."""
    if mode != Mode.PARAMETER_SERVER:
        return _ring(world, workers)
    done = [w for w in workers if finished(w)]
    if not done:
        # A server exits 0 only after the data is done: the workers follow shortly.
        servers = sorted(p.name for p in ps if finished(p))
        return Completion(finishing=bool(servers), message=f"{', '.join(servers)} finished "
                          "the data; waiting for the workers") if servers else Completion()
    running = [w.name for w in workers if w.state in RUNNING]
    if running:
        return Completion(finishing=True, message=f"{len(done)} workers finished the data; "
                          f"waiting for {', '.join(sorted(running))}")
    since = now if workers_finished_at is None else workers_finished_at
    serving = sorted(p.name for p in ps if p.alive)
    summary = f"all {len(done)} workers finished the data"
    if not serving:
        return Completion(succeeded=True, workers_finished_at=since,
                          message=f"{summary} and every ps pod exited")
    left = since + ps_exit_grace - now
    if left <= 0:
        return Completion(succeeded=True, workers_finished_at=since,
                          message=f"{summary}; {', '.join(serving)} did not exit within "
                          f"{ps_exit_grace:g}s and are deleted")
    return Completion(finishing=True, workers_finished_at=since, wait=left,
                      message=f"{summary}; waiting for {', '.join(serving)} to exit")


def _ring(world: World | None, workers: Sequence[PodView]) -> Completion:
    if world is None or not world.members:
        return Completion()
    rank0 = world.members[0].pod
    if any(w.name == rank0 and finished(w) for w in workers):
        return Completion(succeeded=True, message=f"rank 0 ({rank0}) exited successfully")
    # The members finish training at the same step: one that exited 0 before rank 0 is
    # done, not lost (replacing it would re-form a world whose training has ended).
    members = {m.pod for m in world.members}
    done = sorted(w.name for w in workers if w.name in members and finished(w))
    if done:
        return Completion(finishing=True, message=f"{', '.join(done)} finished training; "
                          f"waiting for rank 0 ({rank0})")
    return Completion()
