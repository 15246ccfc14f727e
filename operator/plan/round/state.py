"""The values every step of a reconcile round reads and writes, and the helpers they
share (events, conditions, phase moves, the next epoch, the closing status).
"""

from __future__ import annotations

from ...api.conditions import rfc3339
from ...api.models import JobPhase, ReplicaStatus, TrainingJobSpec
from ...settings import OperatorSettings
from ..epochs import EpochsSeen, next_epoch
from ..manifests import JOB_LABEL, PS, ROLE_LABEL, WORKER
from ..phases import TERMINAL, check_transition
from ..pods import PodState, view
from ..types import Event, Observed, Placer, Plan
from .status import StatusChange, changed, read_status, with_condition, with_transition


class RoundState:
    """One planning round; a class only to share the values every step reads."""

    def __init__(self, obs: Observed, settings: OperatorSettings, now: float,
                 placer: Placer) -> None:
        self.obs, self.settings, self.now, self.placer = obs, settings, now, placer
        self.job = obs.job
        self.meta = obs.job["metadata"]
        self.spec = TrainingJobSpec.model_validate(obs.job["spec"])
        self.status = read_status(obs.job)
        self.generation = int(self.meta.get("generation", 0))
        self.phase = self.status.phase
        self.plan = Plan()
        views = [v for v in (view(p) for p in obs.pods) if v is not None]
        self.workers = [v for v in views if v.role == WORKER]
        self.ps = [v for v in views if v.role == PS]
        self.finishing = False
        """The work is done, pods are ending: nothing is replaced or published."""

    # -- helpers -------------------------------------------------------------------

    def event(self, reason: str, message: str, warning: bool = False) -> None:
        self.plan.events.append(Event("Warning" if warning else "Normal", reason, message))

    def set(self, change: StatusChange) -> None:
        self.status = changed(self.status, change)

    def condition(self, type_: str, ok: bool, reason: str, message: str) -> None:
        self.status = self.status.model_copy(update={"conditions": with_condition(
            self.status.conditions, type_, ok, reason, message, self.now, self.generation)})

    def move(self, phase: JobPhase, reason: str, message: str) -> None:
        if phase == self.phase:
            return
        check_transition(self.phase, phase)
        self.event(reason, f"{self.phase} -> {phase}: {message}",
                   warning=phase in (JobPhase.FAILED, JobPhase.RESTARTING))
        self.status = self.status.model_copy(update={
            "phase_history": with_transition(self.status.phase_history, phase, reason,
                                             self.now)})
        self.phase = phase
        if phase in TERMINAL:
            self.status = self.status.model_copy(update={"completion_time": rfc3339(self.now)})
            self.condition(phase.value, True, reason, message)

    def next_epoch(self) -> int:
        """The next world's epoch: above the document, its annotation and the status."""
        current = self.obs.world
        return next_epoch(EpochsSeen(
            document=current.epoch if current else 0,
            annotation=self.obs.world_annotation_epoch,
            status=self.status.world.epoch))

    def finish(self) -> Plan:
        deleted = set(self.plan.delete) | set(self.plan.delete_gracefully)
        live = [p for p in self.workers if p.alive and p.name not in deleted]
        self.set(StatusChange(
            observed_generation=self.generation,
            selector=f"{JOB_LABEL}={self.meta['name']},{ROLE_LABEL}={WORKER}",
            workers=ReplicaStatus(
                desired=self.spec.workers.replicas,
                active=len(live) + sum(1 for o in self.plan.create
                                       if o["metadata"]["labels"][ROLE_LABEL] == WORKER),
                ready=sum(1 for p in live if p.state == PodState.READY),
                succeeded=sum(1 for p in self.workers if p.state == PodState.SUCCEEDED),
                failed=sum(1 for p in self.workers if p.state == PodState.FAILED))))
        if self.spec.ps is not None:
            self.set(StatusChange(ps=ReplicaStatus(
                desired=self.spec.ps.replicas,
                active=sum(1 for p in self.ps if p.alive),
                ready=sum(1 for p in self.ps if p.state == PodState.READY))))
        self.plan.status = self.status.model_copy(update={"phase": self.phase}).to_wire()
        return self.plan
