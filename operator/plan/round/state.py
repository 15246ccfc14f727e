"""What the steps of a round read (:class:`Round`) and the form of what they decide
(:class:`Outcome`).

A step is a plain function: it takes the round, and the status or plan so far where it
reads them, and returns an :class:`Outcome`. It changes nothing itself; the draft
(:mod:`.draft`) records outcomes in the order ``plan()`` lists the steps.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from ringwright.objects import Obj
from ringwright.world import World

from ...api.models import JobPhase, TrainingJobSpec, TrainingJobStatus
from ...settings import OperatorSettings
from ..generations import GenerationsSeen, next_generation
from ..manifests import PS, WORKER
from ..pods import PodView, view
from ..types import Event, Observed, Placer
from .status import StatusChange


@dataclass(frozen=True)
class Round:
    """What every step reads: the observation, the settings, the clock and the job's
    spec and pods, fixed for the whole round."""

    obs: Observed
    settings: OperatorSettings
    now: float
    placer: Placer
    spec: TrainingJobSpec
    generation: int
    """The job's metadata.generation, which the status and its conditions answer."""
    workers: tuple[PodView, ...]
    ps: tuple[PodView, ...]

    @classmethod
    def of(cls, obs: Observed, settings: OperatorSettings, now: float,
           placer: Placer) -> Round:
        """The round for ``obs``: the spec parsed, the pods sorted by role."""
        views = [v for v in (view(p) for p in obs.pods) if v is not None]
        return cls(obs=obs, settings=settings, now=now, placer=placer,
                   spec=TrainingJobSpec.model_validate(obs.job["spec"]),
                   generation=int(obs.job["metadata"].get("generation", 0)),
                   workers=tuple(v for v in views if v.role == WORKER),
                   ps=tuple(v for v in views if v.role == PS))

    @property
    def job(self) -> Obj:
        """The TrainingJob as observed (its spec feeds the pod manifests)."""
        return self.obs.job

    @property
    def meta(self) -> Obj:
        """The job's metadata (name, namespace, uid, creationTimestamp)."""
        meta: Obj = self.obs.job["metadata"]
        return meta

    @property
    def pods(self) -> tuple[PodView, ...]:
        """Workers, then parameter servers."""
        return self.workers + self.ps


@dataclass(frozen=True)
class Move:
    """A phase transition a step asks for; the draft checks it against the lifecycle."""

    phase: JobPhase
    reason: str
    message: str


@dataclass(frozen=True)
class SetCondition:
    """A condition a step sets (True when ``ok``)."""

    type: str
    ok: bool
    reason: str
    message: str


@dataclass(frozen=True)
class Outcome:
    """What one step decided; a step fills only what it changes.

    The status changes through ``status`` (named fields), ``moves`` (the phase, its
    history, the completion time, a finished job's condition) and ``conditions``; the
    rest is the plan's, for the apply layer. Events are recorded before the moves' own.
    """

    status: StatusChange = field(default_factory=lambda: StatusChange())
    moves: tuple[Move, ...] = ()
    conditions: tuple[SetCondition, ...] = ()
    events: tuple[Event, ...] = ()
    create: tuple[Obj, ...] = ()
    mark_leaving: tuple[str, ...] = ()
    delete: tuple[str, ...] = ()
    delete_gracefully: tuple[str, ...] = ()
    delete_left_behind: tuple[tuple[str, str], ...] = ()
    clear_reports: tuple[str, ...] = ()
    out_of_world: tuple[str, ...] = ()
    """Pods kept but left out of the next world (they must ask to join again)."""
    world: World | None = None
    world_version: str = ""
    """The world ConfigMap's resourceVersion ``world`` is written over."""
    delete_job: bool = False
    requeue: float | None = None
    """Run the round again within this many seconds."""
    stop: bool = False
    """``plan()`` skips what it guards with this: the rest of the round, or for the gang
    timeout the resize."""
    finishing: bool = False
    """The work is done and pods are ending: nothing is replaced or published."""


NOTHING = Outcome()
"""The outcome of a step with nothing to do."""


def merged(*parts: Outcome) -> Outcome:
    """One outcome from the parts of a step, in order (a later world or status field wins;
    the earliest requeue stands)."""
    status = StatusChange()
    for part in parts:
        status.update(part.status)
    worlds = [p for p in parts if p.world is not None]
    return Outcome(
        status=status,
        moves=tuple(m for p in parts for m in p.moves),
        conditions=tuple(c for p in parts for c in p.conditions),
        events=tuple(e for p in parts for e in p.events),
        create=tuple(o for p in parts for o in p.create),
        mark_leaving=tuple(n for p in parts for n in p.mark_leaving),
        delete=tuple(n for p in parts for n in p.delete),
        delete_gracefully=tuple(n for p in parts for n in p.delete_gracefully),
        delete_left_behind=tuple(n for p in parts for n in p.delete_left_behind),
        clear_reports=tuple(n for p in parts for n in p.clear_reports),
        out_of_world=tuple(n for p in parts for n in p.out_of_world),
        world=worlds[-1].world if worlds else None,
        world_version=worlds[-1].world_version if worlds else "",
        delete_job=any(p.delete_job for p in parts),
        requeue=earliest(*(p.requeue for p in parts)),
        stop=any(p.stop for p in parts),
        finishing=any(p.finishing for p in parts))


def phase_after(status: TrainingJobStatus, parts: Sequence[Outcome]) -> JobPhase:
    """The job's phase once ``parts`` are recorded: where their last move leads."""
    moves = [m for p in parts for m in p.moves]
    return moves[-1].phase if moves else status.phase


def earliest(*waits: float | None) -> float | None:
    """The shortest of ``waits`` that are set; None when none is."""
    return min((w for w in waits if w is not None), default=None)


def event(reason: str, message: str, warning: bool = False) -> Event:
    """A Normal event, or a Warning."""
    return Event("Warning" if warning else "Normal", reason, message)


def generation_after(r: Round, status: TrainingJobStatus) -> int:
    """The next world's generation: above the document, its annotation and the status."""
    current = r.obs.world
    return next_generation(GenerationsSeen(document=current.generation if current else 0,
                                           annotation=r.obs.world_annotation_generation,
                                           status=status.world.generation))
