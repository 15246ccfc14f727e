"""The job's status as a round changes it: the typed model, never the raw dict.

The observed status is read into :class:`TrainingJobStatus` once; steps name the fields
they set in a :class:`StatusChange`. Conditions and the phase history have helpers of
their own, for the rule each keeps (a transition time that moves only on a flip; a
bounded history). The dict the API server stores is made from the model once, when the
round ends.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypedDict

from ringwright.objects import Obj

from ...api.conditions import rfc3339
from ...api.models import (
    AvoidedNode,
    CheckpointIntervalStatus,
    Condition,
    ConditionStatus,
    GoodputStatus,
    JobPhase,
    PendingMembership,
    PhaseTransition,
    RackMembers,
    RecoveryStatus,
    ReplicaStatus,
    SlowMember,
    TrainingJobStatus,
    WorldSummary,
)

PHASE_HISTORY = 32
"""Phase transitions kept in status.phaseHistory (the oldest go first)."""


class StatusChange(TypedDict, total=False):
    """Status fields a step sets, by their names and types in :class:`TrainingJobStatus`.

    The phase, its history, the completion time and the conditions are not here: they
    change through phase moves and conditions, which keep their rules.
    """

    observed_generation: int
    workers: ReplicaStatus
    ps: ReplicaStatus | None
    restarts: int
    failures_since_whole: int
    world: WorldSummary
    selector: str
    start_time: str | None
    last_failure_time: str | None
    last_recovery: RecoveryStatus | None
    below_min_since: str | None
    workers_finished_time: str | None
    lost_pods: list[str]
    candidate: PendingMembership | None
    container_restarts: dict[str, int]
    checkpoint_interval: CheckpointIntervalStatus | None
    goodput: GoodputStatus | None
    slow_members: list[SlowMember]
    avoided_nodes: list[AvoidedNode]


class LifecycleChange(TypedDict, total=False):
    """The status fields that phase moves and conditions set (the draft's, not a step's)."""

    phase: JobPhase
    phase_history: list[PhaseTransition]
    completion_time: str | None
    conditions: list[Condition]


class WorldChange(TypedDict, total=False):
    """Fields of status.world a step sets, by their names and types in
    :class:`WorldSummary`."""

    generation: int
    size: int
    gpu_model: str
    racks: int
    cross_rack_edges: int
    rack_members: list[RackMembers]
    ps_servers: int


def read_status(job: Obj) -> TrainingJobStatus:
    """The job's status as the operator last wrote it (defaults where it has none)."""
    return TrainingJobStatus.model_validate(job.get("status") or {})


def changed(status: TrainingJobStatus, change: StatusChange | LifecycleChange
            ) -> TrainingJobStatus:
    """``status`` with the fields of ``change`` set."""
    return status.model_copy(update=change)


def world_changed(summary: WorldSummary, change: WorldChange) -> WorldSummary:
    """``summary`` with the fields of ``change`` set."""
    return summary.model_copy(update=change)


def find_condition(status: TrainingJobStatus, type_: str) -> Condition | None:
    """The condition of ``type_``, if the status has one."""
    return next((c for c in status.conditions if c.type == type_), None)


def with_condition(conditions: Sequence[Condition], type_: str, ok: bool, reason: str,
                   message: str, now: float, generation: int) -> list[Condition]:
    """``conditions`` with ``type_`` set (in place, or appended); lastTransitionTime moves
    only when the condition's status flips."""
    value = ConditionStatus.TRUE if ok else ConditionStatus.FALSE

    def fresh(before: Condition | None) -> Condition:
        since = (before.last_transition_time if before is not None and before.status == value
                 else rfc3339(now))
        return Condition(type=type_, status=value, reason=reason, message=message,
                         last_transition_time=since, observed_generation=generation)

    out = [fresh(c) if c.type == type_ else c for c in conditions]
    if all(c.type != type_ for c in conditions):
        out.append(fresh(None))
    return out


def with_transition(history: Sequence[PhaseTransition], phase: JobPhase, reason: str,
                    now: float) -> list[PhaseTransition]:
    """``history`` with the move into ``phase`` added; the oldest beyond
    :data:`PHASE_HISTORY` go."""
    entry = PhaseTransition(phase=phase, reason=reason, time=rfc3339(now))
    return [*history, entry][-PHASE_HISTORY:]
