"""Steps that read the members' stats: goodput and the checkpoint interval in the
status, and stragglers replaced."""

from __future__ import annotations

from ringwright.stragglers import faster_without, slowness

from ...api.conditions import rfc3339
from ...api.models import AvoidedNode, SlowMember, TrainingJobStatus
from ...api.schedulingpolicy import SchedulingPolicySpec
from ..health.goodput import checkpoint_interval, goodput
from ..health.stragglers import inventory_without, judge, still_avoided
from ..pods import PodState
from .state import NOTHING, Outcome, Round, SetCondition, event
from .status import StatusChange, find_condition

CONDITION = "Straggler"


def measurements(r: Round, status: TrainingJobStatus) -> Outcome:
    """Goodput over the job's life and the checkpoint interval followed now.

    Sets: status.goodput, status.checkpointInterval (each once it is known)."""
    change = StatusChange()
    counted = goodput(r.obs.stats, status.goodput)
    if counted is not None and counted != status.goodput:
        change["goodput"] = counted
    interval = checkpoint_interval(r.obs.stats, r.obs.world,
                                   r.spec.checkpoint.interval_steps == "Auto")
    if interval is not None and interval != status.checkpoint_interval:
        change["checkpoint_interval"] = interval
    return Outcome(status=change) if change else NOTHING


def stragglers(r: Round, policy: SchedulingPolicySpec, status: TrainingJobStatus,
               doomed: frozenset[str]) -> Outcome:
    """Members slower than their peers for the policy's window leave the world; their
    node is avoided for ``avoidSeconds``. The member is replaced when a spare fits (the
    resize of the next round creates it off that node); without one it is still dropped
    when the ring is faster without it and the job stays at or above spec.workers.min.

    ``doomed``: pods earlier steps delete. Sets: status.slowMembers, status.avoidedNodes,
    condition Straggler (once one was seen), events; the plan's mark_leaving."""
    settings = policy.stragglers
    avoided = still_avoided(status.avoided_nodes, r.now)
    world = r.obs.world
    if not settings.enabled or world is None:
        return _recorded(status, [], avoided)
    live = {p.name: p for p in r.workers if p.state == PodState.READY
            and p.name not in doomed and p.leaving_since is None}
    verdict = judge(slowness(r.obs.stats, world), {n: p.node for n, p in live.items()},
                    status.slow_members, factor=settings.factor,
                    window_s=settings.window_seconds, now=r.now)
    watching = [m for m in verdict.watching if m.pod in live]
    found = [m for m in verdict.stragglers if m.pod in live]
    if not found:
        out = _recorded(status, watching, avoided)
        if not watching and _was_true(status):
            return Outcome(status=out.status, conditions=(SetCondition(
                CONDITION, False, "NoStragglers", "every member keeps pace with its peers"),))
        return out
    # One at a time: the slowest; the others are judged again in the next world.
    slow = max(found, key=lambda m: m.ratio)
    watching += [m for m in found if m is not slow]
    where = f"on node {slow.node}" if slow.node else "(node unknown)"
    what = (f"{slow.pod} {where} has been {slow.ratio:.2f}x slower than its peers' median "
            f"for {r.now - slow.since:.0f}s (SchedulingPolicy stragglers.factor "
            f"{settings.factor}, windowSeconds {settings.window_seconds})")
    if slow.node and settings.avoid_seconds and all(a.node != slow.node for a in avoided):
        # Once: a straggler kept round after round must not move its record's expiry.
        avoided = [*avoided, AvoidedNode(
            node=slow.node, until=rfc3339(r.now + settings.avoid_seconds),
            reason=f"{slow.pod} ran {slow.ratio:.2f}x slower than its peers")]
    size = len(world.pods)
    if _spare_fits(r, policy, slow.pod, {a.node for a in avoided}):
        reason, verb = "StragglerReplaced", "replaced off that node"
    elif size - 1 >= r.spec.workers.min and faster_without(slow.ratio, size):
        reason, verb = "StragglerDropped", (f"dropped: no spare fits and {size - 1} members "
                                            f"train faster than {size} with it")
    else:
        kept = _recorded(status, [*watching, slow], avoided)
        message = (f"{what}; kept: no spare fits and dropping it would leave the job "
                   f"below spec.workers.min ({r.spec.workers.min}) or slower")
        return Outcome(status=kept.status,
                       conditions=(SetCondition(CONDITION, True, "StragglerKept", message),),
                       events=() if _was_true(status) else (
                           event("StragglerKept", message, warning=True),))
    message = f"{what}; {verb}"
    return Outcome(status=_recorded(status, watching, avoided).status,
                   conditions=(SetCondition(CONDITION, True, reason, message),),
                   events=(event(reason, message, warning=True),),
                   mark_leaving=(slow.pod,))


def _was_true(status: TrainingJobStatus) -> bool:
    found = find_condition(status, CONDITION)
    return found is not None and found.status.value == "True"


def _recorded(status: TrainingJobStatus, watching: list[SlowMember],
              avoided: list[AvoidedNode]) -> Outcome:
    """The status records, set only when they changed."""
    change = StatusChange()
    if watching != status.slow_members:
        change["slow_members"] = watching
    if avoided != status.avoided_nodes:
        change["avoided_nodes"] = avoided
    return Outcome(status=change) if change else NOTHING


def _spare_fits(r: Round, policy: SchedulingPolicySpec, pod: str, avoided: set[str]) -> bool:
    """Whether a worker fits in place of ``pod`` off the ``avoided`` nodes now."""
    live = [p for p in r.workers if p.alive and p.leaving_since is None and p.name != pod]
    live += [p for p in r.ps if p.alive]
    placed = r.placer(r.spec, policy, inventory_without(r.obs.inventory, avoided), live)
    return not placed.reason and len(placed.workers) >= 1
