"""The apply step: perform a :class:`Plan` against the API, and nothing else.

Every write goes out under one field manager (``ringwright``). Whole objects the
operator owns (scaffold, world, status) are written by server-side apply, so what we
stop sending is removed and drift is repaired by the next apply. Pods are created with
POST, concurrently in slow-start batches: a replacement reuses its predecessor's name,
and a create (unlike an apply) never touches a pod that is still terminating.

Order matters for planned changes: the new world is published before leaving pods
are deleted, so members learn they are out before their pods go away.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Generic, TypeVar

from ringwright.kube import ApiError, KubeClient, Obj, api_path
from ringwright.operator.apibase import API_VERSION
from ringwright.operator.cache import Written
from ringwright.operator.conditions import set_condition
from ringwright.operator.events import EventRecorder
from ringwright.operator.ledger import CapacityLedger
from ringwright.operator.manifests import LEAVING_ANNOTATION, scaffold, world_configmap
from ringwright.operator.models import TrainingJobStatus
from ringwright.operator.observe import job_path
from ringwright.operator.reconcile import Plan
from ringwright.world import reports_configmap_name

log = logging.getLogger("ringwright.operator.apply")

_PLURALS = {"ServiceAccount": "serviceaccounts", "Role": "roles", "RoleBinding": "rolebindings",
            "Service": "services", "ConfigMap": "configmaps", "Pod": "pods"}

MAX_IN_FLIGHT = 64
"""Largest slow-start batch of concurrent creates (the Job controller's cap)."""

T = TypeVar("T")


def _object_path(obj: Obj) -> str:
    meta = obj["metadata"]
    return api_path(obj["apiVersion"], _PLURALS[obj["kind"]], meta["namespace"], meta["name"])


@dataclass(frozen=True)
class Refusal(Generic[T]):
    """A create the API server refused, with its reason."""

    item: T
    error: ApiError


def slow_start(items: Sequence[T], call: Callable[[T], None], pool: Executor,
               cap: int = MAX_IN_FLIGHT) -> tuple[int, Refusal[T] | None]:
    """Run ``call`` on ``items`` in concurrent batches of 1, 2, 4 … ``cap``.

    A batch that meets a refusal (``ApiError``) is the last one: a quota or admission
    problem refuses every further create just the same, so they are not sent. Returns
    how many calls succeeded and the first refusal.
    """
    done, size, start = 0, 1, 0
    while start < len(items):
        batch = items[start:start + size]
        refusal: Refusal[T] | None = None
        for item, outcome in zip(batch, pool.map(lambda i: _attempt(call, i), batch),
                                 strict=True):
            if outcome is None:
                done += 1
            elif refusal is None:
                refusal = Refusal(item, outcome)
        if refusal is not None:
            return done, refusal
        start += size
        size = min(size * 2, cap)
    return done, None


def _attempt(call: Callable[[T], None], item: T) -> ApiError | None:
    try:
        call(item)
    except ApiError as err:
        return err
    return None


class Applier:
    """Performs plans for jobs; the only operator code that writes to the API."""

    def __init__(self, kube: KubeClient, clock: Callable[[], float], *, pool: Executor,
                 events: EventRecorder, ledger: CapacityLedger, written: Written) -> None:
        self.kube, self.clock, self.pool = kube, clock, pool
        self.events, self.ledger, self.written = events, ledger, written

    def ensure_scaffold(self, job: Obj) -> None:
        """Apply the job's ServiceAccount, Role, RoleBinding, Service and reports map.

        Server-side apply is idempotent, so calling this again repairs drift; the reports
        map's ``data`` is not in the applied object, so pods' reports are left alone.
        """
        for obj in scaffold(job):
            written = self.kube.apply(_object_path(obj), obj)
            if obj["kind"] == "ConfigMap":
                self.written.put("ConfigMap", written)

    def perform(self, job: Obj, plan: Plan) -> None:
        """Create, mark, publish, delete, events, status: in that order."""
        ns, name = job["metadata"]["namespace"], job["metadata"]["name"]
        status = dict(plan.status)
        refusal = self._create(ns, plan.create)
        if refusal is not None:
            pod_name = refusal.item["metadata"]["name"]
            message = f"creating pod {pod_name}: {refusal.error.message or refusal.error}"
            self.events.record(job, "Warning", "CreateRefused", message)
            status["conditions"] = set_condition(
                list(status.get("conditions") or []), "PodsCreated", False,
                refusal.error.reason or "CreateRefused", message, self.clock(),
                int(job["metadata"].get("generation", 0)))
        now = self.clock()
        for pod_name in plan.mark_leaving:
            self.kube.merge_patch(api_path("v1", "pods", ns, pod_name),
                                  {"metadata": {"annotations": {LEAVING_ANNOTATION: f"{now}"}}})
        if plan.world is not None:
            self.written.put("ConfigMap", self._publish(job, plan))
            log.info("published world %s/%s epoch=%d size=%d", ns, name, plan.world.epoch,
                     plan.world.size)
        for pod_name in plan.delete:
            self.kube.delete(api_path("v1", "pods", ns, pod_name), grace=0)
        if plan.clear_reports:
            self.kube.merge_patch(
                api_path("v1", "configmaps", ns, reports_configmap_name(name)),
                {"data": dict.fromkeys(plan.clear_reports)})
        # Events before status: whoever sees the new status finds its events recorded.
        for event in plan.events:
            self.events.record(job, event.type, event.reason, event.message)
        if status:
            self.apply_status(job, status)
        if plan.delete_job:
            log.info("deleting finished job %s/%s (ttlSecondsAfterFinished)", ns, name)
            self.kube.delete(job_path(ns, name))

    def _publish(self, job: Obj, plan: Plan) -> Obj:
        """Write the world over the version it was decided from, or create it.

        A concurrent writer's world makes this fail with 409 Conflict (or AlreadyExists):
        the round then ends and the next one re-reads, so one epoch never goes out with
        two memberships.
        """
        assert plan.world is not None
        cm = world_configmap(job, plan.world.to_json(), plan.world.epoch)
        if not plan.world_version:
            return self.kube.create(api_path("v1", "configmaps", cm["metadata"]["namespace"]),
                                    cm)
        cm["metadata"]["resourceVersion"] = plan.world_version
        return self.kube.apply(_object_path(cm), cm)

    def apply_status(self, job: Obj, status: Obj) -> None:
        """Server-side apply of the whole status, checked against the typed model first;
        nothing is sent when it equals the current status."""
        meta = job["metadata"]
        typed = TrainingJobStatus.model_validate(status).to_wire()
        if typed == TrainingJobStatus.model_validate(job.get("status") or {}).to_wire():
            return
        written = self.kube.apply(
            job_path(meta["namespace"], meta["name"], "status"),
            {"apiVersion": API_VERSION, "kind": "TrainingJob",
             "metadata": {"name": meta["name"], "namespace": meta["namespace"]},
             "status": typed})
        self.written.put("TrainingJob", written)

    def _create(self, ns: str, pods: list[Obj]) -> Refusal[Obj] | None:
        def create(pod: Obj) -> None:
            try:
                self.kube.create(api_path("v1", "pods", ns), pod)
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
