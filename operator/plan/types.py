"""What one reconcile round reads and decides: ``Observed`` in, ``Plan`` out.

Data only: the planner (:mod:`ringwright.operator.plan.reconcile`) fills a ``Plan`` from an
``Observed``; the apply layer performs it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from ringwright.objects import Obj
from ringwright.world import MemberStats, Report, World

from ..api.models import TrainingJobSpec
from ..api.schedulingpolicy import SchedulingPolicySpec
from .placement.inventory import Inventory
from .pods import PodView


@dataclass(frozen=True)
class Placement:
    """Placement fragments for the new pods of each role.

    Fewer worker fragments than missing workers means room ran out; no fragments at
    all with a ``reason`` means nothing may be created (gang rule, policy limits).
    """

    workers: list[Obj] = field(default_factory=list)
    ps: list[Obj] = field(default_factory=list)
    reason: str = ""
    message: str = ""
    gpu_model: str = ""
    summary: str = ""


Placer = Callable[[TrainingJobSpec, SchedulingPolicySpec, Inventory, Sequence[PodView]],
                  Placement]
"""(spec, policy, inventory, the job's live pods) -> Placement for what is missing."""


@dataclass(frozen=True)
class Observed:
    """Everything the planner may look at, gathered by the observe step."""

    job: Obj
    pods: Sequence[Obj]
    world: World | None
    reports: dict[str, Report]
    policy: SchedulingPolicySpec | None
    inventory: Inventory
    hold_creates_until: float | None = None
    """Set while the API refuses the job's writes: no pod is created before then."""
    left_behind: Sequence[Obj] = ()
    """Pods of an earlier job of the same name, not yet garbage-collected."""
    policy_error: str = ""
    """Why the named SchedulingPolicy exists but cannot be used (``policy`` is None)."""
    world_annotation_generation: int = 0
    """The world ConfigMap's generation annotation (kept even when its document is unreadable)."""
    world_version: str = ""
    """The world ConfigMap's resourceVersion as read; empty when there is none."""
    world_published_at: float | None = None
    """When the job's world document was written (None: unknown, or no world)."""
    node_down_since: Mapping[str, float] = field(default_factory=dict)
    """The job's pods' nodes that are NotReady, and since when."""
    workload: Obj | None = None
    """The job's Kueue Workload (only for a job labelled with a queue name): the oldest
    slice of its chain not finished."""
    waiting_slice: Obj | None = None
    """A newer slice of the chain, asking for another number of workers, not admitted."""
    next_slice: int = 1
    """The number the chain's next slice gets."""
    flavor_labels: Mapping[str, Mapping[str, str]] = field(default_factory=dict)
    """Node labels of the ResourceFlavors the Workload was admitted with, by flavor."""
    workload_priority: int | None = None
    """Value of the WorkloadPriorityClass the job's label names (None: none, or missing)."""
    topology_surplus: frozenset[str] = frozenset()
    """Pods that stand outside the topology domains Kueue counted for them (or beyond a
    domain's count): on a scale-down they leave first."""
    stats: Mapping[str, MemberStats] = field(default_factory=dict)
    """The members' latest measurements, by pod (sealed by that pod)."""


@dataclass(frozen=True)
class Event:
    type: str
    reason: str
    message: str


@dataclass
class Plan:
    """What the apply layer must do, in order: create, mark, publish, delete, status."""

    create: list[Obj] = field(default_factory=list)
    mark_leaving: list[str] = field(default_factory=list)
    delete: list[str] = field(default_factory=list)
    delete_gracefully: list[str] = field(default_factory=list)
    """Pods deleted with their own terminationGracePeriodSeconds (SIGTERM, checkpoint)."""
    delete_left_behind: list[tuple[str, str]] = field(default_factory=list)
    """(name, uid) of pods an earlier job of the same name left: deleted by UID only."""
    clear_reports: list[str] = field(default_factory=list)
    world: World | None = None
    world_version: str = ""
    """Write ``world`` only over this resourceVersion (empty: only if none exists)."""
    status: Obj = field(default_factory=dict)
    """The job's status in its wire form (camelCase, unset optionals left out), made once
    from the round's typed ``TrainingJobStatus`` when the round ends."""
    events: list[Event] = field(default_factory=list)
    requeue_after: float | None = None
    delete_job: bool = False
    workload: Obj | None = None
    """The Kueue Workload (or slice of it) to create."""
    workload_delete: list[str] = field(default_factory=list)
    """Slices not admitted that ask for a number of workers the job no longer wants."""
    workload_resize: Obj | None = None
    """A merge patch of one slice's pod sets (``metadata.name`` names it): fewer or more
    workers asked for."""
    workload_finished: str = ""
    """Why the job ended: its Workload slices are marked Finished, which releases quota."""
    finish_workloads: list[str] = field(default_factory=list)
    """The slices marked Finished with ``workload_finished``."""
    workload_requeue: Obj | None = None
    """A merge patch of the Workload's status (``metadata.name`` names it) that hands an
    evicted Workload back to the queue once the job's pods are gone (what Kueue's job
    integrations do)."""

    @property
    def waits_for_room(self) -> bool:
        """Whether the job waits for room (its Schedulable condition is False): a pod of
        any job that frees room, not only the resync, must bring its next round."""
        return any(c.get("type") == "Schedulable" and c.get("status") == "False"
                   for c in self.status.get("conditions") or ())

    def soon(self, seconds: float) -> None:
        """Ask to be run again within ``seconds``."""
        if self.requeue_after is None or seconds < self.requeue_after:
            self.requeue_after = max(seconds, 0.05)

