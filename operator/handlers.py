"""kopf registration: watches kept as indices, one reconcile daemon per job.

kopf owns the loop's life: it starts a daemon for every TrainingJob it sees, stops it
when the job is deleted (the daemon's finalizer is what lets kopf stop it before the
job is gone) and restarts it with its own backoff when a round fails. Rounds of one
job never overlap because the daemon runs them one after another. Pod, report and job
events only wake the daemon; the round itself reads everything from kopf's indices,
so it makes no LIST and no GET (see :mod:`ringwright.operator.observe.cache`).
"""

from __future__ import annotations

import asyncio
import copy
import logging
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any

import kopf

from ringwright.kube import ApiError, KubeClient
from ringwright.objects import Obj
from ringwright.world import reports_configmap_name, world_configmap_name

from .api.base import GROUP, VERSION
from .apply.events import EventRecorder
from .apply.executor import MAX_IN_FLIGHT, Applier
from .apply.kueue import perform_queue
from .apply.refusals import RefusalBackoff
from .metrics import OperatorMetrics
from .observe.cache import (
    FLAVORS,
    INDICES,
    KUEUE_INDICES,
    NODES,
    POD_SLOTS,
    PODS_BY_JOB,
    POLICIES,
    PRIORITIES,
    WORKLOAD_PRIORITIES,
    WORKLOADS,
    IndexCache,
    Written,
    newer,
)
from .observe.drift import SCAFFOLD_KINDS, Watched, record
from .observe.job import observe
from .observe.kueue import with_queue
from .observe.ledger import CapacityLedger, frees_room, pod_slots, touched_nodes
from .observe.nodes import NodeInformer
from .observe.ownership import owned_by
from .plan.kueue import API_VERSION as KUEUE_API_VERSION
from .plan.manifests import JOB_LABEL
from .plan.placement.placer import place
from .plan.reconcile import plan
from .settings import OperatorSettings

log = logging.getLogger("ringwright.operator")

FINALIZER = "ringwright.dev/operator"


@dataclass
class OperatorContext:
    """What the handlers share, passed in through kopf's memo (no module globals)."""

    kube: KubeClient
    settings: OperatorSettings
    clock: Callable[[], float] = time.time
    ledger: CapacityLedger = field(default_factory=CapacityLedger)
    written: Written = field(default_factory=Written)
    wakers: dict[tuple[str, str], asyncio.Event] = field(default_factory=dict)
    """Each running daemon's wake-up call, so events for its job can cut its sleep short."""
    pool: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(MAX_IN_FLIGHT, "ringwright-create"))
    placement_lock: threading.Lock = field(default_factory=threading.Lock)
    metrics: OperatorMetrics = field(default_factory=OperatorMetrics)
    awaiting_room: set[tuple[str, str]] = field(default_factory=set)
    """Jobs whose last round found no room; rounds (threads) change it under ``_room_lock``."""
    _room_lock: threading.Lock = field(default_factory=threading.Lock)
    refusal_backoff: RefusalBackoff = field(init=False)
    nodes: NodeInformer = field(init=False)

    def __post_init__(self) -> None:
        self.nodes = NodeInformer(self.kube, self.ledger.mark)
        self.refusal_backoff = RefusalBackoff(self.settings.backoff_base_seconds,
                                              self.settings.backoff_cap_seconds)
        self.events = EventRecorder(self.kube, self.clock)
        self.applier = Applier(self.kube, self.clock, pool=self.pool, events=self.events,
                               ledger=self.ledger, written=self.written,
                               settings=self.settings)

    def wake(self, namespace: str, name: str) -> None:
        """Cut the sleep of the job's daemon short (nothing when it has none yet)."""
        waker = self.wakers.get((namespace, name))
        if waker is not None:
            waker.set()

    def waits_for_room(self, key: tuple[str, str], waits: bool) -> None:
        """Record whether the job's last round found no room for what it needs."""
        with self._room_lock:
            if waits:
                self.awaiting_room.add(key)
            else:
                self.awaiting_room.discard(key)

    def room_freed(self) -> None:
        """Wake every job waiting for room: another job's pod gave some back, and the
        waiting job must not sleep until its resync (ten minutes under Kueue's tests)."""
        with self._room_lock:
            waiting = tuple(self.awaiting_room)
        for key in waiting:
            self.wake(*key)


class NoDiffBase(kopf.DiffBaseStorage):
    """No diff base: kopf keeps one (a deep copy of each watched object on each event, pods
    and nodes included) only for on.create/update/delete handlers to diff against, and
    this operator has none: a job's daemon reads the indices instead. An empty essence
    every time, so nothing ever looks changed."""

    def build(self, *, body: kopf.Body, extra_fields: Any = None) -> kopf.BodyEssence:
        """The same empty essence for every object."""
        return kopf.BodyEssence()

    def fetch(self, *, body: kopf.Body) -> kopf.BodyEssence | None:
        """The same empty essence: never a difference."""
        return kopf.BodyEssence()

    def store(self, *, body: kopf.Body, patch: kopf.Patch, essence: kopf.BodyEssence) -> None:
        """Nothing is kept (nor written to the object)."""


def reconcile_once(ctx: OperatorContext, cache: IndexCache, job: Obj,
                   force_scaffold: bool, scaffold_missing: bool = False) -> float | None:
    """One observe -> plan -> apply round; returns when to run again (None: job deleted).

    The scaffold is ensured every round (only drifted objects are sent), and applied
    whole when ``force_scaffold``; ``scaffold_missing`` says it does not exist yet (so a
    refusal of it is a FailedCreate).

    A write the API refuses does not end the round (see :mod:`.refusals`): it holds the
    job's creates, and its scaffold, for a backoff that grows per refusal.
    """
    meta = job["metadata"]
    key = (meta.get("namespace", ""), meta["name"])
    hold = ctx.refusal_backoff.hold_until(key, ctx.clock())
    with ctx.metrics.round():
        refusals = (ctx.applier.ensure_scaffold(job, cache.scaffold_object, force_scaffold,
                                                first=scaffold_missing)
                    if hold is None else [])
        # Plans of different jobs read the same free room: one at a time, and each
        # reserves what it will create before the next one looks (no two gangs on the
        # same GPUs).
        with ctx.placement_lock:
            observed = replace(with_queue(observe(cache, job), cache) if ctx.settings.kueue
                               else observe(cache, job), hold_creates_until=hold)
            with ctx.metrics.planning():
                decided = plan(observed, ctx.settings, ctx.clock(), place)
            for pod in decided.create:
                ctx.ledger.reserve(pod)
        refusals = ctx.applier.perform(observed.job, decided, refusals,
                                       attempted=hold is None)
        perform_queue(ctx.kube, observed.job, decided, ctx.clock())
    ctx.metrics.refused(key[0], refusals)
    if refusals:
        hold = ctx.refusal_backoff.refused(key, ctx.clock())
    elif hold is None:
        ctx.refusal_backoff.accepted(key)
    ctx.metrics.applied(key[0], key[1], observed, decided)
    ctx.waits_for_room(key, decided.waits_for_room and not decided.delete_job)
    if decided.delete_job:
        return None
    delay: float = ctx.settings.resync_seconds
    if decided.requeue_after is not None:
        delay = min(decided.requeue_after, delay)
    if hold is not None:
        delay = min(delay, max(hold - ctx.clock(), 0.05))
    return delay


async def _sleep(waker: asyncio.Event, stopped: asyncio.Event | kopf.DaemonStopped,
                 seconds: float) -> None:
    waits = {asyncio.ensure_future(waker.wait()), asyncio.ensure_future(stopped.wait())}
    _, pending = await asyncio.wait(waits, timeout=seconds,
                                    return_when=asyncio.FIRST_COMPLETED)
    for task in pending:
        task.cancel()


async def wait_for_round(waker: asyncio.Event, stopped: asyncio.Event | kopf.DaemonStopped,
                         seconds: float, not_before: float) -> None:
    """Sleep until ``waker`` is set or ``seconds`` pass, then on until ``not_before`` (the
    event loop's clock); ``stopped`` ends both waits.

    The second wait spaces a job's rounds: a burst of pod events (256 pods turning Ready)
    is taken a batch per round, as Kubernetes' Job controller batches pod updates, instead
    of one round and one status write per event, each of them CPU the API server and the
    kubelets need at that moment.
    """
    await _sleep(waker, stopped, seconds)
    rest = not_before - asyncio.get_running_loop().time()
    if rest > 0 and not stopped.is_set():
        await _sleep(asyncio.Event(), stopped, rest)


def _plain(body: Mapping[str, Any]) -> Obj:
    """A private copy of a watched object (kopf's bodies are live views)."""
    return copy.deepcopy(dict(body))


def _watch_scaffold(registry: kopf.OperatorRegistry, kind: str, w: Watched) -> None:
    """Index the operator's objects of one scaffold kind, and wake their job when one
    changes (the reports map brings reports; any other change may be drift to repair)."""
    resource = (f"{w.group}/{w.version}" if w.group else w.version, w.plural)

    # Also the job_configmaps index the rounds read worlds and reports from.
    @kopf.index(*resource, labels={JOB_LABEL: kopf.PRESENT}, registry=registry, id=w.index)
    async def scaffold_index(namespace: str | None, name: str, body: kopf.Body,
                             **_: Any) -> dict[tuple[str, str], Obj]:
        return {(namespace or "", name): record(body)}

    @kopf.on.event(*resource, labels={JOB_LABEL: kopf.PRESENT}, registry=registry,
                   id=f"{w.index}_changed")
    async def scaffold_changed(namespace: str | None, name: str, labels: Mapping[str, str],
                               body: kopf.Body, type: str | None, memo: Any,
                               **_: Any) -> None:
        ctx: OperatorContext = memo["ctx"]
        job = labels[JOB_LABEL]
        # A deletion drops our copy, which must not hide that the object is gone.
        outdated = ctx.written.outdated_by(kind, dict(body), type == "DELETED")
        # The world wakes its job only when someone else changed or deleted it (our own
        # publication needs no round); any other scaffold change always does.
        if outdated or name != world_configmap_name(job):
            ctx.wake(namespace or "", job)


def _watch_kueue(registry: kopf.OperatorRegistry) -> None:
    """Index the Workloads ringwright published, every ResourceFlavor's node labels and
    every WorkloadPriorityClass's value; a Workload's change (admitted, evicted) wakes
    its job."""
    group, version = KUEUE_API_VERSION.split("/")

    @kopf.index(group, version, "workloads", labels={JOB_LABEL: kopf.PRESENT},
                registry=registry, id=WORKLOADS)
    def workloads_by_job(namespace: str | None, labels: Mapping[str, str], body: kopf.Body,
                         **_: Any) -> dict[tuple[str, str], Obj]:
        return {(namespace or "", labels[JOB_LABEL]): _plain(body)}

    @kopf.index(group, version, "workloadpriorityclasses", registry=registry,
                id=WORKLOAD_PRIORITIES)
    def workload_priorities(name: str, body: kopf.Body, **_: Any) -> dict[str, int]:
        return {name: int(body.get("value") or 0)}

    @kopf.index(group, version, "resourceflavors", registry=registry, id=FLAVORS)
    def flavor_labels(name: str, spec: kopf.Spec, **_: Any) -> dict[str, dict[str, str]]:
        return {name: dict(spec.get("nodeLabels") or {})}

    @kopf.on.event(group, version, "workloads", labels={JOB_LABEL: kopf.PRESENT},
                   registry=registry)
    async def workload_changed(namespace: str | None, labels: Mapping[str, str], memo: Any,
                               **_: Any) -> None:
        memo["ctx"].wake(namespace or "", labels[JOB_LABEL])


def _current(watched: Obj, written: Obj | None) -> Obj:
    """The watched job, or our status write when the watch lags behind it; a write to an
    earlier job of the same name (another UID) is not this job's."""
    uid = watched.get("metadata", {}).get("uid")
    if written is None or written.get("metadata", {}).get("uid") != uid:
        return watched
    job = newer(watched, written)
    assert job is not None
    return job


def register(registry: kopf.OperatorRegistry, kueue: bool = False) -> None:
    """Register every handler on ``registry`` (kept explicit so tests can build their own);
    ``kueue`` adds the watches of Kueue's Workloads and ResourceFlavors."""

    @kopf.on.startup(registry=registry)
    def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
        settings.posting.level = logging.WARNING
        settings.watching.server_timeout = 300
        settings.persistence.finalizer = FINALIZER
        settings.persistence.diffbase_storage = NoDiffBase()
        # Only the ConfigMaps the operator made (world, reports) are watched: the label
        # selector is sent to the API server, so other ConfigMaps never reach us.
        # Same for the rest of the scaffold, watched to see drift without asking.
        for w in SCAFFOLD_KINDS.values():
            settings.watching.label_selectors[(w.group, w.plural) if w.group else w.plural] = (
                JOB_LABEL)

    @kopf.on.startup(registry=registry)
    def watch_nodes(memo: Any, **_: Any) -> None:
        memo["ctx"].nodes.start()

    @kopf.on.cleanup(registry=registry)
    def stop_watching_nodes(memo: Any, **_: Any) -> None:
        memo["ctx"].nodes.stop()

    # -- indices: what rounds read instead of asking the API ----------------------------
    # (Nodes are not among them: see observe/nodes.py.)
    # Coroutines, though they never wait: kopf runs a plain function in a thread pool,
    # a hand-off per object per event that cost more than the indexing itself.

    @kopf.index("pods", labels={JOB_LABEL: kopf.PRESENT}, registry=registry, id=PODS_BY_JOB)
    async def pods_by_job(namespace: str | None, labels: Mapping[str, str], body: kopf.Body,
                          **_: Any) -> dict[tuple[str, str], Obj]:
        # The event's own objects, not a deep copy per pod per event: kopf parses every
        # event into fresh dicts and never changes them afterwards (a live body is
        # pointed at the next event's dicts), and rounds only read them.
        return {(namespace or "", labels[JOB_LABEL]): dict(body)}

    @kopf.index("pods", registry=registry, id=POD_SLOTS)
    async def pod_slots_index(body: kopf.Body, **_: Any) -> dict[str, Any]:
        return dict(pod_slots(body))

    @kopf.index(GROUP, VERSION, "schedulingpolicies", registry=registry, id=POLICIES)
    async def scheduling_policies(name: str, spec: kopf.Spec, **_: Any) -> dict[str, Obj]:
        return {name: copy.deepcopy(dict(spec))}

    @kopf.index("scheduling.k8s.io", "v1", "priorityclasses", registry=registry,
                id=PRIORITIES)
    async def priority_classes(name: str, body: kopf.Body, **_: Any) -> dict[str, int]:
        return {name: int(body.get("value") or 0)}

    # -- events: keep the ledger current and wake the job concerned ---------------------

    @kopf.on.event("pods", registry=registry)
    async def pod_changed(namespace: str | None, labels: Mapping[str, str], body: kopf.Body,
                          type: str | None, memo: Any, **_: Any) -> None:
        ctx: OperatorContext = memo["ctx"]
        if type != "DELETED" and pod_slots(body):
            ctx.ledger.release(body)  # the pods index counts it from now on
        ctx.ledger.mark(touched_nodes(body))
        if JOB_LABEL in labels:
            ctx.wake(namespace or "", labels[JOB_LABEL])
        if frees_room(body, type):
            ctx.room_freed()

    for kind, w in SCAFFOLD_KINDS.items():
        _watch_scaffold(registry, kind, w)
    if kueue:
        _watch_kueue(registry)

    @kopf.on.event(GROUP, VERSION, "trainingjobs", registry=registry)
    async def job_changed(namespace: str | None, name: str, memo: Any, **_: Any) -> None:
        memo["ctx"].wake(namespace or "", name)

    # -- the one reconcile path per job -------------------------------------------------

    @kopf.daemon(GROUP, VERSION, "trainingjobs", registry=registry, backoff=5.0,
                 cancellation_backoff=0.0, cancellation_timeout=10.0)
    async def reconcile_job(namespace: str | None, name: str, body: kopf.Body,
                            stopped: kopf.DaemonStopped, memo: Any, **kwargs: Any) -> None:
        ctx: OperatorContext = memo["ctx"]
        ns = namespace or ""
        cache = IndexCache({**{index: kwargs[index] for index in (*INDICES, *KUEUE_INDICES)
                               if index in kwargs}, NODES: ctx.nodes.records},
                           ctx.ledger, ctx.written)
        while not ctx.nodes.synced.is_set() and not stopped:
            await asyncio.sleep(0.1)  # the nodes' first list is not in yet
        waker = ctx.wakers.setdefault((ns, name), asyncio.Event())
        scaffolded_at: float | None = None
        try:
            while not stopped:
                waker.clear()
                # The watched body, or our own status write when the watch lags behind it.
                job = _current(_plain(body), ctx.written.get("TrainingJob", ns, name))
                now = ctx.clock()
                reports = cache.configmap(ns, reports_configmap_name(name))
                missing = not owned_by(reports, job["metadata"].get("uid", ""))
                scaffold = (scaffolded_at is None or missing
                            or now - scaffolded_at >= ctx.settings.scaffold_resync_seconds)
                # A round within a refusal backoff skips the scaffold: it stays due.
                held = ctx.refusal_backoff.hold_until((ns, name), now) is not None
                not_before = (asyncio.get_running_loop().time()
                              + ctx.settings.round_spacing_seconds)
                try:
                    delay = await asyncio.to_thread(reconcile_once, ctx, cache, job, scaffold,
                                                    missing)
                except ApiError as err:
                    if "NamespaceTerminating" in err.causes:
                        # The namespace goes, and the job with it: nothing to do but wait.
                        await _sleep(waker, stopped, ctx.settings.resync_seconds)
                        continue
                    # Conflicts and transient API errors: kopf runs the daemon again soon.
                    ctx.metrics.api_error(err.verb, err.status)
                    raise kopf.TemporaryError(f"reconcile {ns}/{name}: {err}", delay=1.0) \
                        from err
                if scaffold and not held:
                    scaffolded_at = now
                if delay is None:
                    await stopped.wait()
                    return
                await wait_for_round(waker, stopped, delay, not_before)
        finally:
            if ctx.wakers.get((ns, name)) is waker:
                del ctx.wakers[(ns, name)]
                ctx.waits_for_room((ns, name), False)
                if body.get("metadata", {}).get("deletionTimestamp") is not None:
                    ctx.written.forget_job(ns, name)
                    ctx.metrics.forget(ns, name)
                    ctx.refusal_backoff.accepted((ns, name))
