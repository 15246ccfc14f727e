"""Which newcomers may enter the next world: the rule of the local launcher, written
beside the world contract so that whoever publishes worlds can apply the same one.

A world that includes a process still starting (its image pulled, torch imported, CUDA
started) makes every member stop at its next commit and wait for it. So a newcomer (a
new pod, or a process restarted without state) enters a world only once it has said
that it is ready to take part: its newest report is ``joining`` for the current
generation (it read that world, found itself outside it, and waits for the next). Until
then the members keep training; then they switch at a commit and stand still only for
the group formation and the state transfer.

A ``joining`` report for an older generation does not count. A newcomer answers every
world that leaves it out with a new report, so an old one is stale: written by a process
that has joined since, or died.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from .world import Report, ReportKind, World


def ready_to_join(world: World | None, reports: Mapping[str, Report],
                  pods: Iterable[str], uids: Mapping[str, str] | None = None) -> list[str]:
    """Those of ``pods`` (in their order) that may enter the world after ``world``.

    A member of ``world`` may (it needs no announcement), and so does every pod before
    the first world (nobody trains yet, so nobody waits); any other pod only when its
    newest report in ``reports`` (by pod) is ``joining`` for ``world``'s generation.

    ``uids`` (pod name to uid, where known) tells a member from a replacement created
    under its name: a pod whose uid is not its namesake member's starts from nothing,
    so it is a newcomer like any other.
    """
    if world is None:
        return list(pods)
    members = {m.pod: m.pod_uid for m in world.members}
    known = uids or {}

    def member(pod: str) -> bool:
        if pod not in members:
            return False
        uid, was = known.get(pod, ""), members[pod]
        return not uid or not was or uid == was

    def announced(pod: str) -> bool:
        report = reports.get(pod)
        return report is not None and report.kind is ReportKind.JOINING \
            and report.generation == world.generation

    return [pod for pod in pods if member(pod) or announced(pod)]
