"""The observe step: read one job and everything its plan depends on from the API."""

from __future__ import annotations

import logging

from pydantic import ValidationError

from ringwright.kube import KubeClient, api_path
from ringwright.operator.apibase import API_VERSION
from ringwright.operator.inventory import inventory_from_objects
from ringwright.operator.manifests import JOB_LABEL
from ringwright.operator.models import TrainingJobSpec
from ringwright.operator.reconcile import Observed
from ringwright.operator.schedulingpolicy import SchedulingPolicySpec
from ringwright.world import (
    WORLD_KEY,
    ContractError,
    Report,
    World,
    parse_report,
    parse_world,
    reports_configmap_name,
    world_configmap_name,
)

log = logging.getLogger("ringwright.operator.observe")


def job_path(namespace: str, name: str | None = None, subresource: str | None = None) -> str:
    return api_path(API_VERSION, "trainingjobs", namespace, name, subresource)


def observe(kube: KubeClient, namespace: str, name: str) -> Observed | None:
    """Everything the planner needs for one job; None when the job is gone."""
    job = kube.get_or_none(job_path(namespace, name))
    if job is None or job["metadata"].get("deletionTimestamp"):
        return None
    pods = kube.list(api_path("v1", "pods", namespace), labelSelector=f"{JOB_LABEL}={name}")
    world = _world(kube, namespace, name)
    reports = _reports(kube, namespace, name)
    spec = TrainingJobSpec.model_validate(job["spec"])
    policy_obj = kube.get_or_none(
        api_path(API_VERSION, "schedulingpolicies", name=spec.scheduling_policy_name))
    policy: SchedulingPolicySpec | None = None
    if policy_obj is not None:
        try:
            policy = SchedulingPolicySpec.model_validate(policy_obj.get("spec") or {})
        except ValidationError as err:
            log.warning("SchedulingPolicy %s is unusable: %s", spec.scheduling_policy_name, err)
    labels = (policy or SchedulingPolicySpec()).node_labels
    gpu = (policy or SchedulingPolicySpec()).gpu_resource
    nodes = kube.list(api_path("v1", "nodes"))
    # What other pods use matters only when this job needs new pods placed.
    alive = [p for p in pods if (p.get("status") or {}).get("phase") not in
             ("Succeeded", "Failed") and not p["metadata"].get("deletionTimestamp")]
    wanted = spec.workers.replicas + (spec.ps.replicas if spec.ps else 0)
    cluster_pods = (kube.list(api_path("v1", "pods"),
                              fieldSelector="status.phase!=Succeeded,status.phase!=Failed")
                    if len(alive) < wanted else [])
    ps_priority = (_priority_value(kube, (policy or SchedulingPolicySpec()).priority_classes.ps)
                   if cluster_pods and spec.ps else None)
    inventory = inventory_from_objects(nodes, cluster_pods, labels, gpu,
                                       preemptible_below=ps_priority)
    return Observed(job=job, pods=pods, world=world, reports=reports, policy=policy,
                    inventory=inventory)


def _priority_value(kube: KubeClient, name: str) -> int | None:
    """The value of PriorityClass ``name``; None when it does not exist (no preemption)."""
    obj = kube.get_or_none(api_path("scheduling.k8s.io/v1", "priorityclasses", name=name))
    return None if obj is None else int(obj.get("value") or 0)


def _world(kube: KubeClient, namespace: str, name: str) -> World | None:
    cm = kube.get_or_none(api_path("v1", "configmaps", namespace, world_configmap_name(name)))
    text = ((cm or {}).get("data") or {}).get(WORLD_KEY)
    if not text:
        return None
    try:
        return parse_world(text, where=f"{namespace}/{world_configmap_name(name)}")
    except ContractError as err:
        log.warning("ignoring unreadable world: %s", err)
        return None


def _reports(kube: KubeClient, namespace: str, name: str) -> dict[str, Report]:
    cm = kube.get_or_none(api_path("v1", "configmaps", namespace, reports_configmap_name(name)))
    out: dict[str, Report] = {}
    for pod, text in ((cm or {}).get("data") or {}).items():
        try:
            out[pod] = parse_report(text, where=f"report of {pod}")
        except ContractError as err:
            log.warning("ignoring report: %s", err)
    return out
