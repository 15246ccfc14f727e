"""The apply step: perform a :class:`Plan` against the API, and nothing else.

Every write goes out under one field manager (``ringwright``). Whole objects the
operator owns (scaffold, world, status) are written by server-side apply, so what we
stop sending is removed and drift is repaired by the next apply. Pods are created with
POST, concurrently in a slow-start window: a replacement reuses its predecessor's name,
and a create (unlike an apply) never touches a pod that is still terminating.

Order matters for planned changes: the new world is published before leaving pods
are deleted, so members learn they are out before their pods go away.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Executor, Future, wait
from dataclasses import dataclass, replace
from functools import partial
from typing import Generic, TypeVar

from ringwright.kube import ApiError, KubeClient, api_path
from ringwright.objects import Obj
from ringwright.world import reports_configmap_name, world_configmap_name

from ..api.base import API_VERSION
from ..api.models import TrainingJobStatus
from ..observe.cache import Written
from ..observe.drift import drifted, record
from ..observe.job import job_path
from ..observe.ledger import CapacityLedger
from ..plan.isolation import (
    join_token_secret,
    join_token_secret_name,
    network_policy,
    new_token,
    with_report_key,
)
from ..plan.manifests import LEAVING_ANNOTATION, scaffold, world_configmap
from ..plan.reconcile import Event, Plan
from ..settings import OperatorSettings
from .events import EventRecorder
from .refusals import Refused, is_refusal, refusal_conditions, refused

log = logging.getLogger("ringwright.operator.apply.executor")

_PLURALS = {"ServiceAccount": "serviceaccounts", "Role": "roles", "RoleBinding": "rolebindings",
            "Service": "services", "ConfigMap": "configmaps", "Pod": "pods",
            "Secret": "secrets", "NetworkPolicy": "networkpolicies"}

MAX_IN_FLIGHT = 64
"""Most concurrent creates of the slow-start window (the Job controller's batch cap)."""

T = TypeVar("T")


def _object_path(obj: Obj) -> str:
    meta = obj["metadata"]
    return api_path(obj["apiVersion"], _PLURALS[obj["kind"]], meta["namespace"], meta["name"])


@dataclass(frozen=True)
class Refusal(Generic[T]):
    """A create of the slow-start window that the API server refused, with its error."""

    item: T
    error: ApiError


def slow_start(items: Sequence[T], call: Callable[[T], None], pool: Executor,
               cap: int = MAX_IN_FLIGHT) -> tuple[int, Refusal[T] | None]:
    """Run ``call`` on ``items`` concurrently, as TCP's slow start sends: one at first,
    then every success lets two more go (the window doubles each round trip) up to
    ``cap`` in flight.

    A window, not batches: a slow call holds back no other, where a batch waited for its
    slowest call before the next batch went out. A refusal (``ApiError``) stops the
    sending (a quota or admission problem refuses every further create just the same);
    calls already in flight finish. Returns how many calls succeeded and the refusal
    of the earliest item refused.
    """
    queue = iter(enumerate(items))
    in_flight: dict[Future[ApiError | None], tuple[int, T]] = {}
    window, done = 1, 0
    refusal: tuple[int, Refusal[T]] | None = None
    while True:
        while refusal is None and len(in_flight) < window:
            nxt = next(queue, None)
            if nxt is None:
                break
            in_flight[pool.submit(_attempt, call, nxt[1])] = nxt
        if not in_flight:
            break
        finished, _ = wait(in_flight, return_when=FIRST_COMPLETED)
        for future in finished:
            index, item = in_flight.pop(future)
            error = future.result()
            if error is None:
                done += 1
                window = min(window + 1, cap)
            elif refusal is None or index < refusal[0]:
                refusal = (index, Refusal(item, error))
    return done, None if refusal is None else refusal[1]


def _attempt(call: Callable[[T], None], item: T) -> ApiError | None:
    try:
        call(item)
    except ApiError as err:
        return err
    return None


_PUBLISHED = ("phase", "world", "startTime", "lastRecovery", "candidate")
"""Status fields a round sets because it publishes a world."""


def unpublished(status: Obj, before: Obj, events: list[Event]) -> tuple[Obj, list[Event]]:
    """The status and events of a round whose world the API refused: what the world's
    publication would have changed stays as it was, and its events are not told."""
    out = dict(status)
    for key in _PUBLISHED:
        if key in before:
            out[key] = before[key]
        else:
            out.pop(key, None)
    told = [e for e in events if e.reason != "WorldPublished"
            and not (e.reason == "Running" and status.get("phase") != before.get("phase"))]
    return out, told


class Applier:
    """Performs plans for jobs; the only operator code that writes to the API."""

    def __init__(self, kube: KubeClient, clock: Callable[[], float], *, pool: Executor,
                 events: EventRecorder, ledger: CapacityLedger, written: Written,
                 settings: OperatorSettings | None = None) -> None:
        self.kube, self.clock, self.pool = kube, clock, pool
        self.events, self.ledger, self.written = events, ledger, written
        self.settings = settings or OperatorSettings()
        self._tokens: set[str] = set()
        """Jobs (by uid) whose join-token Secret is known to exist."""

    def ensure_scaffold(self, job: Obj, seen_as: Callable[[str, str, str], Obj | None],
                        force: bool = False, first: bool = False) -> list[Refused]:
        """Apply those of the job's scaffold objects that drifted from what the watch cache
        holds (``seen_as(kind, namespace, name)``, e.g. :meth:`Cache.scaffold_object`; all
        of them with ``force``).

        Server-side apply is idempotent and takes back every field we own, so one apply
        repairs an edit or recreates a deleted object. The reports map's ``data`` is not
        in the applied object, so pods' reports are left alone. An object that still
        differs right after our apply (another manager's list entries, say) is not
        applied again until it changes: applying cannot change it. ``first``: the objects
        are being made (a refusal is a FailedCreate). Returns the refusals; every object
        is tried, all at once.
        """
        ns = job["metadata"]["namespace"]
        writes: list[tuple[str, str, str, Callable[[], object]]] = [
            ("create", "Secret", join_token_secret_name(job["metadata"]["name"]),
             partial(self._ensure_join_token, job))]
        objects = scaffold(job)
        if self.settings.network_policy:
            objects.append(network_policy(job, self.settings.operator_namespace))
        for obj in objects:
            kind, name = obj["kind"], obj["metadata"]["name"]
            seen = seen_as(kind, ns, name)
            if not force and (not drifted(obj, seen) or (
                    seen is not None and self.written.answered(kind, seen, obj))):
                continue
            if seen is not None and not force:
                log.info("scaffold %s %s/%s drifted; applying it again", kind, ns, name)

            def write(obj: Obj = obj, kind: str = kind) -> None:
                self.written.put(kind, record(self.kube.apply(_object_path(obj), obj)),
                                 sent=obj)
            writes.append(("create" if first or seen is None else "update", kind, name, write))

        def attempt(verb: str, kind: str, name: str, write: Callable[[], object]
                    ) -> list[Refused]:
            out: list[Refused] = []
            self._try(out, verb, kind, name, write)
            return out
        # All at once: none depends on another, and a new job's first pods wait for
        # them (a round trip each, one after another, before).
        return [r for rs in self.pool.map(lambda w: attempt(*w), writes) for r in rs]

    def _ensure_join_token(self, job: Obj) -> None:
        """Create the job's join-token Secret once, with a fresh token.

        Never applied: a second apply would change the token under running members.
        A 409 means it exists; the operator never reads it back.
        """
        uid = job["metadata"]["uid"]
        if uid in self._tokens:
            return
        secret = join_token_secret(job, new_token())
        meta = secret["metadata"]
        try:
            self.kube.create(api_path("v1", "secrets", meta["namespace"]), secret)
        except ApiError as err:
            if err.status != 409:
                raise
        self._tokens.add(uid)

    def perform(self, job: Obj, plan: Plan, refusals: list[Refused] | None = None, *,
                attempted: bool = True) -> list[Refused]:
        """Create, mark, publish, delete, events, status: in that order.

        A write the API refuses is added to ``refusals`` (the scaffold's, passed in) and
        the rest still happens; the refusals become events and the ``WritesAccepted``
        condition. ``attempted`` is False while the job's creates are held back after a
        refusal (the condition then stays). Returns the refusals.
        """
        ns, name = job["metadata"]["namespace"], job["metadata"]["name"]
        status = dict(plan.status)
        refusals = list(refusals or [])
        refusal = self._create(ns, plan.create)
        if refusal is not None:
            refusals.append(refused("create", "Pod", refusal.item["metadata"]["name"],
                                    refusal.error))
        now = self.clock()
        leaving: Obj = {"metadata": {"annotations": {LEAVING_ANNOTATION: f"{now}"}}}
        for pod_name in plan.mark_leaving:
            path = api_path("v1", "pods", ns, pod_name)
            self._try(refusals, "update", "Pod", pod_name,
                      partial(self.kube.merge_patch, path, leaving))
        if plan.world is not None:
            world = plan.world

            def publish() -> None:
                self.written.put("ConfigMap", self._publish(job, plan))
                log.info("published world %s/%s generation=%d size=%d", ns, name, world.generation,
                         world.size)
            before = len(refusals)
            self._try(refusals, "update" if plan.world_version else "create", "ConfigMap",
                      world_configmap_name(name), publish)
            if len(refusals) > before:
                status, events = unpublished(status, job.get("status") or {}, plan.events)
                plan = replace(plan, events=events)
        for pod_name in plan.delete:
            path = api_path("v1", "pods", ns, pod_name)
            self._try(refusals, "delete", "Pod", pod_name, partial(self.kube.delete, path, grace=0))
        for pod_name, uid in plan.delete_left_behind:
            path = api_path("v1", "pods", ns, pod_name)
            self._try(refusals, "delete", "Pod", pod_name,
                      partial(self.kube.delete, path, grace=0, precondition_uid=uid))
        for pod_name in plan.delete_gracefully:
            path = api_path("v1", "pods", ns, pod_name)
            self._try(refusals, "delete", "Pod", pod_name, partial(self.kube.delete, path))
        if plan.clear_reports:
            reports = reports_configmap_name(name)
            self._try(refusals, "update", "ConfigMap", reports, lambda: self.kube.merge_patch(
                api_path("v1", "configmaps", ns, reports),
                {"data": dict.fromkeys(plan.clear_reports)}))
        # Events before status: whoever sees the new status finds its events recorded.
        for event in plan.events:
            self.events.record(job, event.type, event.reason, event.message)
        for r in refusals:
            self.events.record(job, "Warning", r.reason, r.describe())
        status["conditions"] = refusal_conditions(
            list(status.get("conditions") or []), refusals, attempted, now,
            int(job["metadata"].get("generation", 0)))
        if status:
            try:
                self.apply_status(job, status)
            except ApiError as err:
                if not is_refusal(err):
                    raise
                self.events.record(job, "Warning", "FailedUpdate",
                                   f"update TrainingJob status {name}: {err.message or err}")
                refusals.append(refused("update", "TrainingJob", name, err))
        if plan.delete_job:
            log.info("deleting finished job %s/%s (ttlSecondsAfterFinished)", ns, name)
            self.kube.delete(job_path(ns, name))
        return refusals

    def _try(self, refusals: list[Refused], verb: str, kind: str, name: str,
             write: Callable[[], object]) -> None:
        """Run one write; a refusal is noted in ``refusals``, anything else propagates."""
        try:
            write()
        except ApiError as err:
            if not is_refusal(err):
                raise
            log.warning("%s %s %s refused: %s", verb, kind, name, err)
            refusals.append(refused(verb, kind, name, err))

    def _publish(self, job: Obj, plan: Plan) -> Obj:
        """Write the world over the version it was decided from, or create it.

        A concurrent writer's world makes this fail with 409 Conflict (or AlreadyExists):
        the round then ends and the next one re-reads, so one generation never goes out with
        two memberships.
        """
        assert plan.world is not None
        cm = world_configmap(job, plan.world.to_json(), plan.world.generation, self.clock())
        if not plan.world_version:
            return self.kube.create(api_path("v1", "configmaps", cm["metadata"]["namespace"]),
                                    cm)
        # A merge patch, not an apply: it replaces lists whole, so a world an earlier job of
        # the same name left (its controller reference written by a create, which an apply
        # would keep beside ours) changes owner; its finalizers, which are not ours, stay.
        # The resourceVersion in the patch is the precondition.
        cm["metadata"]["resourceVersion"] = plan.world_version
        return self.kube.merge_patch(_object_path(cm), cm)

    def apply_status(self, job: Obj, status: Obj) -> None:
        """Server-side apply of the whole status, checked against the typed model first;
        nothing is sent when it equals the current status."""
        meta = job["metadata"]
        typed = TrainingJobStatus.model_validate(status).to_wire()
        current = TrainingJobStatus.model_validate(job.get("status") or {}).to_wire()
        if typed == current:
            return
        path = job_path(meta["namespace"], meta["name"], "status")
        emptied = emptied_maps(current, typed)
        if emptied:
            # An apply cannot empty a map it owns: the API server keeps the emptied map as
            # null, which the schema refuses, and every later status write with it (seen:
            # containerRestarts after the one restarted pod was deleted). A merge patch
            # removes the map first; the apply then writes it afresh.
            self.kube.merge_patch(path, {"status": emptied})
        written = self.kube.apply(
            path,
            {"apiVersion": API_VERSION, "kind": "TrainingJob",
             "metadata": {"name": meta["name"], "namespace": meta["namespace"]},
             "status": typed})
        self.written.put("TrainingJob", written)

    def _create(self, ns: str, pods: list[Obj]) -> Refusal[Obj] | None:
        def create(pod: Obj) -> None:
            try:
                # A fresh report key per pod: random, so chosen here and not in the plan.
                self.kube.create(api_path("v1", "pods", ns), with_report_key(pod, new_token()))
            except ApiError as err:
                # Not created by this call: its room is not ours to hold. (409: an earlier
                # round made it, and the pods index counts that one.)
                self.ledger.release(pod)
                if err.status == 409:
                    return
                raise
            log.info("created pod %s/%s", ns, pod["metadata"]["name"])

        done, refusal = slow_start(pods, create, self.pool)
        if refusal is not None:
            for pod in pods:  # the ones never sent after the refusal
                self.ledger.release(pod)
            log.warning("pod creates in %s stopped after %d of %d: %s", ns, done, len(pods),
                        refusal.error)
        return refusal


def emptied_maps(before: Obj, after: Obj) -> Obj:
    """The maps with entries in ``before`` that are empty or gone in ``after``, nested as
    they are, each as ``None``: the JSON merge patch that removes them; {} when none."""
    patch: Obj = {}
    for key, old in before.items():
        if not isinstance(old, dict) or not old:
            continue
        new = after.get(key)
        if not new:
            patch[key] = None
        elif isinstance(new, dict):
            inner = emptied_maps(old, new)
            if inner:
                patch[key] = inner
    return patch
