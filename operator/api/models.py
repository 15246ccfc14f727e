"""The ``TrainingJob`` API (``ringwright.dev/v1alpha1``, namespaced, short name ``tj``).

These models generate ``crds/trainingjobs.ringwright.dev.yaml``: descriptions become
``kubectl explain`` text, bounds and enums become schema constraints, and the
``x-kubernetes-validations`` entries are the cross-field rules the API server
enforces before the operator ever sees an object.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, field_serializer, model_validator
from pydantic.config import JsonDict

from ringwright.world import (
    AUTO_MAX_STEPS,
    AUTO_MIN_STEPS,
    Backend,
    HierarchicalAllReduce,
    LRRule,
    Mode,
    generation_from_legacy,
)

from ..plan.manifests import RESERVED_PREFIX
from .base import (
    API_VERSION,
    DNS_SUBDOMAIN,
    LABEL_VALUE,
    ApiModel,
    cel,
    immutable,
    validations,
)

MAX_WORKERS = 10_000
"""Upper bound of any worker count; also bounds the cost of CEL rules over counts."""
MAX_PS = 256
MAX_NAME_LENGTH = 50
"""Names derive from the job name plus a suffix; 50 leaves room for ``-worker-<n>`` within
the 63 characters of a pod hostname (``-reports`` and ``-world`` are shorter)."""
DNS_1035 = "^[a-z]([-a-z0-9]*[a-z0-9])?$"
"""A DNS-1035 label: what a Service name (the job's headless service) must be."""
MAX_TEMPLATE_KEYS = 64
"""Most labels (and annotations) a template may carry; also bounds the cost of CEL over them."""
DEFAULT_STALENESS = 8
"""spec.ps.staleness when unset (the runtime applies the same default)."""
DEFAULT_STARTUP_GRACE_SECONDS = 600
"""startupGraceSeconds when unset: room for a multi-GB image pull or a long data load."""
MAX_STARTUP_GRACE_SECONDS = 86400


def _startup_grace(role: str) -> Any:
    """The ``startupGraceSeconds`` field of a role (``workers`` or ``ps``)."""
    return Field(
        default=DEFAULT_STARTUP_GRACE_SECONDS,
        ge=0,
        le=MAX_STARTUP_GRACE_SECONDS,
        description=f"How long a {role} pod's training container may run without ever "
        "having been Ready before the SchedulingPolicy's nodeLoss.unreadySeconds start to "
        "count: a slow start (loading data, warming up) is not a lost member. Counted from "
        "the container's start, again after each restart; a pod that was Ready in its "
        "container and then turns Unready gets no grace.",
    )


class RackPacking(StrEnum):
    """Whether the chosen rack set binds pods (Required) or only steers them (Preferred)."""

    REQUIRED = "Required"
    PREFERRED = "Preferred"


class CleanPodPolicy(StrEnum):
    """Which pods to delete once a job has finished."""

    ALL = "All"
    RUNNING = "Running"
    NONE = "None"


class JobPhase(StrEnum):
    """Where a job is in its life; the operator owns the transitions."""

    PENDING = "Pending"
    RUNNING = "Running"
    RESTARTING = "Restarting"
    SUSPENDED = "Suspended"
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"


class ConditionStatus(StrEnum):
    TRUE = "True"
    FALSE = "False"
    UNKNOWN = "Unknown"


class PodSpecBody(ApiModel):
    """A pod spec; only ``containers`` is checked here, the rest is kept as written."""

    model_config = ConfigDict(extra="allow")

    containers: list[dict[str, Any]] = Field(
        min_length=1,
        max_length=16,
        description="The pod's containers (core/v1 Container). The first one runs training; "
        "the operator adds GPUs, the environment the runtime needs and, for ps pods, "
        "whole-CPU Guaranteed resources to it.",
    )


def _no_reserved_keys(field: str) -> JsonDict:
    return validations(cel(
        f"self.all(k, !k.startsWith('{RESERVED_PREFIX}'))",
        f"spec.*.template.metadata.{field}: keys under {RESERVED_PREFIX} are the operator's "
        "(they tie a pod to its job); remove them from the template",
    ))


class TemplateMetadata(ApiModel):
    """The labels and annotations of a pod template; other metadata fields are kept as written."""

    model_config = ConfigDict(extra="allow")

    labels: dict[str, Annotated[str, Field(max_length=63)]] = Field(
        default_factory=dict,
        max_length=MAX_TEMPLATE_KEYS,
        description=f"Labels copied onto every pod of this role; none under {RESERVED_PREFIX}.",
        json_schema_extra=_no_reserved_keys("labels"),
    )
    annotations: dict[str, str] = Field(
        default_factory=dict,
        max_length=MAX_TEMPLATE_KEYS,
        description=f"Annotations copied onto every pod of this role; none under "
        f"{RESERVED_PREFIX}.",
        json_schema_extra=_no_reserved_keys("annotations"),
    )


class PodTemplate(ApiModel):
    """A PodTemplateSpec: the pod every replica of a role starts from."""

    metadata: TemplateMetadata = Field(
        default_factory=TemplateMetadata,
        description="Labels and annotations copied onto every pod of this role.",
    )
    spec: PodSpecBody = Field(
        description="The pod spec (core/v1 PodSpec). Placement (affinity, priority class) "
        "is the operator's: values set here for those fields are replaced.",
    )


class WorkerSpec(ApiModel):
    """The elastic worker set."""

    model_config = ConfigDict(
        json_schema_extra=validations(
            cel(
                "self.min <= self.replicas",
                "spec.workers.min must not exceed spec.workers.replicas",
                ".min",
            ),
            cel(
                "!has(self.max) || self.replicas <= self.max",
                "spec.workers.replicas must not exceed spec.workers.max",
                ".replicas",
            ),
            cel(
                "!has(self.max) || self.min <= self.max",
                "spec.workers.min must not exceed spec.workers.max",
                ".min",
            ),
        )
    )

    min: int = Field(
        default=1,
        ge=1,
        le=MAX_WORKERS,
        description="Fewest workers the job runs with. The job starts only when this many "
        "fit at once (gang), and fails when it stays below this for longer than the grace "
        "period.",
    )
    max: int | None = Field(
        default=None,
        ge=1,
        le=MAX_WORKERS,
        description="Most workers the job may be scaled to. Unset: bounded only by the "
        "SchedulingPolicy's limits.maxWorkersPerJob.",
    )
    replicas: int = Field(
        ge=1,
        le=MAX_WORKERS,
        description="Workers wanted now, between min and max. The scale subresource sets "
        "this field, so `kubectl scale tj/NAME --replicas=N` resizes the job.",
    )
    template: PodTemplate = Field(description="Pod template of every worker.")
    startup_grace_seconds: int = _startup_grace("worker")
    num_proc_per_node: Annotated[int, Field(ge=1, le=16)] | Literal["auto"] = Field(
        default="auto",
        description="Training processes (local ranks) per worker pod, each bound to one of "
        "the pod's GPUs. auto: one per GPU when spec.gpusPerWorker > 1, else 1. With more "
        "than one, the operator wraps the training container's command in the pod entry "
        "point (python -m ringwright.runtime.launch), which starts one process per local "
        "rank; the container must set command. Immutable.",
        json_schema_extra={
            "x-kubernetes-int-or-string": True,
            **validations(
                cel("type(self) == int ? (self >= 1 && self <= 16) : self == 'auto'",
                    "spec.workers.numProcPerNode must be auto or a number from 1 to 16"),
                cel("self == oldSelf", "spec.workers.numProcPerNode is immutable"),
            ),
        },
    )


class PSConsistency(StrEnum):
    """When a pushed gradient updates the parameters."""

    SYNC = "Sync"
    ASYNC = "Async"


class PSSpec(ApiModel):
    """Parameter-server pods; only in ParameterServer mode."""

    model_config = ConfigDict(
        json_schema_extra=validations(
            cel(
                "self.consistency == 'Async' || !has(self.staleness)",
                "spec.ps.staleness applies only to consistency Async",
                ".staleness",
            ),
            cel(
                "self.consistency == 'Sync' || !has(self.backupWorkers)",
                "spec.ps.backupWorkers applies only to consistency Sync",
                ".backupWorkers",
            ),
            cel(
                "!has(self.shards) || self.replicas <= self.shards",
                "spec.ps.replicas must not exceed spec.ps.shards: a server past the last "
                "shard would hold none (the shards are fixed when the job is created)",
                ".replicas",
            ),
            cel(
                "has(self.shards) || self.replicas <= oldSelf.replicas",
                "spec.ps.replicas can grow only when spec.ps.shards is set: "
                "without it the job has one shard per server it started with, so a new server "
                "would hold none; create the job with spec.ps.shards at the most servers it may "
                "reach",
                ".replicas",
            ),
            cel(
                "has(self.shards) == has(oldSelf.shards)",
                "spec.ps.shards is immutable: it cannot be added or removed",
                ".shards",
            ),
        )
    )

    replicas: int = Field(
        default=1,
        ge=1,
        le=MAX_PS,
        description="Number of ps pods; parameters are sharded across them. May change on "
        "a running job: the servers hand shards over live. A server taken away (its index "
        "at or past the new count) hands its shards to the others, then exits; a new one "
        "takes its shards once it is ready.",
    )
    shards: int | None = Field(
        default=None,
        ge=1,
        le=MAX_PS,
        description="Shards of the model, fixed for the job's life; spec.ps.replicas may not "
        "exceed it. Unset: one per server when the first worker creates them, and "
        "spec.ps.replicas may then shrink but not grow. Immutable.",
        json_schema_extra=immutable("spec.ps.shards"),
    )
    template: PodTemplate = Field(
        description="Pod template of every ps pod. Its first container gets whole-CPU "
        "Guaranteed resources when the SchedulingPolicy pins ps CPUs.",
    )
    consistency: PSConsistency = Field(
        default=PSConsistency.SYNC,
        description="Sync: a step's update applies once every current worker (less "
        "backupWorkers) has pushed for it. Async: every push applies at once unless it was "
        "computed from parameters more than staleness versions old; then it is dropped and "
        "counted.",
    )
    staleness: int | None = Field(
        default=None,
        ge=0,
        le=1_000_000,
        description="Async only: the bound τ on how many versions old a push may be. "
        f"Unset: {DEFAULT_STALENESS}.",
    )
    backup_workers: int | None = Field(
        default=None,
        ge=0,
        le=MAX_WORKERS,
        description="Sync only: a round completes when all but this many workers pushed; the "
        "latest pushes are dropped as stale. Must be below spec.workers.replicas. Unset: 0.",
    )
    requeue_stale: bool = Field(
        default=False,
        description="Train the samples whose gradients were dropped as stale again (they are "
        "counted either way).",
    )
    startup_grace_seconds: int = _startup_grace("ps")


class TopologySpec(ApiModel):
    """How tightly this job wants to be packed (the SchedulingPolicy sets the bounds), and
    how its collectives use the racks it lands on."""

    rack_packing: RackPacking | None = Field(
        default=None,
        description="Required: pods may only bind inside the chosen rack set. Preferred: the "
        "rack set only steers the scheduler. Unset: the SchedulingPolicy's rackPacking. "
        "A job can tighten the policy's choice, never loosen it.",
    )
    max_racks: int | None = Field(
        default=None,
        ge=1,
        le=1024,
        description="Most racks the workers may span. Unset: the SchedulingPolicy's "
        "limits.maxRacksPerJob.",
    )
    hierarchical_all_reduce: HierarchicalAllReduce = Field(
        default=HierarchicalAllReduce.AUTO,
        description="Auto: when the world spans more than one rack, gradients are reduced "
        "inside each rack, all-reduced across racks by one member per rack and shared back "
        "inside the rack, so the slow spine carries fewer, larger transfers. Enabled: always "
        "(a one-rack world then runs the flat ring). Disabled: always the flat ring.",
    )


class CheckpointSpec(ApiModel):
    """Where and how often the runtime checkpoints."""

    model_config = ConfigDict(
        json_schema_extra=validations(
            cel(
                "self.path != '' || (type(self.intervalSteps) == int && self.intervalSteps == 0"
                " && self.intervalSeconds == 0)",
                "spec.checkpoint.intervalSteps and spec.checkpoint.intervalSeconds "
                "need spec.checkpoint.path",
                ".path",
            ),
            cel(
                "self.autoMinSteps <= self.autoMaxSteps",
                "spec.checkpoint.autoMinSteps must not exceed spec.checkpoint.autoMaxSteps",
                ".autoMinSteps",
            ),
            cel(
                "self.path.startsWith('s3://') || (self.credentialsSecret == '' "
                "&& self.endpoint == '' && self.region == '')",
                "spec.checkpoint.credentialsSecret, endpoint and region are for object "
                "storage: set spec.checkpoint.path to s3://<bucket>/<prefix>, or remove them",
                ".path",
            ),
        )
    )

    path: str = Field(
        default="",
        max_length=4096,
        description="Where checkpoints go: a directory shared by all pods (a mounted "
        "volume), or s3://<bucket>/<prefix> in S3-compatible object storage. Empty: none.",
    )
    credentials_secret: str = Field(
        default="",
        max_length=253,
        description="For an s3:// path: a Secret in the job's namespace whose keys "
        "AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY and (optional) AWS_SESSION_TOKEN become "
        "the pods' variables of the same names. Empty: the pods' own credentials (e.g. "
        "from a service account's cloud identity).",
    )
    endpoint: str = Field(
        default="",
        max_length=2048,
        description="For an s3:// path: the URL of an S3-compatible server (MinIO, Ceph, "
        "...), set as AWS_ENDPOINT_URL_S3. Empty: AWS S3 itself.",
    )
    region: str = Field(
        default="",
        max_length=64,
        description="For an s3:// path: the bucket's region, set as AWS_REGION. "
        "Empty: us-east-1, or what the pod's environment says.",
    )
    interval_steps: Annotated[int, Field(ge=0)] | Literal["Auto"] = Field(
        default=0,
        description="Checkpoint every this many steps; 0: not by steps. Auto: every "
        "sqrt(2 x MTBF x cost) seconds of steps (Young/Daly), from the measured time a "
        "checkpoint write takes (cost) and the observed time between whole-job restarts "
        "(MTBF; until the first restart, the time run so far), within autoMinSteps and "
        "autoMaxSteps; status.checkpointInterval shows the choice.",
        json_schema_extra={
            "x-kubernetes-int-or-string": True,
            **validations(cel("type(self) == int ? self >= 0 : self == 'Auto'",
                              "spec.checkpoint.intervalSteps must be Auto or a number >= 0")),
        },
    )
    auto_min_steps: int = Field(
        default=AUTO_MIN_STEPS, ge=1, le=10_000_000,
        description="intervalSteps Auto: fewest steps between checkpoints (the first "
        "checkpoint comes after this many, to measure the write cost).")
    auto_max_steps: int = Field(
        default=AUTO_MAX_STEPS, ge=1, le=10_000_000,
        description="intervalSteps Auto: most steps between checkpoints, however rare "
        "restarts are.")
    interval_seconds: int = Field(
        default=0, ge=0, description="Checkpoint every this many seconds; 0: not by time."
    )
    keep: int = Field(
        default=3, ge=1, le=1000, description="How many valid checkpoints to keep."
    )


class LRScalingSpec(ApiModel):
    """How the learning rate follows the world size."""

    model_config = ConfigDict(
        json_schema_extra=validations(
            cel(
                "self.rule == 'none' || has(self.baseWorldSize)",
                "spec.lrScaling.baseWorldSize is required with rule linear or sqrt: set it "
                "to the world size the configured learning rate was tuned for, or use "
                "rule: none",
                ".baseWorldSize",
            )
        )
    )

    rule: LRRule = Field(
        default=LRRule.NONE,
        description="none (default): the learning rate the script sets is used unchanged "
        "at every world size. linear: lr x size / baseWorldSize; sqrt: "
        "lr x √(size / baseWorldSize); both require baseWorldSize.",
    )
    base_world_size: int | None = Field(
        default=None,
        ge=1,
        le=MAX_WORKERS,
        description="World size the configured learning rate was tuned for. Required with "
        "rule linear or sqrt; unused with none.",
    )
    warmup_steps: int = Field(
        default=0,
        ge=0,
        description="Steps over which a rescaled learning rate ramps to its new value.",
    )


class FaultToleranceSpec(ApiModel):
    """How members tell a slow peer from a dead one."""

    model_config = ConfigDict(
        json_schema_extra=validations(
            cel(
                "self.failureDetectSeconds < self.collectiveTimeoutSeconds",
                "spec.faultTolerance.failureDetectSeconds must be shorter than "
                "collectiveTimeoutSeconds: heartbeats find the dead, the collective "
                "timeout is a last resort",
                ".failureDetectSeconds",
            ),
            cel(
                "self.stallTimeoutSeconds == 0 || "
                "self.failureDetectSeconds < self.stallTimeoutSeconds",
                "spec.faultTolerance.stallTimeoutSeconds must be 0 (off) or longer than "
                "failureDetectSeconds",
                ".stallTimeoutSeconds",
            ),
        )
    )

    failure_detect_seconds: int = Field(
        default=3,
        ge=1,
        le=600,
        description="A member whose heartbeats (sent from a side thread, not the training "
        "loop) stop for this long is dead: its peers abort, roll back and report it.",
    )
    collective_timeout_seconds: int = Field(
        default=1800,
        ge=2,
        le=86400,
        description="Last-resort limit of one collective. Long: a peer that is late but "
        "alive is waited for, never rolled back for.",
    )
    stall_timeout_seconds: int = Field(
        default=300,
        ge=0,
        le=86400,
        description="A member whose training loop makes no progress for this long is hung: "
        "its readiness fails and it leaves the world. 0: never.",
    )


class RunPolicy(ApiModel):
    """Lifecycle knobs, named as in Kubernetes Jobs."""

    suspend: bool = Field(
        default=False,
        description="true: delete the job's pods but keep the job; false again recreates them.",
    )
    backoff_limit: int = Field(
        default=6,
        ge=0,
        le=1000,
        description="Pod replacements allowed (with exponential backoff) before the job fails.",
    )
    active_deadline_seconds: int | None = Field(
        default=None,
        ge=1,
        description="Seconds after creation (metadata.creationTimestamp, so time spent "
        "Pending or Suspended counts) before the job is failed: DeadlineExceeded, or "
        "NeverSchedulable when it never started. Unset: no deadline.",
    )
    ttl_seconds_after_finished: int | None = Field(
        default=None,
        ge=0,
        description="Seconds after finishing before the job is deleted. Unset: kept.",
    )
    clean_pod_policy: CleanPodPolicy = Field(
        default=CleanPodPolicy.RUNNING,
        description="Pods deleted when the job finishes: All, Running (those still running), "
        "or None.",
    )


_SPEC_RULES = (
    cel(
        "self.mode != 'ParameterServer' || has(self.ps)",
        "spec.ps is required when spec.mode is ParameterServer",
    ),
    cel(
        "self.mode == 'ParameterServer' || !has(self.ps)",
        "spec.ps is only allowed when spec.mode is ParameterServer",
        ".ps",
    ),
    cel(
        "!has(self.ps) || !has(self.ps.backupWorkers) || "
        "self.ps.backupWorkers < self.workers.replicas",
        "spec.ps.backupWorkers must be below spec.workers.replicas: a sync round needs a push",
        ".ps.backupWorkers",
    ),
    cel(
        "self.mode != 'ParameterServer' || type(self.checkpoint.intervalSteps) == int",
        "spec.checkpoint.intervalSteps: Auto is for AllReduce jobs; parameter servers "
        "checkpoint every intervalSteps versions, so give a number",
        ".checkpoint.intervalSteps",
    ),
    cel(
        "!has(self.gpuModel) || self.gpusPerWorker > 0",
        "spec.gpuModel needs spec.gpusPerWorker > 0",
        ".gpuModel",
    ),
    cel(
        "type(self.workers.numProcPerNode) == string || self.gpusPerWorker == 0 || "
        "self.workers.numProcPerNode == 1 || self.workers.numProcPerNode == self.gpusPerWorker",
        "spec.workers.numProcPerNode must be 1 or spec.gpusPerWorker: each local rank is "
        "bound to one GPU",
        ".workers.numProcPerNode",
    ),
    cel(
        "has(self.gpuModel) == has(oldSelf.gpuModel)",
        "spec.gpuModel is immutable: it cannot be added or removed",
    ),
)


class TrainingJobSpec(ApiModel):
    """What the user wants trained, and how."""

    model_config = ConfigDict(json_schema_extra=validations(*_SPEC_RULES))

    mode: Mode = Field(
        default=Mode.ALL_REDUCE,
        description="AllReduce: workers average gradients over a ring. ParameterServer: "
        "workers push to and pull from ps pods. Immutable.",
        json_schema_extra=immutable("spec.mode"),
    )
    backend: Backend = Field(
        default=Backend.TORCH,
        description="Collective library the runtime drives: torch (torch.distributed) or "
        "horovod. Immutable.",
        json_schema_extra=immutable("spec.backend"),
    )
    workers: WorkerSpec = Field(description="The elastic worker set.")
    ps: PSSpec | None = Field(
        default=None, description="Parameter servers; required in ParameterServer mode only."
    )
    gpus_per_worker: int = Field(
        default=1,
        ge=0,
        le=16,
        description="GPUs each worker gets, all on one node; 0 trains on CPU. Immutable.",
        json_schema_extra=immutable("spec.gpusPerWorker"),
    )
    gpu_model: Annotated[str, Field(min_length=1, max_length=63, pattern=LABEL_VALUE)] | None = (
        Field(
            default=None,
            description="GPU model (the node label value) every worker must have. Unset: the "
            "operator picks one allowed model for the whole job. Immutable.",
            json_schema_extra=immutable("spec.gpuModel"),
        )
    )
    topology: TopologySpec = Field(
        default_factory=TopologySpec, description="Packing preferences."
    )
    checkpoint: CheckpointSpec = Field(
        default_factory=CheckpointSpec, description="Checkpoint location and cadence."
    )
    lr_scaling: LRScalingSpec = Field(
        default_factory=LRScalingSpec,
        description="Learning-rate rescaling on resize. Off unless asked for: the script's "
        "learning rate is used as is at every world size.",
    )
    run_policy: RunPolicy = Field(default_factory=RunPolicy, description="Lifecycle knobs.")
    fault_tolerance: FaultToleranceSpec = Field(
        default_factory=FaultToleranceSpec,
        description="Failure detection: dead (silent) versus slow (late) members.",
    )
    scheduling_policy_name: str = Field(
        default="default",
        min_length=1,
        max_length=253,
        pattern=DNS_SUBDOMAIN,
        description="Name of the cluster-scoped SchedulingPolicy that places this job. "
        "Immutable.",
        json_schema_extra=immutable("spec.schedulingPolicyName"),
    )


class Condition(ApiModel):
    """One observation about the job, as in metav1.Condition."""

    type: str = Field(max_length=316, description="What this condition is about.")
    status: ConditionStatus = Field(description="True, False or Unknown.")
    reason: str = Field(
        default="", max_length=1024, description="CamelCase cause, for programs."
    )
    message: str = Field(default="", max_length=32768, description="What happened, for people.")
    last_transition_time: str | None = Field(
        default=None,
        json_schema_extra={"format": "date-time"},
        description="When status last changed (RFC 3339).",
    )
    observed_generation: int | None = Field(
        default=None, ge=0, description="metadata.generation this condition was computed from."
    )


class ReplicaStatus(ApiModel):
    """Pod counts of one role."""

    desired: int = Field(default=0, ge=0, description="Pods the spec asks for now.")
    active: int = Field(default=0, ge=0, description="Pods created and not finished.")
    ready: int = Field(default=0, ge=0, description="Pods whose Ready condition is True.")
    succeeded: int = Field(default=0, ge=0, description="Pods that exited 0.")
    failed: int = Field(default=0, ge=0, description="Pods that failed.")


class RackMembers(ApiModel):
    """How many world members sit in one rack."""

    rack: str = Field(description="Rack label value.")
    members: int = Field(ge=0, description="World members in this rack.")


class WorldSummary(ApiModel):
    """A summary of the current world; the full one is in the world ConfigMap."""

    generation: int = Field(default=0, ge=0, description="Bumped at every membership change.")
    epoch: int = Field(
        default=0,
        ge=0,
        description="Deprecated: the generation under its former name, written with the same "
        "value for readers one version older; removed in the next version.",
    )
    size: int = Field(default=0, ge=0, description="Number of ranks in the world: the "
                      "workers times spec.workers.numProcPerNode.")
    gpu_model: str = Field(default="", description="The one GPU model every worker has.")
    racks: int = Field(default=0, ge=0, description="Racks the workers span.")
    cross_rack_edges: int = Field(
        default=0,
        ge=0,
        description="Ring edges that cross a rack boundary (equal to racks when above one).",
    )
    rack_members: list[RackMembers] = Field(
        default_factory=list, description="Members per rack, in ring order."
    )
    ps_servers: int = Field(
        default=0, ge=0, le=MAX_PS,
        description="ParameterServer mode: the servers the world counts, which hold the "
        "shards. Follows spec.ps.replicas: at once when it shrinks, and as each new server "
        "is ready when it grows.")
    config_map: str = Field(default="", description="ConfigMap holding the full world.")

    _legacy_generation = model_validator(mode="before")(generation_from_legacy)

    @field_serializer("epoch")
    def _epoch_is_the_generation(self, _stored: int) -> int:
        """Always the generation: steps change ``generation`` alone."""
        return self.generation


class CheckpointStatus(ApiModel):
    """The newest checkpoint a member reported."""

    path: str = Field(description="Where it was written.")
    step: int = Field(default=0, ge=0, description="Training step it holds.")
    time: str | None = Field(
        default=None,
        json_schema_extra={"format": "date-time"},
        description="When it was completed (RFC 3339).",
    )


class PendingMembership(ApiModel):
    """A membership the operator saw but has not published yet (the settle window)."""

    digest: str = Field(max_length=64, description="Identity of the membership.")
    since: float = Field(description="When it was first seen (seconds since the Unix epoch).")


class PhaseTransition(ApiModel):
    """One step of the job's life: the phase it entered, why, and when."""

    phase: JobPhase = Field(description="The phase entered.")
    reason: str = Field(default="", max_length=1024, description="Why (CamelCase).")
    time: str = Field(json_schema_extra={"format": "date-time"}, description="When.")


class RecoveryStatus(ApiModel):
    """How long the last recovery from a lost pod took, as the operator saw it."""

    failure_time: str = Field(
        json_schema_extra={"format": "date-time"},
        description="When the loss was noticed (the lastFailureTime it answers).",
    )
    seconds: float = Field(
        ge=0, description="From noticing the loss to publishing the next world generation."
    )


class CheckpointIntervalStatus(ApiModel):
    """The step interval checkpoints follow now, as the writing member reports it."""

    steps: int = Field(ge=0, description="Steps between checkpoints; 0: not by steps.")
    auto: bool = Field(default=False, description="Chosen by spec.checkpoint.intervalSteps "
                       "Auto (Young/Daly).")
    write_seconds: float | None = Field(
        default=None, ge=0, description="How long the last checkpoint write took (the cost).")
    mtbf_seconds: float | None = Field(
        default=None, ge=0, description="The observed time between whole-job restarts used "
        "(until the first restart: the time run so far).")


class MemberTime(ApiModel):
    """The per-phase seconds one member process reported last (to count only growth)."""

    since: float = Field(description="When the process started (seconds since the epoch).")
    seconds: dict[str, float] = Field(default_factory=dict, description="Seconds by phase.")


class GoodputStatus(ApiModel):
    """Where the members' time went over the job's life: fractions of their summed time."""

    training: float = Field(default=0.0, ge=0, le=1, description="Steps that moved training "
                            "forward (the goodput).")
    detecting: float = Field(default=0.0, ge=0, le=1, description="Blocked on a failed peer "
                             "until the failure was known.")
    reforming: float = Field(default=0.0, ge=0, le=1, description="Waiting for and forming "
                             "the next world (start-up included).")
    syncing: float = Field(default=0.0, ge=0, le=1, description="Bringing members to one "
                           "state.")
    replaying: float = Field(default=0.0, ge=0, le=1, description="Steps run again after a "
                             "rollback.")
    seconds: dict[str, float] = Field(
        default_factory=dict, description="Member-seconds by phase, summed over the job's "
        "life.")
    members: dict[str, MemberTime] = Field(
        default_factory=dict, max_length=MAX_WORKERS,
        description="The last figures of each member process, by pod name.")


class SlowMember(ApiModel):
    """A member found slower than its peers, not yet for long enough to act."""

    pod: str = Field(description="The member's pod.")
    node: str = Field(default="", description="The node it runs on.")
    since: float = Field(description="When it was first seen slow (seconds since the epoch).")
    ratio: float = Field(ge=0, description="Its step time over its peers' median, last seen.")


class AvoidedNode(ApiModel):
    """A node the job's new pods stay off, until a time."""

    node: str = Field(description="The node's name.")
    until: str = Field(json_schema_extra={"format": "date-time"},
                       description="When the node may be used again (RFC 3339).")
    reason: str = Field(default="", max_length=1024, description="Why it is avoided.")


class TrainingJobStatus(ApiModel):
    """What the operator observed; written by the operator only."""

    phase: JobPhase = Field(default=JobPhase.PENDING, description="Where the job is in its life.")
    conditions: list[Condition] = Field(
        default_factory=list, description="Current observations, one per type."
    )
    observed_generation: int = Field(
        default=0, ge=0, description="metadata.generation this status was computed from."
    )
    workers: ReplicaStatus = Field(default_factory=ReplicaStatus, description="Worker pods.")
    ps: ReplicaStatus | None = Field(default=None, description="Parameter-server pods.")
    restarts: int = Field(default=0, ge=0, description="Pods replaced after a failure.")
    failures_since_whole: int = Field(
        default=0, ge=0, description="Failures counted since a world last held every worker "
        "(and parameter server) the spec asks for: the replacement backoff doubles with each, "
        "so a crash loop slows down while a job that recovers starts again from the base "
        "delay.")
    world: WorldSummary = Field(default_factory=WorldSummary, description="The current world.")
    last_checkpoint: CheckpointStatus | None = Field(
        default=None, description="The newest checkpoint."
    )
    selector: str = Field(
        default="", description="Label selector of the worker pods (for the scale subresource)."
    )
    start_time: str | None = Field(
        default=None, json_schema_extra={"format": "date-time"}, description="When it started."
    )
    completion_time: str | None = Field(
        default=None, json_schema_extra={"format": "date-time"}, description="When it finished."
    )
    last_failure_time: str | None = Field(
        default=None,
        json_schema_extra={"format": "date-time"},
        description="When a pod was last lost; replacements back off from here.",
    )
    last_recovery: RecoveryStatus | None = Field(
        default=None, description="The last recovery from a lost pod."
    )
    below_min_since: str | None = Field(
        default=None,
        json_schema_extra={"format": "date-time"},
        description="Since when fewer than spec.workers.min workers are ready.",
    )
    workers_finished_time: str | None = Field(
        default=None,
        json_schema_extra={"format": "date-time"},
        description="ParameterServer mode: when the last worker finished the data; ps pods "
        "are waited for from here.",
    )
    lost_pods: list[str] = Field(
        default_factory=list,
        max_length=MAX_WORKERS,
        description="Lost pods (name/uid) already counted in restarts, so each counts once.",
    )
    candidate: PendingMembership | None = Field(
        default=None, description="A membership waiting out the settle window."
    )
    phase_history: list[PhaseTransition] = Field(
        default_factory=list,
        max_length=32,
        description="The latest phase transitions, oldest first (Pending -> Running -> "
        "Suspended -> Pending -> ...).",
    )
    container_restarts: dict[str, int] = Field(
        default_factory=dict,
        max_length=MAX_WORKERS,
        description="Container restarts (by pod name/uid) already counted in restarts.",
    )
    checkpoint_interval: CheckpointIntervalStatus | None = Field(
        default=None, description="The step interval checkpoints follow now.")
    goodput: GoodputStatus | None = Field(
        default=None, description="Where the members' time went: training, detecting, "
        "re-forming, syncing, replaying.")
    slow_members: list[SlowMember] = Field(
        default_factory=list, max_length=MAX_WORKERS,
        description="Members slower than their peers, waiting out the SchedulingPolicy's "
        "stragglers.windowSeconds.")
    avoided_nodes: list[AvoidedNode] = Field(
        default_factory=list, max_length=MAX_WORKERS,
        description="Nodes this job's new pods stay off (stragglers ran there).")


class TrainingJob(ApiModel):
    """An elastic, topology-aware distributed training job."""

    model_config = ConfigDict(
        json_schema_extra=validations(
            cel(
                f"size(self.metadata.name) <= {MAX_NAME_LENGTH}",
                f"metadata.name must be at most {MAX_NAME_LENGTH} characters: pod, "
                "service and config map names are derived from it",
            ),
            cel(
                f"self.metadata.name.matches('{DNS_1035}')",
                "metadata.name must be a DNS-1035 label (lowercase letters, digits and '-', "
                "starting with a letter, ending with a letter or digit): the job's headless "
                "service, its pods (<name>-worker-<n>) and config maps (<name>-world, "
                "<name>-reports) take their names from it",
            ),
        )
    )

    api_version: str = Field(default=API_VERSION, description="API group and version.")
    kind: str = Field(default="TrainingJob", description="Object kind.")
    metadata: dict[str, Any] = Field(default_factory=dict, description="Standard metadata.")
    spec: TrainingJobSpec = Field(description="What to train and how.")
    status: TrainingJobStatus | None = Field(default=None, description="What the operator saw.")
