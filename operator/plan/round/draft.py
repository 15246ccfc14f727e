"""The round's decisions so far: the typed status and the plan, changed only by recording
the steps' outcomes, in order."""

from __future__ import annotations

from dataclasses import dataclass, field

from ...api.conditions import rfc3339
from ...api.models import JobPhase, TrainingJobStatus
from ..phases import TERMINAL, check_transition
from ..types import Plan
from .state import Move, Outcome, Round, SetCondition, event
from .status import LifecycleChange, changed, read_status, with_condition, with_transition


@dataclass
class Draft:
    """The status and plan as far as the steps recorded so far decided them."""

    status: TrainingJobStatus
    now: float
    generation: int
    plan: Plan = field(default_factory=Plan)
    finishing: bool = False
    """A step found the work done with pods still ending."""
    out_of_world: list[str] = field(default_factory=list)
    """Pods a step keeps but leaves out of the next world (not the apply layer's)."""

    @classmethod
    def of(cls, r: Round) -> Draft:
        """A draft that starts from the job's status as observed."""
        return cls(read_status(r.job), r.now, r.generation)

    @property
    def phase(self) -> JobPhase:
        return self.status.phase

    def take(self, out: Outcome) -> Outcome:
        """Record one step's outcome; returns it, so a caller can test ``stop``."""
        self.status = changed(self.status, out.status)
        plan = self.plan
        plan.events.extend(out.events)
        for move in out.moves:
            self._move(move)
        for cond in out.conditions:
            self._condition(cond)
        plan.create.extend(out.create)
        plan.mark_leaving.extend(out.mark_leaving)
        plan.delete.extend(out.delete)
        plan.delete_gracefully.extend(out.delete_gracefully)
        plan.delete_left_behind.extend(out.delete_left_behind)
        plan.clear_reports.extend(out.clear_reports)
        self.out_of_world.extend(out.out_of_world)
        if out.world is not None:
            plan.world, plan.world_version = out.world, out.world_version
        plan.delete_job = plan.delete_job or out.delete_job
        if out.requeue is not None:
            plan.soon(out.requeue)
        self.finishing = self.finishing or out.finishing
        return out

    def done(self) -> Plan:
        """The plan, with the status in the form the API server stores."""
        self.plan.status = self.status.to_wire()
        return self.plan

    def _condition(self, cond: SetCondition) -> None:
        self.status = changed(self.status, LifecycleChange(conditions=with_condition(
            self.status.conditions, cond.type, cond.ok, cond.reason, cond.message, self.now,
            self.generation)))

    def _move(self, move: Move) -> None:
        """Enter ``move.phase``: an event, a history entry and, for a finished job, its
        completion time and condition. Staying put is no move."""
        before, phase = self.phase, move.phase
        if phase == before:
            return
        check_transition(before, phase)
        self.plan.events.append(event(
            move.reason, f"{before} -> {phase}: {move.message}",
            warning=phase in (JobPhase.FAILED, JobPhase.RESTARTING)))
        self.status = changed(self.status, LifecycleChange(
            phase=phase,
            phase_history=with_transition(self.status.phase_history, phase, move.reason,
                                          self.now)))
        if phase in TERMINAL:
            self.status = changed(self.status, LifecycleChange(completion_time=rfc3339(self.now)))
            self._condition(SetCondition(phase.value, True, move.reason, move.message))
