"""The step that counts failures and deletes the failed, within backoffLimit."""

from __future__ import annotations

from ringwright.eviction import judge
from ringwright.world import Member, ReportKind

from ...api.conditions import rfc3339
from ...api.models import JobPhase, TrainingJobStatus
from ...api.schedulingpolicy import SchedulingPolicySpec
from ..health.nodeloss import lost_members, new_container_restarts
from ..manifests import PS, WORKER
from ..pods import PodState, PodView
from ..types import Event
from .state import Move, Outcome, Round, event, merged
from .status import StatusChange


def failures(r: Round, status: TrainingJobStatus) -> Outcome:
    """Failed pods and members that vanished, were judged dead by their peers, stalled or
    lost their node are replaced, each counted once, within backoffLimit.

    One failure counts once: a member its peers name dead (or that reports a stall) after
    its container restarted is the restart already counted, and a pod counted lost does
    not count again when its container restarts before it is gone. The pod of a member
    lost only that way is kept (the kubelet already started its process again, on the
    same node and image): it leaves the next world, so its peers train on, and its new
    process asks to join like any newcomer.
    Pods are tracked as ``name/uid``: a replacement reuses its predecessor's name.
    Sets: status.lostPods, containerRestarts, restarts, failuresSinceWhole,
    lastFailureTime; phase Failed past backoffLimit, which stops the round; the plan's
    delete and clear_reports; the pods the next world leaves out."""
    lost, restarted, found = _lost(r)
    return merged(found, _counted(r, status, lost, restarted))


def restarted_since_published(p: PodView, member: Member | None,
                              published_at: float | None) -> bool:
    """True when ``p``'s container restarted after the world was written: the process its
    peers knew in that world is the one whose exit the container restart counts.

    The world's ``member`` says how often the container had restarted when it was
    written: more restarts now is exact, however soon after the write the process died.
    A world of an older operator has no count; then the container's start is compared
    with the write, and ``started`` has whole seconds, so a restart within the second of
    the write reads as before it (counted twice, never missed)."""
    if member is not None and member.restarts is not None and member.pod_uid == p.uid:
        return p.restarts > member.restarts
    return (p.restarts > 0 and p.started is not None and published_at is not None
            and p.started >= published_at)


def _lost(r: Round) -> tuple[list[str], set[str], Outcome]:
    """The pods and members lost (``name/uid``, in the order found, repeats possible), those
    of them lost only to their peers' word about a process their container restart
    replaced (counted by that restart, kept to rejoin), and what finding them decided:
    events, stall reports answered, when a node is due."""
    world = r.obs.world
    members = {f"{m.pod}/{m.pod_uid}" for m in world.members} if world else set()
    everyone = r.pods
    present = {f"{p.name}/{p.uid}": p for p in everyone}
    lost = [key for key, p in present.items() if p.state == PodState.FAILED]
    lost += sorted(members - present.keys())
    judged_from = len(lost)
    told: list[Event] = []
    cleared: list[str] = []
    restarted: set[str] = set()

    listed = {m.pod: m for m in world.members if m.local_rank == 0} if world else {}

    def _judged(p: PodView, reason: str, message: str) -> None:
        key = f"{p.name}/{p.uid}"
        lost.append(key)
        if restarted_since_published(p, listed.get(p.name), r.obs.world_published_at):
            restarted.add(key)
            message += ("; its container restarted since (counted once): it leaves the "
                        "world and joins again")
        else:
            message += "; replacing it"
        told.append(event(reason, message, warning=True))

    if world is not None:
        # Peers' word, corroborated: several reporters, or one and the pod not Ready.
        unhealthy = {p.name for p in everyone if p.state != PodState.READY}
        for e in judge(world, r.obs.reports, unhealthy):
            pod_ = next((p for p in everyone if p.name == e.pod), None)
            if pod_ is not None and pod_.state != PodState.DELETING:
                _judged(pod_, "MemberDead",
                        f"{e.pod} is dead: {e.reason} ({', '.join(e.reporters)})")
    for name, report in r.obs.reports.items():
        pod_ = next((p for p in everyone if p.name == name), None)
        if (report.kind == ReportKind.STALLED and world is not None
                and report.generation == world.generation and pod_ is not None
                and pod_.state != PodState.DELETING):
            cleared.append(name)
            _judged(pod_, "MemberStalled", f"{name} reports its training loop stalled")
    # Without a usable policy losses still count, with the default thresholds.
    node_loss = (r.obs.policy or SchedulingPolicySpec()).node_loss
    grace = {WORKER: float(r.spec.workers.startup_grace_seconds)}
    if r.spec.ps is not None:
        grace[PS] = float(r.spec.ps.startup_grace_seconds)
    losses, next_at = lost_members(everyone, r.obs.node_down_since,
                                   node_loss.unready_seconds, r.now, grace)
    for loss in losses:
        lost.append(f"{loss.pod.name}/{loss.pod.uid}")
        told.append(event(loss.reason, f"{loss.message}; replacing it", warning=True))
    # Lost for another reason too (failed, gone, its node down): replaced after all.
    restarted -= {key for key in lost[:judged_from]} | {
        f"{loss.pod.name}/{loss.pod.uid}" for loss in losses}
    return lost, restarted, Outcome(events=tuple(told), clear_reports=tuple(cleared),
                         requeue=next_at - r.now if next_at is not None else None)


def _counted(r: Round, status: TrainingJobStatus, lost: list[str],
             restarted: set[str]) -> Outcome:
    """Delete the lost pods still present, except ``restarted`` (lost pods whose container
    restart is their failure: left out of the next world instead); count what was not
    counted before, with the containers that restarted; fail the job past backoffLimit."""
    members = {f"{m.pod}/{m.pod_uid}" for m in r.obs.world.members} if r.obs.world else set()
    present = {f"{p.name}/{p.uid}": p for p in r.pods}
    known = set(status.lost_pods)
    crashed, counted = new_container_restarts(r.pods, status.container_restarts)
    crashed = {key: n for key, n in crashed.items() if key not in known}
    new = [key for key in dict.fromkeys(lost) if key not in known]
    fresh = [key for key in new if key not in restarted]
    # Remember what was counted while it is still visible, so each loss counts once. A
    # kept pod is not lost: its next failure counts again.
    change = StatusChange(container_restarts=counted, lost_pods=sorted(
        (known | (set(new) - restarted)) & (present.keys() | members)))
    gone = [key for key in dict.fromkeys(lost) if key in present
            and present[key].state != PodState.DELETING]
    doomed = tuple(present[key].name for key in gone if key not in restarted)
    rejoin = tuple(present[key].name for key in gone if key in restarted)
    if not fresh and not crashed:
        return Outcome(status=change, delete=doomed, out_of_world=rejoin)
    failed = len(fresh) + sum(crashed.values())
    restarts = status.restarts + failed
    change["restarts"] = restarts
    change["failures_since_whole"] = status.failures_since_whole + failed
    change["last_failure_time"] = rfc3339(r.now)
    limit = r.spec.run_policy.backoff_limit
    told: list[Event] = []
    if fresh:
        names = ", ".join(key.split("/")[0] for key in fresh)
        told.append(event("MemberLost", f"lost {names} (restart {restarts} of backoffLimit "
                          f"{limit})", warning=True))
    if crashed:
        names = ", ".join(f"{key.split('/')[0]} ({n})" for key, n in crashed.items())
        told.append(event("ContainerRestarted", f"containers restarted in {names} (restart "
                          f"{restarts} of backoffLimit {limit})", warning=True))
    if restarts <= limit:
        return Outcome(status=change, delete=doomed, out_of_world=rejoin, events=tuple(told))
    exceeded = Move(JobPhase.FAILED, "BackoffLimitExceeded",
                    f"{restarts} pod failures exceed spec.runPolicy.backoffLimit={limit}")
    return Outcome(status=change, delete=doomed, out_of_world=rejoin, events=tuple(told),
                   moves=(exceeded,), stop=True)
