"""The apply step: perform a :class:`Plan` against the API, and nothing else.

Order matters for planned changes: the new world is published before leaving pods
are deleted, so members learn they are out before their pods go away.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Callable

from ringwright.kube import ApiError, KubeClient, Obj, api_path
from ringwright.operator.conditions import rfc3339
from ringwright.operator.manifests import LEAVING_ANNOTATION, scaffold, world_configmap
from ringwright.operator.observe import job_path
from ringwright.operator.reconcile import Event, Plan
from ringwright.world import reports_configmap_name

log = logging.getLogger("ringwright.operator.apply")

COMPONENT = "ringwright-operator"

_PLURALS = {"ServiceAccount": "serviceaccounts", "Role": "roles", "RoleBinding": "rolebindings",
            "Service": "services", "ConfigMap": "configmaps", "Pod": "pods"}


def _object_path(obj: Obj) -> str:
    meta = obj["metadata"]
    return api_path(obj["apiVersion"], _PLURALS[obj["kind"]], meta["namespace"], meta["name"])


class Applier:
    """Performs plans for jobs; the only operator code that writes to the API."""

    def __init__(self, kube: KubeClient, clock: Callable[[], float]) -> None:
        self.kube = kube
        self.clock = clock
        self.instance = socket.gethostname()

    def ensure_scaffold(self, job: Obj) -> None:
        """Create the job's ServiceAccount, Role, RoleBinding, Service and reports map."""
        for obj in scaffold(job):
            try:
                self.kube.create(_object_path(obj).rsplit("/", 1)[0], obj)
            except ApiError as err:
                if err.status != 409:
                    raise

    def perform(self, job: Obj, plan: Plan) -> None:
        """Create, mark, publish, delete, report: in that order."""
        ns, name = job["metadata"]["namespace"], job["metadata"]["name"]
        for pod in plan.create:
            try:
                self.kube.create(api_path("v1", "pods", ns), pod)
                log.info("created pod %s/%s", ns, pod["metadata"]["name"])
            except ApiError as err:
                if err.status != 409:
                    raise
        now = self.clock()
        for pod_name in plan.mark_leaving:
            self.kube.merge_patch(api_path("v1", "pods", ns, pod_name),
                                  {"metadata": {"annotations": {LEAVING_ANNOTATION: f"{now}"}}})
        if plan.world is not None:
            self.kube.apply(_object_path(world_configmap(job, "")),
                            world_configmap(job, plan.world.to_json()))
            log.info("published world %s/%s epoch=%d size=%d", ns, name, plan.world.epoch,
                     plan.world.size)
        for pod_name in plan.delete:
            self.kube.delete(api_path("v1", "pods", ns, pod_name), grace=0)
        if plan.clear_reports:
            self.kube.merge_patch(
                api_path("v1", "configmaps", ns, reports_configmap_name(name)),
                {"data": dict.fromkeys(plan.clear_reports)})
        if plan.status and plan.status != job.get("status"):
            self.kube.merge_patch(job_path(ns, name, "status"), {"status": plan.status})
        for event in plan.events:
            self.event(job, event)
        if plan.delete_job:
            log.info("deleting finished job %s/%s (ttlSecondsAfterFinished)", ns, name)
            self.kube.delete(job_path(ns, name))

    def event(self, job: Obj, event: Event) -> None:
        """Record a Kubernetes Event on the job (what `kubectl describe tj` shows)."""
        meta = job["metadata"]
        stamp = rfc3339(self.clock())
        body: Obj = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"generateName": f"{meta['name']}.", "namespace": meta["namespace"]},
            "involvedObject": {"apiVersion": job["apiVersion"], "kind": job["kind"],
                               "name": meta["name"], "namespace": meta["namespace"],
                               "uid": meta.get("uid", "")},
            "type": event.type,
            "reason": event.reason,
            "message": event.message[:1000],
            "firstTimestamp": stamp,
            "lastTimestamp": stamp,
            "count": 1,
            "source": {"component": COMPONENT},
            "reportingComponent": COMPONENT,
            "reportingInstance": self.instance,
        }
        try:
            self.kube.create(api_path("v1", "events", meta["namespace"]), body)
        except ApiError as err:
            # An event is worth a warning in our log, never a failed reconcile.
            log.warning("could not record event %s: %s", event.reason, err)
