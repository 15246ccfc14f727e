"""Adapter from the reconcile round to the placement planner.

The round knows pods; the planner knows nodes. This turns the job's live pods into
a placement request, plans it, and returns whole pod-spec fragments per role.
"""

from __future__ import annotations

from collections.abc import Sequence

from ...api.models import TrainingJobSpec
from ...api.schedulingpolicy import SchedulingPolicySpec
from ..pods import PodView
from ..reconcile import Placement
from .fragments import pod_fragments
from .inventory import Inventory
from .planner import (
    Role,
    Unschedulable,
    placement_request,
    plan_placement,
)


def place(spec: TrainingJobSpec, policy: SchedulingPolicySpec, inventory: Inventory,
          live: Sequence[PodView]) -> Placement:
    """Placement for the pods ``spec`` wants beyond the ``live`` ones."""
    request = placement_request(
        spec, policy,
        current_workers=[p.node for p in live if p.role == Role.WORKER],
        current_ps=[p.node for p in live if p.role == Role.PS],
    )
    if isinstance(request, Unschedulable):
        return Placement(reason=request.reason, message=request.message)
    planned = plan_placement(request, inventory, policy)
    if isinstance(planned, Unschedulable):
        return Placement(reason=planned.reason, message=planned.message)
    return Placement(
        workers=pod_fragments(planned, Role.WORKER, spec, policy),
        ps=pod_fragments(planned, Role.PS, spec, policy),
        gpu_model=planned.gpu_model,
        summary=planned.summary,
    )
