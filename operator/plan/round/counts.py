"""The step every round ends with: the pod counts, the selector and the generation."""

from __future__ import annotations

from ...api.models import ReplicaStatus
from ..manifests import JOB_LABEL, ROLE_LABEL, WORKER
from ..pods import PodState
from ..types import Plan
from .state import Outcome, Round
from .status import StatusChange


def counts(r: Round, planned: Plan) -> Outcome:
    """The workers (and ps) as they will be once ``planned`` is performed; the label
    selector of the scale subresource; the generation this status answers.

    Sets: status.workers, ps, selector, observedGeneration."""
    deleted = set(planned.delete) | set(planned.delete_gracefully)
    live = [p for p in r.workers if p.alive and p.name not in deleted]
    created = sum(1 for o in planned.create if o["metadata"]["labels"][ROLE_LABEL] == WORKER)
    change = StatusChange(
        observed_generation=r.generation,
        selector=f"{JOB_LABEL}={r.meta['name']},{ROLE_LABEL}={WORKER}",
        workers=ReplicaStatus(
            desired=r.spec.workers.replicas,
            active=len(live) + created,
            ready=sum(1 for p in live if p.state == PodState.READY),
            succeeded=sum(1 for p in r.workers if p.state == PodState.SUCCEEDED),
            failed=sum(1 for p in r.workers if p.state == PodState.FAILED)))
    if r.spec.ps is not None:
        # Ready servers are those below the count: one past it is leaving (a shrink).
        wanted = r.spec.ps.replicas
        change["ps"] = ReplicaStatus(desired=wanted,
                                     active=sum(1 for p in r.ps if p.alive),
                                     ready=sum(1 for p in r.ps if p.state == PodState.READY
                                               and p.index < wanted))
    return Outcome(status=change)
