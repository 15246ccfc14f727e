"""The Kueue part of a plan: create, resize and delete the job's Workload slices, hand an
evicted one back to the queue, mark them Finished when the job ends."""

from __future__ import annotations

from collections.abc import Callable

from ringwright.kube import ApiError, KubeClient, api_path
from ringwright.objects import Obj

from ..api.conditions import rfc3339
from ..plan.kueue import API_VERSION
from ..plan.reconcile import Plan


def workload_path(namespace: str, name: str | None = None, sub: str | None = None) -> str:
    """REST path of Workloads in ``namespace`` (one of them, or its subresource)."""
    return api_path(API_VERSION, "workloads", namespace, name, sub)


def perform_queue(kube: KubeClient, job: Obj, plan: Plan, now: float) -> None:
    """Create ``plan.workload`` (already there: nothing to do), delete the slices no longer
    wanted, resize one, hand an evicted Workload back to the queue, and mark the job's
    slices Finished once the job ended, which hands their quota back to the ClusterQueue."""
    namespace = job["metadata"]["namespace"]
    if plan.workload is not None:
        try:
            kube.create(workload_path(namespace), plan.workload)
        except ApiError as err:
            if err.status != 409:
                raise
    for name in plan.workload_delete:
        kube.delete(workload_path(namespace, name))
    # Both patches carry the version they were decided on: a Workload Kueue changed
    # meanwhile (409) is looked at again by the next round.
    if (resize := plan.workload_resize) is not None:
        _unless_changed(lambda: kube.merge_patch(
            workload_path(namespace, resize["metadata"]["name"]), resize))
    if (requeue := plan.workload_requeue) is not None:
        _unless_changed(lambda: kube.merge_patch(
            workload_path(namespace, requeue["metadata"]["name"], "status"), requeue))
    for name in plan.finish_workloads:
        kube.apply(workload_path(namespace, name, "status"), {
            "apiVersion": API_VERSION, "kind": "Workload",
            "metadata": {"name": name, "namespace": namespace},
            "status": {"conditions": [{
                "type": "Finished", "status": "True", "reason": "JobFinished",
                "message": plan.workload_finished,
                "lastTransitionTime": rfc3339(now)}]},
        })


def _unless_changed(write: Callable[[], object]) -> None:
    try:
        write()
    except ApiError as err:
        if err.status != 409:
            raise
