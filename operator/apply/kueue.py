"""The Kueue part of a plan: create the job's Workload, mark it Finished when the job ends."""

from __future__ import annotations

from ringwright.kube import ApiError, KubeClient, api_path
from ringwright.objects import Obj

from ..api.conditions import rfc3339
from ..plan.kueue import API_VERSION, workload_name
from ..plan.reconcile import Plan


def workload_path(namespace: str, name: str | None = None, sub: str | None = None) -> str:
    """REST path of Workloads in ``namespace`` (one of them, or its subresource)."""
    return api_path(API_VERSION, "workloads", namespace, name, sub)


def perform_queue(kube: KubeClient, job: Obj, plan: Plan, now: float) -> None:
    """Create ``plan.workload`` (already there: nothing to do), hand an evicted Workload
    back to the queue, and mark the job's Workload Finished once the job ended, which
    hands its quota back to the ClusterQueue."""
    namespace = job["metadata"]["namespace"]
    if plan.workload is not None:
        try:
            kube.create(workload_path(namespace), plan.workload)
        except ApiError as err:
            if err.status != 409:
                raise
    if plan.workload_requeue is not None:
        try:
            kube.merge_patch(workload_path(namespace, workload_name(job), "status"),
                             plan.workload_requeue)
        except ApiError as err:
            if err.status != 409:  # Kueue changed it meanwhile: the next round decides
                raise
    if plan.workload_finished:
        name = workload_name(job)
        kube.apply(workload_path(namespace, name, "status"), {
            "apiVersion": API_VERSION, "kind": "Workload",
            "metadata": {"name": name, "namespace": namespace},
            "status": {"conditions": [{
                "type": "Finished", "status": "True", "reason": "JobFinished",
                "message": plan.workload_finished,
                "lastTransitionTime": rfc3339(now)}]},
        })
