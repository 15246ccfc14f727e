"""Queueing a TrainingJob through Kueue: the Workload it publishes and what Kueue's answer
means for the round. Pure: objects in, objects and decisions out.

A job labelled ``kueue.x-k8s.io/queue-name`` is described to Kueue as one ``Workload``
(pod sets ``workers`` and ``ps`` with their counts and per-pod requests; ``minCount`` is
the gang, ``spec.workers.min``). No pod exists until Kueue admits it. Admission assigns a
ResourceFlavor per resource and may admit fewer workers than asked (partial admission,
down to ``minCount``): both become the job's *effective* spec for the round: the flavor's
node labels join the templates' ``nodeSelector`` (the constraint path the planner already
honours, so there is one placement) and ``replicas`` is the admitted count.

Why a Workload and not Kueue's pod-group integration: a pod group is admitted when its
pods exist (gated); an elastic job's pods come and go, and the gang, the flavor and the
count must be decided before ringwright places anything. The Workload is what Kueue's own
job integrations write, and it carries ``minCount``.

Elastic within the quota (the operator's ``kueueElastic``, with Kueue's
``ElasticJobsViaWorkloadSlices`` gate): the Workload is a chain of *slices*. A job that
wants more workers than its admitted slice holds asks with a new slice that names the old
one as the one it replaces; Kueue admits it (counting the old slice's quota as free) when
the quota allows at least one more worker, and finishes the old slice. Fewer workers
shrink the admitted slice in place, which hands the quota back at once. A job with a
topology assignment resizes only through slices, and only for the requests Kueue carries
over to a new slice (:mod:`.kueue_topology`).
"""

from __future__ import annotations

import copy
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ringwright.objects import Obj

from ..api.base import API_VERSION as JOB_API_VERSION
from ..api.conditions import rfc3339
from ..api.models import TrainingJobSpec
from ..api.schedulingpolicy import SchedulingPolicySpec
from .kueue_topology import (
    HOSTNAME,
    SLICEABLE,
    Assigned,
    Fit,
    fit,
    node_labels,
    read_assignment,
    request_kind,
    topology_request,
)
from .manifests import JOB_LABEL, WORKER
from .manifests import PS as PS_ROLE
from .placement.inventory import Inventory, with_pod_slots
from .placement.podresources import ps_pod_spec, worker_pod_spec
from .pods import PodView
from .types import Placement, Placer

QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
PRIORITY_LABEL = "kueue.x-k8s.io/priority-class"
"""Names the WorkloadPriorityClass of a queued job (Kueue's label for every job kind)."""
API_VERSION = "kueue.x-k8s.io/v1beta2"
ELASTIC_ANNOTATION = "kueue.x-k8s.io/elastic-job"
"""Marks a Workload whose pod counts may change (Kueue's workload slices)."""
REPLACES_ANNOTATION = "kueue.x-k8s.io/workload-slice-replacement-for"
"""On a new slice: ``<namespace>/<name>`` of the slice it replaces once admitted."""
SLICE_ANNOTATION = "ringwright.dev/workload-slice"
"""The slice's number in the job's chain (0: the first Workload)."""
WORKERS, PS = "workers", "ps"
_POD_FIELDS = ("containers", "initContainers", "nodeSelector", "tolerations", "affinity",
               "overhead", "priorityClassName")
"""What Kueue reads from a pod template: requests, and what decides which flavors fit."""


def queue_name(job: Obj) -> str | None:
    """The LocalQueue a job asks for, or None when it is not queued through Kueue."""
    labels = (job.get("metadata") or {}).get("labels") or {}
    name = labels.get(QUEUE_LABEL)
    return str(name) if name else None


def workload_name(job: Obj, slice_number: int = 0) -> str:
    """The job's Workload (its slice ``slice_number``): its name plus a piece of its uid,
    so a job recreated under the same name never inherits the old one's admission."""
    meta = job["metadata"]
    base = f"trainingjob-{meta['name']}-{str(meta.get('uid', ''))[:5]}"
    return f"{base}-{slice_number}" if slice_number else base


def slice_number(wl: Obj) -> int:
    """The number of Workload slice ``wl`` in its job's chain."""
    return int(((wl.get("metadata") or {}).get("annotations") or {}).get(SLICE_ANNOTATION, 0))


def _pod_set(name: str, count: int, pod_spec: Mapping[str, Any],
             min_count: int | None = None, topology: Obj | None = None) -> Obj:
    spec = {k: copy.deepcopy(pod_spec[k]) for k in _POD_FIELDS if k in pod_spec}
    spec["containers"] = [{"name": c["name"], "image": c.get("image", ""),
                           "resources": copy.deepcopy(c.get("resources") or {})}
                          for c in spec["containers"]]
    if "initContainers" in spec:
        spec["initContainers"] = [{"name": c["name"], "image": c.get("image", ""),
                                   "resources": copy.deepcopy(c.get("resources") or {})}
                                  for c in spec["initContainers"]]
    out: Obj = {"name": name, "count": count, "template": {"spec": spec}}
    if min_count is not None and min_count < count:
        out["minCount"] = min_count
    if topology is not None:
        out["topologyRequest"] = topology
    return out


def priority_class(job: Obj) -> str | None:
    """The WorkloadPriorityClass the job's label names, if any."""
    labels = (job.get("metadata") or {}).get("labels") or {}
    name = labels.get(PRIORITY_LABEL)
    return str(name) if name else None


def workload(job: Obj, queue: str, policy: SchedulingPolicySpec,
             priority: int | None = None, elastic: bool = False) -> Obj | Admission:
    """The Workload that asks Kueue for the job's whole demand; ``priority`` is the value
    of the WorkloadPriorityClass the job names. A class that does not exist (yet) is an
    :class:`Admission` saying so: a Workload without it would queue at the wrong priority.
    ``elastic``: the first slice of a chain whose counts may change.
    """
    spec = TrainingJobSpec.model_validate(job["spec"])
    meta = job["metadata"]
    wl_spec: Obj = {"queueName": queue}
    named = priority_class(job)
    if named is not None:
        if priority is None:
            return Admission(False, "WorkloadPriorityClassNotFound",
                             f"the label {PRIORITY_LABEL} names WorkloadPriorityClass "
                             f"{named!r}, which does not exist; create it or fix the label")
        wl_spec.update(priorityClassRef={"group": "kueue.x-k8s.io",
                                         "kind": "WorkloadPriorityClass", "name": named},
                       priority=priority)
    workers = worker_pod_spec(spec.workers.template.spec.to_wire(), spec.gpus_per_worker,
                              policy.gpu_resource)
    if spec.gpu_model:
        # Only the flavors of the requested model fit: Kueue matches nodeSelector
        # against the flavors' node labels.
        workers["nodeSelector"] = {**(workers.get("nodeSelector") or {}),
                                   policy.node_labels.gpu_model: spec.gpu_model}
    elif policy.allowed_gpu_models and spec.gpus_per_worker:
        # Kueue matches required node affinity too: no flavor of a model the policy
        # refuses can be assigned (the planner would refuse to place there).
        _narrowed(workers, ((policy.node_labels.gpu_model, tuple(policy.allowed_gpu_models)),))
    templates = job["spec"]
    pod_sets = [_pod_set(WORKERS, spec.workers.replicas, workers, min_count=spec.workers.min,
                         topology=topology_request(templates["workers"]["template"]))]
    if spec.ps is not None and spec.ps.replicas:
        pod_sets.append(_pod_set(PS, spec.ps.replicas, ps_pod_spec(
            spec.ps.template.spec.to_wire(), policy.ps_pinning),
            topology=topology_request(templates["ps"]["template"])))
    return {
        "apiVersion": API_VERSION, "kind": "Workload",
        "metadata": {
            "name": workload_name(job), "namespace": meta["namespace"],
            "labels": {JOB_LABEL: meta["name"]},
            **({"annotations": {ELASTIC_ANNOTATION: "true", SLICE_ANNOTATION: "0"}}
               if elastic else {}),
            "ownerReferences": [{"apiVersion": JOB_API_VERSION, "kind": "TrainingJob",
                                 "name": meta["name"], "uid": meta.get("uid", ""),
                                 "controller": True, "blockOwnerDeletion": True}],
        },
        "spec": {**wl_spec, "podSets": pod_sets},
    }


@dataclass(frozen=True)
class Admission:
    """What Kueue has said about a Workload."""

    admitted: bool
    reason: str
    """Kueue's reason (of QuotaReserved/Admitted/Evicted), e.g. ``Pending``."""
    message: str
    """Kueue's message, e.g. ``couldn't assign flavors to pod set workers: insufficient
    unused quota for nvidia.com/gpu in flavor h100, 8 more needed``."""
    counts: Mapping[str, int] = field(default_factory=dict)
    """Admitted pods per pod set."""
    flavors: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    """The ResourceFlavors assigned per pod set."""
    topology: Mapping[str, Assigned] = field(default_factory=dict)
    """Per pod set with a topology assignment: its domains and their pod counts."""
    finished: bool = False


def _condition(wl: Obj, type_: str) -> Obj | None:
    return next((c for c in (wl.get("status") or {}).get("conditions") or ()
                 if c.get("type") == type_), None)


def _true(cond: Obj | None) -> bool:
    return cond is not None and cond.get("status") == "True"


def admission(wl: Obj | None) -> Admission:
    """Read Kueue's answer from the Workload's status (None: not created yet)."""
    if wl is None:
        return Admission(False, "WorkloadCreating", "the Workload is being created")
    finished = _condition(wl, "Finished")
    if finished is not None and _true(finished):
        return Admission(False, "Finished", str(finished.get("message", "")), finished=True)
    evicted = _condition(wl, "Evicted")
    admitted = _condition(wl, "Admitted")
    if _true(admitted) and not _true(evicted):
        assignments = ((wl.get("status") or {}).get("admission") or {}).get(
            "podSetAssignments") or ()
        counts = {a["name"]: int(a.get("count", 0)) for a in assignments}
        flavors = {a["name"]: tuple(sorted(set((a.get("flavors") or {}).values())))
                   for a in assignments}
        topology = {a["name"]: read_assignment(a["topologyAssignment"])
                    for a in assignments if a.get("topologyAssignment")}
        return Admission(True, str((admitted or {}).get("reason", "Admitted")),
                         str((admitted or {}).get("message", "")), counts, flavors, topology)
    if _true(evicted):
        return Admission(False, str((evicted or {}).get("reason", "Evicted")),
                         str((evicted or {}).get("message", "")))
    reserved = _condition(wl, "QuotaReserved")
    if reserved is not None:
        return Admission(False, str(reserved.get("reason", "Pending")),
                         str(reserved.get("message", "")))
    return Admission(False, "Pending", "waiting for Kueue to consider the Workload")


def assigned_domains(assignment: Obj) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """The values assigned at each level of a Kueue ``topologyAssignment``, as (node
    label, sorted values) per level."""
    return read_assignment(assignment).values()


def requeue_evicted(wl: Obj, now: float) -> Obj | None:
    """The status merge patch that returns an evicted Workload to its queue once the job
    has no pods left: quota reservation and admission cleared, ``Requeued`` set (True
    after a preemption, so Kueue retries it; as Kueue's job integrations do). None when
    the Workload is not evicted or already holds no quota."""
    evicted = _condition(wl, "Evicted")
    status = wl.get("status") or {}
    if not _true(evicted) or (status.get("admission") is None
                              and not _true(_condition(wl, "QuotaReserved"))):
        return None
    reason = str((evicted or {}).get("reason", "Evicted"))
    message = str((evicted or {}).get("message", ""))
    at = rfc3339(now)
    replaced = {
        "QuotaReserved": {"type": "QuotaReserved", "status": "False", "reason": "Pending",
                          "message": message, "lastTransitionTime": at},
        "Admitted": {"type": "Admitted", "status": "False", "reason": "NoReservation",
                     "message": "The workload has no reservation", "lastTransitionTime": at},
        "Requeued": {"type": "Requeued",
                     "status": "True" if reason in ("Preempted", "NodeFailures") else "False",
                     "reason": reason, "message": message, "lastTransitionTime": at},
    }
    kept = [c for c in status.get("conditions") or () if c.get("type") not in replaced]
    generation = (wl.get("metadata") or {}).get("generation")
    conditions = [*kept, *replaced.values()]
    if generation is not None:
        conditions = [{**c, "observedGeneration": generation} if c["type"] in replaced else c
                      for c in conditions]
    return {"metadata": _version_of(wl),
            "status": {"admission": None, "conditions": conditions}}


def effective_job(job: Obj, given: Admission,
                  flavor_labels: Mapping[str, Mapping[str, str]],
                  fits: Mapping[str, Fit] | None = None, keep: int | None = None) -> Obj:
    """The job as an admitted Workload lets it run: the assigned flavors' node labels in
    every template's ``nodeSelector``, the assigned topology domains in its required node
    affinity (only those with room, per ``fits``, where the running pods are known) and
    at most the admitted number of pods; ``keep``: the workers to keep meanwhile while a
    smaller slice waits for Kueue's assignment."""
    out = copy.deepcopy(job)
    for role, pod_set in (("workers", WORKERS), ("ps", PS)):
        role_spec = out["spec"].get(role)
        if not role_spec:
            continue
        labels: dict[str, str] = {}
        for flavor in given.flavors.get(pod_set, ()):
            labels.update(flavor_labels.get(flavor) or {})
        template = role_spec["template"].setdefault("spec", {})
        if labels:
            template["nodeSelector"] = {**(template.get("nodeSelector") or {}), **labels}
        assigned = given.topology.get(pod_set)
        if assigned is not None:
            found = (fits or {}).get(pod_set)
            _narrowed(template, found.room if found is not None else assigned.values())
        admitted = given.counts.get(pod_set)
        if pod_set == WORKERS and keep is not None:
            role_spec["replicas"] = keep
        elif admitted is not None and admitted < int(role_spec.get("replicas", 0)):
            role_spec["replicas"] = admitted
    return out


def topology_fits(given: Admission, pods: Sequence[PodView], ranks: Mapping[str, int],
                  labels_of: Callable[[str], Mapping[str, str] | None]) -> dict[str, Fit]:
    """How the job's live pods fit each pod set's topology assignment: in the world by
    rank first, then the others, so a full domain's surplus is its highest ranks and the
    pods that hold no state. ``labels_of``: a node's labels (None: not in the inventory)."""
    out: dict[str, Fit] = {}
    for pod_set, assigned in given.topology.items():
        role = WORKER if pod_set == WORKERS else PS_ROLE
        live = sorted((p for p in pods if p.role == role and p.alive
                       and p.leaving_since is None and (p.node or p.planned_node)),
                      key=lambda p: (p.name not in ranks, ranks.get(p.name, 0), p.index))
        out[pod_set] = fit(assigned, [
            (p.name, node_labels(node, labels_of(node)))
            for p in live for node in (p.node or p.planned_node,)])
    return out


def capped_placer(placer: Placer, fits: Mapping[str, Fit]) -> Placer:
    """``placer`` on an inventory where each host Kueue assigned takes no more new pods
    than it counted there and the job's pods do not yet fill (:attr:`Fit.host_room`,
    summed over the pod sets); ``placer`` itself when no assignment is per host."""
    slots: Counter[str] = Counter()
    for found in fits.values():
        for host, missing in found.host_room:
            slots[host] += missing
    if not slots:
        return placer

    def place(spec: TrainingJobSpec, policy: SchedulingPolicySpec, inventory: Inventory,
              live: Sequence[PodView]) -> Placement:
        return placer(spec, policy, with_pod_slots(inventory, slots, HOSTNAME), live)

    return place


def _narrowed(pod_spec: Obj, allowed: tuple[tuple[str, tuple[str, ...]], ...]) -> None:
    """Narrow a pod spec's required node affinity to nodes whose label has one of the
    allowed values, per label (every term of it: the terms are alternatives, each must
    stay inside); e.g. the topology domains Kueue assigned."""
    inside = [{"key": label, "operator": "In", "values": list(values)}
              for label, values in allowed]
    required = pod_spec.setdefault("affinity", {}).setdefault("nodeAffinity", {}) \
        .setdefault("requiredDuringSchedulingIgnoredDuringExecution", {})
    terms = required.get("nodeSelectorTerms") or [{}]
    required["nodeSelectorTerms"] = [
        {**term, "matchExpressions": [*(term.get("matchExpressions") or []), *inside]}
        for term in terms]


@dataclass(frozen=True)
class SliceChange:
    """What the chain of a job's Workload slices needs this round (all optional)."""

    create: Obj | None = None
    """A new slice asking for a different number of workers."""
    delete: tuple[str, ...] = ()
    """Slices still waiting that ask for a number the job no longer wants."""
    resize: Obj | None = None
    """A merge patch of a slice's ``spec.podSets`` (and the version it was read at)."""
    waiting: str = ""
    """Why the job runs fewer workers than it asks for (a slice waits), else empty."""
    keep: int | None = None
    """Workers to keep running until a smaller slice is admitted (its topology assignment
    says which pods stay), else None."""
    fixed: str = ""
    """Why the job cannot follow ``replicas`` through slices (its topology request), else
    empty."""


def _workers(wl: Obj) -> Obj:
    return next(ps for ps in wl["spec"]["podSets"] if ps["name"] == WORKERS)


def _counted(wl: Obj, count: int) -> tuple[list[Obj], Obj]:
    """A copy of ``wl``'s pod sets with the workers' count set, and the workers' set in it."""
    pod_sets: list[Obj] = copy.deepcopy(wl["spec"]["podSets"])
    workers = _workers({"spec": {"podSets": pod_sets}})
    workers["count"] = count
    return pod_sets, workers


def _with_workers(wl: Obj, count: int, min_count: int | None) -> list[Obj]:
    """``wl``'s pod sets with the workers' count (and minCount) changed."""
    pod_sets, workers = _counted(wl, count)
    workers.pop("minCount", None)
    if min_count is not None and min_count < count:
        workers["minCount"] = min_count
    return pod_sets


def _with_count(wl: Obj, count: int) -> Obj:
    """The merge patch of ``wl``'s pod sets with only the workers' count changed (an
    admitted slice's minCount is fixed; it never exceeds ``count`` here)."""
    pod_sets, _ = _counted(wl, count)
    return {"metadata": _version_of(wl), "spec": {"podSets": pod_sets}}


def _version_of(wl: Obj) -> Obj:
    """The metadata a patch of ``wl`` carries: its name (where the apply layer sends it)
    and the version it was read at (a Workload Kueue changed meanwhile is refused)."""
    meta = wl.get("metadata") or {}
    return {"name": meta.get("name", ""), "resourceVersion": meta.get("resourceVersion", "")}


def _replacement(job: Obj, base: Obj, number: int, count: int, min_count: int | None) -> Obj:
    """Slice ``number`` of ``job``'s chain, asking for ``count`` workers (at least
    ``min_count`` of them); admitted, it replaces ``base``."""
    meta = base["metadata"]
    return {
        "apiVersion": API_VERSION, "kind": "Workload",
        "metadata": {
            "name": workload_name(job, number), "namespace": meta["namespace"],
            "labels": dict(meta.get("labels") or {}),
            "annotations": {ELASTIC_ANNOTATION: "true", SLICE_ANNOTATION: str(number),
                            REPLACES_ANNOTATION: f"{meta['namespace']}/{meta['name']}"},
            "ownerReferences": copy.deepcopy(meta.get("ownerReferences") or []),
        },
        "spec": {**{k: copy.deepcopy(v) for k, v in base["spec"].items() if k != "podSets"},
                 "podSets": _with_workers(base, count, min_count)},
    }


def resize_slices(job: Obj, base: Obj, waiting: Obj | None, given: Admission,
                  next_number: int, topology_slices: bool = False) -> SliceChange:
    """How the chain follows ``spec.workers.replicas`` once ``base`` (the oldest slice
    not finished) is admitted with ``given``; ``waiting`` is a newer slice not admitted
    yet. At most one slice waits at a time: one asking for another number goes first.
    ``topology_slices``: Kueue's ``ElasticJobsViaWorkloadSlicesWithTAS`` gate is on.

    - More workers than admitted: a new slice replacing ``base``, admitted only with at
      least one worker more than now (``minCount``), so Kueue never swaps a slice for
      one of the same size; it waits while the quota is short and is admitted when the
      quota frees (the job grows then).
    - Fewer: ``base`` shrinks in place (its quota is released at once), or, below the
      slice's own ``minCount`` (which Kueue keeps fixed), a replacing slice of that size.
    - With a topology assignment: only requests Kueue carries over to a new slice
      (unconstrained or implied, with the gate) resize, and always through a new slice
      (Kueue keeps an in-place shrink's assignment at the old size); the job keeps its
      workers until the smaller slice's assignment says which stay. Other requests keep
      the admitted size, and the change says why.
    """
    spec = TrainingJobSpec.model_validate(job["spec"])
    want, has = spec.workers.replicas, given.counts.get(WORKERS, 0)
    topology = WORKERS in given.topology
    kind = request_kind(_workers(base))
    if (topology or kind not in SLICEABLE) and not (topology_slices and kind in SLICEABLE):
        return SliceChange(fixed=_fixed_reason(kind, want, has, topology)
                           if want != has else "")
    keep = has if topology and want < has else None
    if waiting is not None:
        if _workers(waiting)["count"] != want:
            return SliceChange(delete=(waiting["metadata"]["name"],), keep=keep)
        return SliceChange(waiting=_waiting_reason(waiting, want, has) if want > has else "",
                           keep=keep)
    if want > has:
        return SliceChange(create=_replacement(job, base, next_number, want, has + 1),
                           waiting=f"asking Kueue for {want} workers ({has} admitted)")
    floor = _workers(base).get("minCount")
    if keep is not None or (floor is not None and want < floor):
        return SliceChange(create=_replacement(job, base, next_number, want, spec.workers.min),
                           keep=keep)
    if want < _workers(base)["count"]:
        return SliceChange(resize=_with_count(base, want))
    return SliceChange()


def _fixed_reason(kind: str, want: int, has: int, assigned: bool) -> str:
    why = ("Kueue gives a new slice a topology of its own unless its "
           "ElasticJobsViaWorkloadSlicesWithTAS gate is on (operator setting "
           "kueueElasticTopology), and then only for unconstrained requests"
           if assigned else f"Kueue v0.17 under its ElasticJobsViaWorkloadSlicesWithTAS "
           f"gate admits a {kind} request without the topology it asks for")
    return (f"asked for {want} workers but Kueue admitted {has} "
            f"{'with a topology assignment' if assigned else 'for a topology request'} "
            f"({kind} request), which this job keeps: {why} (docs/kueue.md)")


def dropped_topology(base: Obj, given: Admission) -> str:
    """Why an admitted pod set that asked for a required or preferred topology has no
    topology assignment (Kueue v0.17 drops such requests under its
    ElasticJobsViaWorkloadSlicesWithTAS gate), else empty."""
    dropped = []
    for pod_set in base["spec"]["podSets"]:
        kind = request_kind(pod_set)
        if kind not in SLICEABLE and pod_set["name"] not in given.topology:
            level = (pod_set.get("topologyRequest") or {}).get(kind)
            dropped.append(f"{pod_set['name']} ({kind}: {level})")
    if not dropped:
        return ""
    return (f"Kueue admitted pod sets {', '.join(dropped)} without a topology assignment "
            "(v0.17 drops required and preferred requests under its "
            "ElasticJobsViaWorkloadSlicesWithTAS gate); the operator places them by its "
            "own rules and keeps their admitted size. Ask for an unconstrained topology "
            "(kueue.x-k8s.io/podset-unconstrained-topology: \"true\"), or run Kueue "
            "without that gate (docs/kueue.md)")


def _waiting_reason(waiting: Obj, want: int, has: int) -> str:
    told = admission(waiting)
    return (f"asking Kueue for {want} workers ({has} admitted): {told.reason}: "
            f"{told.message}")


def resize_queued(job: Obj, base: Obj) -> Obj | None:
    """The merge patch that makes a Workload not admitted yet ask for the job's current
    workers and gang (pod sets may change until Kueue reserves quota); None if it does."""
    spec = TrainingJobSpec.model_validate(job["spec"])
    status = base.get("status") or {}
    if status.get("admission") is not None or _true(_condition(base, "QuotaReserved")):
        return None
    pod_sets = _with_workers(base, spec.workers.replicas, spec.workers.min)
    if pod_sets == base["spec"]["podSets"]:
        return None
    return {"metadata": _version_of(base), "spec": {"podSets": pod_sets}}
