"""The observe step: one job and everything its plan depends on, read from the watch caches."""

from __future__ import annotations

import logging

from pydantic import ValidationError

from ringwright.kube import api_path
from ringwright.objects import Obj
from ringwright.world import (
    STATS_SUFFIX,
    WORLD_KEY,
    ContractError,
    MemberStats,
    Report,
    World,
    parse_report,
    parse_stats,
    parse_world,
    reports_configmap_name,
    world_configmap_name,
)

from ..api.base import API_VERSION
from ..api.models import TrainingJobSpec
from ..api.schedulingpolicy import SchedulingPolicySpec
from ..plan.generations import annotated_generation
from ..plan.isolation import honest_reports, honest_stats
from ..plan.manifests import published_at
from ..plan.reconcile import Observed
from .cache import Cache
from .ownership import left_behind, owned, owned_by

log = logging.getLogger("ringwright.operator.observe.job")


def job_path(namespace: str, name: str | None = None, subresource: str | None = None) -> str:
    return api_path(API_VERSION, "trainingjobs", namespace, name, subresource)


def observe(cache: Cache, job: Obj) -> Observed:
    """Everything the planner needs for ``job``, read from memory (no API call)."""
    meta = job["metadata"]
    namespace, name = meta["namespace"], meta["name"]
    spec = TrainingJobSpec.model_validate(job["spec"])
    policy: SchedulingPolicySpec | None = None
    policy_error = ""
    policy_spec = cache.policy(spec.scheduling_policy_name)
    if policy_spec is not None:
        try:
            policy = SchedulingPolicySpec.model_validate(policy_spec)
        except ValidationError as err:
            log.warning("SchedulingPolicy %s is unusable: %s", spec.scheduling_policy_name, err)
            policy_error = _validation_message(err)
    effective = policy or SchedulingPolicySpec()
    ps_priority = (cache.priority_value(effective.priority_classes.ps) if spec.ps else None)
    inventory = cache.inventory(effective.node_labels, effective.gpu_resource, ps_priority)
    uid = str(meta.get("uid", ""))
    world_cm = cache.configmap(namespace, world_configmap_name(name))
    reports_cm = cache.configmap(namespace, reports_configmap_name(name))
    labelled = cache.job_pods(namespace, name)
    pods = owned(labelled, uid)
    # A world left by an earlier job of the same name is not this job's (its generations do
    # not count), but it is written over at the version read.
    own_world = world_cm if owned_by(world_cm, uid) else None
    own_reports = owned_by(reports_cm, uid)
    nodes = {str((p.get("spec") or {}).get("nodeName") or "") for p in pods} - {""}
    down = {n: since for n in nodes if (since := cache.node_down_since(n)) is not None}
    return Observed(
        job=job, pods=pods, left_behind=left_behind(labelled, uid), node_down_since=down,
        world=_world(own_world, namespace, name),
        reports=honest_reports(_reports(reports_cm), pods) if own_reports else {},
        stats=honest_stats(_stats(reports_cm), pods) if own_reports else {},
        policy=policy, inventory=inventory, policy_error=policy_error,
        world_annotation_generation=annotated_generation(own_world),
        world_published_at=published_at(own_world),
        world_version=str(((world_cm or {}).get("metadata") or {}).get("resourceVersion", "")))


def _validation_message(err: ValidationError) -> str:
    """Pydantic's errors as ``spec.field: what is wrong`` (camelCase paths, as in the API)."""
    return "; ".join(
        f"spec.{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" if e["loc"] else e["msg"]
        for e in err.errors())[:1000]


def _world(cm: Obj | None, namespace: str, name: str) -> World | None:
    text = ((cm or {}).get("data") or {}).get(WORLD_KEY)
    if not text:
        return None
    try:
        return parse_world(text, where=f"{namespace}/{world_configmap_name(name)}")
    except ContractError as err:
        log.warning("ignoring unreadable world: %s", err)
        return None


def _reports(cm: Obj | None) -> dict[str, Report]:
    out: dict[str, Report] = {}
    for pod, text in ((cm or {}).get("data") or {}).items():
        if pod.endswith(STATS_SUFFIX):
            continue
        try:
            out[pod] = parse_report(text, where=f"report of {pod}")
        except ContractError as err:
            log.warning("ignoring report: %s", err)
    return out


def _stats(cm: Obj | None) -> dict[str, MemberStats]:
    out: dict[str, MemberStats] = {}
    for key, text in ((cm or {}).get("data") or {}).items():
        if not key.endswith(STATS_SUFFIX):
            continue
        pod = key.removesuffix(STATS_SUFFIX)
        try:
            out[pod] = parse_stats(text, where=f"stats of {pod}")
        except ContractError as err:
            log.warning("ignoring stats: %s", err)
    return out
