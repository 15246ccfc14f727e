"""The ``SchedulingPolicy`` API: the cluster admin's placement rules (cluster-scoped).

Jobs name a policy (``spec.schedulingPolicyName``, "default" unless set); the chart
installs one named ``default``. These models generate
``crds/schedulingpolicies.ringwright.dev.yaml``.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import AfterValidator, ConfigDict, Field

from .base import (
    API_VERSION,
    DNS_SUBDOMAIN,
    LABEL_KEY,
    LABEL_VALUE,
    QUANTITY,
    ApiModel,
    cel,
    validations,
)
from .models import MAX_PS, MAX_WORKERS, RackPacking
from .templates_policy import TemplateLimits

DEFAULT_POLICY_NAME = "default"
RACK_LABEL = "ringwright.dev/rack"
NVLINK_DOMAIN_LABEL = "nvidia.com/gpu.clique"
GPU_MODEL_LABEL = "nvidia.com/gpu.product"
GPU_RESOURCE = "nvidia.com/gpu"

LabelKey = Annotated[str, Field(min_length=1, max_length=316, pattern=LABEL_KEY)]
GpuModelName = Annotated[str, Field(min_length=1, max_length=63, pattern=LABEL_VALUE)]
PriorityClassName = Annotated[str, Field(min_length=1, max_length=253, pattern=DNS_SUBDOMAIN)]


def _distinct(values: list[str]) -> list[str]:
    """Refuse repeated entries, as the API server does for ``x-kubernetes-list-type: set``."""
    repeated = sorted({v for v in values if values.count(v) > 1})
    if repeated:
        raise ValueError(f"repeated entries: {', '.join(repeated)}")
    return values


class NodeLabelKeys(ApiModel):
    """Node label keys that describe where a node sits and what GPUs it has."""

    model_config = ConfigDict(
        json_schema_extra=validations(
            cel(
                "self.rack != self.nvlinkDomain && self.rack != self.gpuModel"
                " && self.nvlinkDomain != self.gpuModel",
                "spec.nodeLabels.rack, spec.nodeLabels.nvlinkDomain and "
                "spec.nodeLabels.gpuModel must be three different keys",
            )
        )
    )

    rack: LabelKey = Field(
        default=RACK_LABEL, description="Label whose value names the node's rack (its ToR switch)."
    )
    nvlink_domain: LabelKey = Field(
        default=NVLINK_DOMAIN_LABEL,
        description="Label whose value names the node's NVLink domain (NVSwitch island).",
    )
    gpu_model: LabelKey = Field(
        default=GPU_MODEL_LABEL, description="Label whose value names the node's GPU model."
    )
    spine: LabelKey | None = Field(
        default=None,
        description="Label whose value names the aggregation switch above the node's rack; "
        "racks sharing it are neighbours for ps placement. Unset: all racks are neighbours.",
    )


class PriorityClasses(ApiModel):
    """PriorityClass names per role; the ps class must rank above the worker class."""

    model_config = ConfigDict(
        json_schema_extra=validations(
            cel(
                "self.ps != self.worker",
                "spec.priorityClasses.ps must differ from spec.priorityClasses.worker: "
                "ps pods run at a higher priority than workers",
                ".ps",
            )
        )
    )

    worker: PriorityClassName = Field(
        default="ringwright-worker", description="PriorityClass of worker pods."
    )
    ps: PriorityClassName = Field(
        default="ringwright-ps",
        description="PriorityClass of ps pods; higher than the worker one, so a ps pod can "
        "preempt lower-priority pods.",
    )


class PSPinning(ApiModel):
    """Guaranteed QoS with whole CPUs for ps pods, so a static CPU manager pins them."""

    enabled: bool = Field(
        default=True,
        description="true: ps containers get integer CPUs and limits equal to requests.",
    )
    default_cpus: int = Field(
        default=4,
        ge=1,
        le=256,
        description="CPUs for a ps container whose template requests none; a fractional "
        "request is rounded up to whole CPUs.",
    )
    default_memory: str = Field(
        default="8Gi",
        max_length=64,
        pattern=QUANTITY,
        description="Memory for a ps container whose template requests none.",
    )


class NodeLoss(ApiModel):
    """How soon members on a lost node, or members that stay Unready, are replaced."""

    toleration_seconds: int = Field(
        default=30, ge=0, le=3600,
        description="tolerationSeconds of the NoExecute tolerations for "
        "node.kubernetes.io/not-ready and /unreachable on every pod: Kubernetes evicts a "
        "pod this long after its node is lost (its own default is 300 s).",
    )
    unready_seconds: int = Field(
        default=60, ge=1, le=3600,
        description="A pod whose node has been NotReady this long, or a running pod that "
        "has been Unready this long, is lost: it is deleted, replaced, and counted toward "
        "spec.runPolicy.backoffLimit.",
    )


class Stragglers(ApiModel):
    """When a member slow for good is replaced (the node it ran on is avoided for a while)."""

    enabled: bool = Field(
        default=True,
        description="false: slow members are never flagged, avoided or replaced.")
    factor: float = Field(
        default=1.5, ge=1.1, le=100.0,
        description="A member is slow when the median time of its steps, less the time "
        "it waited for peers in the gradient all-reduce, exceeds its peers' median by this "
        "factor.")
    window_seconds: int = Field(
        default=300, ge=10, le=86400,
        description="A member must stay slow this long before anything is done: a one-off "
        "pause (a GC, a page-cache flush, a 30 s hiccup) costs nothing.")
    avoid_seconds: int = Field(
        default=3600, ge=0, le=604800,
        description="How long the job's new pods stay off the node a straggler ran on "
        "(a record in the job's status.avoidedNodes, not a taint: a slow GPU or NIC is "
        "this job's finding, and other tenants' pods keep the node).")


class PolicyLimits(ApiModel):
    """Upper bounds for every job placed by this policy."""

    max_workers_per_job: int = Field(
        default=1024, ge=1, le=MAX_WORKERS, description="Most workers one job may have."
    )
    max_racks_per_job: int | None = Field(
        default=None, ge=1, le=1024, description="Most racks one job may span. Unset: no bound."
    )
    max_ps_per_job: int = Field(
        default=64, ge=1, le=MAX_PS, description="Most ps pods one job may have."
    )


class SchedulingPolicySpec(ApiModel):
    """How the operator places jobs that name this policy."""

    node_labels: NodeLabelKeys = Field(
        default_factory=NodeLabelKeys, description="Topology and GPU-model label keys."
    )
    gpu_resource: LabelKey = Field(
        default=GPU_RESOURCE, description="Extended resource name of a GPU on nodes."
    )
    priority_classes: PriorityClasses = Field(
        default_factory=PriorityClasses, description="PriorityClass per role."
    )
    ps_pinning: PSPinning = Field(
        default_factory=PSPinning, description="Whole-CPU Guaranteed QoS for ps pods."
    )
    allowed_gpu_models: Annotated[list[GpuModelName], AfterValidator(_distinct)] = Field(
        default_factory=list,
        max_length=64,
        description="GPU models jobs may use, in order of preference. Empty: any model.",
        json_schema_extra={"x-kubernetes-list-type": "set"},
    )
    rack_packing: RackPacking = Field(
        default=RackPacking.REQUIRED,
        description="Required: pods may only bind inside the rack set the planner chose. "
        "Preferred: the rack set only steers the scheduler.",
    )
    limits: PolicyLimits = Field(default_factory=PolicyLimits, description="Per-job bounds.")
    templates: TemplateLimits = Field(
        default_factory=TemplateLimits,
        description="What jobs' pod templates may ask for (host namespaces, privilege, "
        "capabilities, host paths, nodeName, ServiceAccounts, root); refused by default.")
    node_loss: NodeLoss = Field(
        default_factory=NodeLoss,
        description="Replacing members on NotReady nodes and members that stay Unready.")
    stragglers: Stragglers = Field(
        default_factory=Stragglers,
        description="Replacing members that stay slower than their peers.")
    gang_timeout_seconds: int = Field(
        default=300, ge=10, le=86400,
        description="A job whose new pods stay unbound this long withdraws them and is "
        "placed again: the scheduler could not follow the plan (a node went away, or room "
        "was taken by pods the plan could not count).")


class SchedulingPolicy(ApiModel):
    """Cluster-wide placement rules for training jobs."""

    api_version: str = Field(default=API_VERSION, description="API group and version.")
    kind: str = Field(default="SchedulingPolicy", description="Object kind.")
    metadata: dict[str, Any] = Field(default_factory=dict, description="Standard metadata.")
    spec: SchedulingPolicySpec = Field(
        default_factory=SchedulingPolicySpec, description="The placement rules."
    )
