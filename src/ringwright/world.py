"""The world contract between the operator and the runtime.

The operator publishes a :class:`World` for every job in a ConfigMap that the job's
pods may read; the runtime in each pod follows it. Pods talk back through a second,
patch-only ConfigMap holding one :class:`Report` per pod. This module is imported by
both sides, so it depends on pydantic alone: never on kopf, never on torch.
"""

from __future__ import annotations

import json
from enum import StrEnum
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

SCHEMA_VERSION = 1
"""Bump when a change would make an older reader misread a world."""

WORLD_KEY = "world.json"
"""Key of the world document inside the world ConfigMap."""

DEFAULT_STORE_PORT = 29400
DEFAULT_METRICS_PORT = 9401
"""Where every training process serves its Prometheus metrics (the pod port ``metrics``)."""
DEFAULT_PS_PORT = 29600
"""Where a parameter server serves shards (``RINGWRIGHT_PS_PORT`` overrides it); the PS
pod's readiness probe checks this port."""
PS_PORT_ENV = "RINGWRIGHT_PS_PORT"

LEGACY_GENERATION_KEY = "epoch"
"""The name one version older gives the generation in worlds, reports and the job
status; still read when ``generation`` is missing and still written beside it, so an
operator and a runtime one version apart understand each other. Deprecated: removed
in the next version."""


def generation_from_legacy(data: Any) -> Any:
    """``data`` (a document about to be validated) with ``generation`` taken from its
    :data:`LEGACY_GENERATION_KEY` when it carries only that one (written one version
    older)."""
    if isinstance(data, dict) and "generation" not in data and LEGACY_GENERATION_KEY in data:
        return {**data, "generation": data[LEGACY_GENERATION_KEY]}
    return data


def world_configmap_name(job: str) -> str:
    """Name of the ConfigMap that carries ``job``'s world."""
    return f"{job}-world"


def reports_configmap_name(job: str) -> str:
    """Name of the ConfigMap that ``job``'s pods merge-patch their reports into."""
    return f"{job}-reports"


class Env:
    """Environment variables the operator sets on every training container."""

    JOB_NAME = "RINGWRIGHT_JOB_NAME"
    NAMESPACE = "RINGWRIGHT_NAMESPACE"
    POD_NAME = "RINGWRIGHT_POD_NAME"
    POD_UID = "RINGWRIGHT_POD_UID"
    """The pod's uid: a process of a deleted pod never takes the place of its namesake."""
    POD_IP = "RINGWRIGHT_POD_IP"
    ROLE = "RINGWRIGHT_ROLE"
    WORLD_CONFIGMAP = "RINGWRIGHT_WORLD_CONFIGMAP"
    REPORTS_CONFIGMAP = "RINGWRIGHT_REPORTS_CONFIGMAP"
    BACKEND = "RINGWRIGHT_BACKEND"
    HEALTH_FILE = "RINGWRIGHT_HEALTH_FILE"
    TERMINATION_GRACE = "RINGWRIGHT_TERMINATION_GRACE_SECONDS"
    METRICS_PORT = "RINGWRIGHT_METRICS_PORT"
    """Serve the runtime's Prometheus metrics on this port of the pod IP (0: off)."""
    """The pod's terminationGracePeriodSeconds, for the final checkpoint on SIGTERM."""
    WORLD_FILE = "RINGWRIGHT_WORLD_FILE"
    """Local runs only: follow a world file instead of the Kubernetes API."""
    REPORTS_DIR = "RINGWRIGHT_REPORTS_DIR"
    """Local runs only: write reports as files here, for the local launcher to read."""
    FAILURE_DETECT = "RINGWRIGHT_FAILURE_DETECT_SECONDS"
    """spec.faultTolerance.failureDetectSeconds: silence that makes a member dead."""
    COLLECTIVE_TIMEOUT = "RINGWRIGHT_COLLECTIVE_TIMEOUT_SECONDS"
    """spec.faultTolerance.collectiveTimeoutSeconds: last-resort limit of one collective."""
    STALL_TIMEOUT = "RINGWRIGHT_STALL_TIMEOUT_SECONDS"
    """spec.faultTolerance.stallTimeoutSeconds: no progress for this long makes a member hung."""
    READINESS_PORT = "RINGWRIGHT_READINESS_PORT"
    """Port of the runtime's HTTP readiness endpoint (``/readyz``)."""
    REPORT_KEY = "RINGWRIGHT_REPORT_KEY"
    """This pod's own key for sealing its reports (set by the operator per pod)."""
    JOIN_TOKEN_FILE = "RINGWRIGHT_JOIN_TOKEN_FILE"
    """File holding the job's join token (mounted from the job's Secret): every value
    in the generation stores is tagged with it, so only the job's own pods can claim a rank."""
    PS_CONSISTENCY = "RINGWRIGHT_PS_CONSISTENCY"
    """spec.ps.consistency (Sync or Async) of a ParameterServer job."""
    PS_STALENESS = "RINGWRIGHT_PS_STALENESS"
    """spec.ps.staleness: async pushes more than this many versions old are dropped."""
    PS_BACKUP_WORKERS = "RINGWRIGHT_PS_BACKUP_WORKERS"
    """spec.ps.backupWorkers: a sync round completes without this many workers."""
    PS_REQUEUE_STALE = "RINGWRIGHT_PS_REQUEUE_STALE"
    """spec.ps.requeueStale ("true"/"false"): train samples of dropped pushes again."""
    PS_SHARDS = "RINGWRIGHT_PS_SHARDS"
    """spec.ps.shards: the model's shards, fixed for the job's life (unset: one per server
    when the first worker creates them)."""
    PROCS_PER_POD = "RINGWRIGHT_PROCS_PER_POD"
    """spec.workers.numProcPerNode resolved to a number: training processes (local ranks)
    the pod's entry point starts (``ringwright.runtime.launch``)."""
    LOCAL_RANK = "LOCAL_RANK"
    """This process's rank inside its pod (torchrun's name), set by the pod's entry point."""
    LOCAL_WORLD_SIZE = "LOCAL_WORLD_SIZE"
    """Local ranks of the pod (torchrun's name), set by the pod's entry point."""


class Backend(StrEnum):
    TORCH = "torch"
    HOROVOD = "horovod"


class Mode(StrEnum):
    ALL_REDUCE = "AllReduce"
    PARAMETER_SERVER = "ParameterServer"


class LRRule(StrEnum):
    LINEAR = "linear"
    SQRT = "sqrt"
    NONE = "none"


class HierarchicalAllReduce(StrEnum):
    """Whether gradients are all-reduced in two levels (inside racks, then across them)."""

    AUTO = "Auto"
    """Hierarchical when the world spans more than one rack, flat otherwise."""
    ENABLED = "Enabled"
    DISABLED = "Disabled"


class _Wire(BaseModel):
    """Base for wire types: camelCase on the wire, frozen, unknown keys ignored.

    Ignoring unknown keys lets an older runtime read a newer world of the same
    schema version (additive changes only; anything else bumps the version).
    """

    model_config = ConfigDict(frozen=True, populate_by_name=True, extra="ignore")


class JobRef(_Wire):
    namespace: str
    name: str
    uid: str = ""


class StoreAddress(_Wire):
    """Where this generation's rendezvous store listens: always rank 0's pod IP."""

    address: str
    port: Annotated[int, Field(ge=1, le=65535)] = DEFAULT_STORE_PORT


class Member(_Wire):
    """One rank of the world: a process of a pod (``pod``, ``local_rank``).

    ``localRank`` is new in this version and written only when not 0, so a world of
    one process per pod reads the same to a runtime one version older.
    """

    rank: Annotated[int, Field(ge=0)]
    pod: str
    local_rank: Annotated[int, Field(ge=0, alias="localRank")] = 0
    pod_uid: str = Field(default="", alias="podUID")
    ip: str
    node: str = ""
    rack: str = ""
    nvlink_domain: str = Field(default="", alias="nvlinkDomain")
    gpu_model: str = Field(default="", alias="gpuModel")
    restarts: Annotated[int, Field(ge=0)] | None = None
    """The pod's container restarts when the operator put it in this world (new in this
    version; None in a world an older operator wrote): a higher count later means the
    process its peers knew is gone and the kubelet started another in the same pod."""

    @property
    def process(self) -> str:
        """The name of this rank's process: the pod's name for local rank 0 (all there
        is with one process per pod), ``<pod>/<local rank>`` for the others. A parameter
        server knows its workers by it."""
        return self.pod if self.local_rank == 0 else f"{self.pod}/{self.local_rank}"


class LRScaling(_Wire):
    """How the learning rate follows the world size (``spec.lrScaling``).

    ``none`` unless the world says otherwise: a script's learning rate is never changed
    unasked. ``base_world_size`` matters only for ``linear`` and ``sqrt``; it stays an
    integer on the wire (1 when unused) so that a runtime one version older, which
    requires it, still reads the world.
    """

    rule: LRRule = LRRule.NONE
    base_world_size: Annotated[int, Field(ge=1, alias="baseWorldSize")] = 1
    warmup_steps: Annotated[int, Field(ge=0, alias="warmupSteps")] = 0


AUTO_MIN_STEPS = 10
"""Fewest steps between two checkpoints under ``intervalSteps: Auto`` unless the job sets
``autoMinSteps``: below this a checkpoint's own cost outweighs what it protects."""
AUTO_MAX_STEPS = 100_000
"""Most steps between two checkpoints under ``intervalSteps: Auto`` unless the job sets
``autoMaxSteps``: a job that never failed still checkpoints now and then."""


class CheckpointSettings(_Wire):
    """``spec.checkpoint`` as the runtime follows it.

    ``interval_auto`` (``intervalSteps: Auto``) is new in this version and comes with
    ``interval_steps`` 0: a runtime one version older reads it as no step interval.
    """

    path: str = ""
    interval_steps: Annotated[int, Field(ge=0, alias="intervalSteps")] = 0
    interval_seconds: Annotated[float, Field(ge=0, alias="intervalSeconds")] = 0.0
    keep: Annotated[int, Field(ge=1)] = 3
    interval_auto: bool = Field(default=False, alias="intervalAuto")
    """Choose the step interval from the measured write cost and the observed time
    between whole-job restarts (Young/Daly), within the two bounds below."""
    auto_min_steps: Annotated[int, Field(ge=1, alias="autoMinSteps")] = AUTO_MIN_STEPS
    auto_max_steps: Annotated[int, Field(ge=1, alias="autoMaxSteps")] = AUTO_MAX_STEPS


class TopologySettings(_Wire):
    """How the runtime lays its collectives over the racks of the world."""

    hierarchical_all_reduce: HierarchicalAllReduce = Field(
        default=HierarchicalAllReduce.AUTO, alias="hierarchicalAllReduce")


class World(_Wire):
    """One generation of a job's membership, in ring order (``members[i].rank == i``).

    On the wire the document also carries ``epoch``, the generation's deprecated name,
    with the same value, and a document carrying only ``epoch`` is read (see
    :data:`LEGACY_GENERATION_KEY`; both removed in the next version).
    """

    schema_version: int = Field(default=SCHEMA_VERSION, alias="schemaVersion")
    job: JobRef
    generation: Annotated[int, Field(ge=0)]
    backend: Backend = Backend.TORCH
    mode: Mode = Mode.ALL_REDUCE
    store: StoreAddress
    members: tuple[Member, ...]
    ps: tuple[Member, ...] = ()
    """Parameter servers that are up, ``rank`` = PS index (the pod's index), so a
    server keeps its index across generations; a missing index is a server that is down."""
    ps_replicas: Annotated[int, Field(ge=0, alias="psReplicas")] = 0
    """How many parameter servers the job has (up or not); 0 outside PS mode."""
    lr: LRScaling = LRScaling()
    checkpoint: CheckpointSettings = CheckpointSettings()
    topology: TopologySettings = TopologySettings()

    _legacy_generation = model_validator(mode="before")(generation_from_legacy)

    @property
    def size(self) -> int:
        return len(self.members)

    @model_validator(mode="after")
    def _ranks_are_dense(self) -> World:
        ranks = [m.rank for m in self.members]
        if ranks != list(range(len(ranks))):
            raise ValueError(f"members must be listed in rank order 0..n-1, got ranks {ranks}")
        if len({(m.pod, m.local_rank) for m in self.members}) != len(self.members):
            raise ValueError("a (pod, localRank) appears twice in members")
        for pod, locals_ in self.local_ranks().items():
            if sorted(locals_) != list(range(len(locals_))):
                raise ValueError(f"pod {pod}'s local ranks must be 0..n-1, got {locals_}")
        if len({m.rank for m in self.ps}) != len(self.ps):
            raise ValueError("two parameter servers share an index")
        if self.ps_replicas and any(m.rank >= self.ps_replicas for m in self.ps):
            raise ValueError(f"parameter-server index out of range 0..{self.ps_replicas - 1}")
        return self

    @property
    def ps_count(self) -> int:
        """Parameter servers of the job: ``ps_replicas``, or those listed when unset."""
        return self.ps_replicas or len(self.ps)

    def member(self, pod: str, local_rank: int = 0) -> Member | None:
        """The entry of ``pod``'s local rank ``local_rank``, or None when it is not in
        this world."""
        for m in self.members:
            if m.pod == pod and m.local_rank == local_rank:
                return m
        return None

    def local_ranks(self) -> dict[str, list[int]]:
        """Every pod's local ranks, pods in order of their first rank."""
        out: dict[str, list[int]] = {}
        for m in self.members:
            out.setdefault(m.pod, []).append(m.local_rank)
        return out

    @property
    def pods(self) -> tuple[str, ...]:
        """The member pods, each once, in order of their first rank."""
        return tuple(self.local_ranks())

    def racks(self) -> tuple[tuple[int, ...], ...]:
        """Ranks grouped by rack, racks in order of their first member in the ring."""
        groups: dict[str, list[int]] = {}
        for m in self.members:
            groups.setdefault(m.rack, []).append(m.rank)
        return tuple(tuple(ranks) for ranks in groups.values())

    def to_json(self) -> str:
        """Serialize with the wire names, plus ``size`` for readers without this module
        and the deprecated ``epoch`` for runtimes one version older."""
        doc = self.model_dump(mode="json", by_alias=True)
        for member in doc["members"]:
            if not member["localRank"]:
                del member["localRank"]  # one process per pod: the older document
        for server in doc["ps"]:
            server.pop("localRank", None)
        for entry in (*doc["members"], *doc["ps"]):
            if entry["restarts"] is None:
                del entry["restarts"]  # not counted (the local launcher's worlds)
        doc["size"] = self.size
        doc[LEGACY_GENERATION_KEY] = self.generation
        return _dumps(doc)


class ReportKind(StrEnum):
    COLLECTIVE_FAILED = "collective-failed"
    PEER_DEAD = "peer-dead"
    """Heartbeats of the members named in ``suspects`` stopped for failureDetectSeconds."""
    NO_STATE = "no-state"
    STALLED = "stalled"
    LEFT = "left"
    CHECKPOINT_FAILED = "checkpoint-failed"
    """Writing or reading checkpoints failed (detail: where and the OS error)."""
    CHECKPOINT_OK = "checkpoint-ok"
    """Checkpoints are written again after a failure."""
    JOINING = "joining"
    """A process not in the world ``generation`` (a newcomer, or a process restarted
    without state) is ready to take part: started, its imports done, listening, and
    waiting for a world that includes it. New in this version: a newcomer is added to
    a world only on this report, so the members already training never stand still
    while its process starts (an older runtime never sends it: see
    :mod:`ringwright.joining`)."""


class Report(_Wire):
    """What one pod tells the operator that the API cannot see.

    Like the world, a report also carries the deprecated ``epoch`` (the generation's
    value) and is read from ``epoch`` alone (see :data:`LEGACY_GENERATION_KEY`).
    """

    kind: ReportKind
    generation: Annotated[int, Field(ge=0)]
    at: float
    """Seconds since the Unix epoch, by the pod's clock."""
    detail: str = ""
    suspects: tuple[str, ...] = ()
    """Pods this reporter found dead in ``generation`` (the evidence is in ``detail``)."""
    mac: str = ""
    """Proof that the pod whose name the report sits under wrote it
    (:mod:`ringwright.report_seal`)."""

    _legacy_generation = model_validator(mode="before")(generation_from_legacy)

    def to_json(self) -> str:
        """Serialize with the wire names, plus the deprecated ``epoch``."""
        doc = self.model_dump(mode="json", by_alias=True)
        doc[LEGACY_GENERATION_KEY] = self.generation
        return _dumps(doc)


STATS_SUFFIX = ".stats"
"""A pod's measurements sit beside its report, under ``<pod>.stats`` (a ConfigMap key in
the cluster, a file name in local runs): apart, so that the periodic measurements never
replace a report the operator has yet to act on."""


def stats_key(pod: str) -> str:
    """Where ``pod``'s :class:`MemberStats` go."""
    return f"{pod}{STATS_SUFFIX}"


class Phase(StrEnum):
    """What a member's time went to, for the job's goodput."""

    TRAINING = "training"
    """Steps that moved training forward."""
    DETECTING = "detecting"
    """Blocked on a peer that had failed, until the failure was known."""
    REFORMING = "reforming"
    """Waiting for the next world and forming its group (the first one included)."""
    SYNCING = "syncing"
    """Bringing every member to one state (tensor broadcast)."""
    REPLAYING = "replaying"
    """Steps run again after a rollback to the last commit."""


class MemberStats(_Wire):
    """What one pod measured, sent every few seconds beside its reports (new in this
    version; an operator one version older ignores the key).

    The step times are medians over the last steps of ``generation`` (robust to a
    one-off pause): ``step_seconds`` of whole steps; ``compute_seconds`` of the part not
    spent waiting for peers in the gradient all-reduce, which is what tells a slow member
    from the peers that wait for it.
    """

    generation: Annotated[int, Field(ge=0)]
    at: float
    """Seconds since the Unix epoch, by the pod's clock."""
    since: float = 0.0
    """When the reporting process started (seconds since the Unix epoch): tells a new
    process under the same pod name from the one before."""
    step: Annotated[int, Field(ge=0)] = 0
    steps_timed: Annotated[int, Field(ge=0, alias="stepsTimed")] = 0
    """Steps of ``generation`` behind the medians."""
    step_seconds: Annotated[float, Field(ge=0, alias="stepSeconds")] = 0.0
    compute_seconds: Annotated[float, Field(ge=0, alias="computeSeconds")] = 0.0
    checkpoint_interval_steps: Annotated[int, Field(ge=0, alias="checkpointIntervalSteps")] = 0
    """The step interval checkpoints follow now (the chosen one under Auto); 0: none."""
    checkpoint_write_seconds: Annotated[float | None, Field(
        ge=0, alias="checkpointWriteSeconds")] = None
    """The last checkpoint write's duration, where this member writes them."""
    mtbf_seconds: Annotated[float | None, Field(ge=0, alias="mtbfSeconds")] = None
    """The observed time between whole-job restarts the Auto interval used."""
    seconds: dict[Phase, Annotated[float, Field(ge=0)]] = Field(default_factory=dict)
    """Seconds spent in each :class:`Phase` since this process started."""
    mac: str = ""
    """Proof that the pod the stats sit under wrote them (:mod:`ringwright.report_seal`)."""

    def to_json(self) -> str:
        """Serialize with the wire names."""
        return _dumps(self.model_dump(mode="json", by_alias=True))


class ContractError(ValueError):
    """A world or report document that this side of the contract cannot use."""


def parse_world(text: str, *, where: str = "world") -> World:
    """Parse a world document, refusing other schema versions with a clear message."""
    try:
        world = World.model_validate_json(text)
    except ValidationError as err:
        raise ContractError(f"{where}: not a valid ringwright world: {err}") from err
    if world.schema_version != SCHEMA_VERSION:
        raise ContractError(
            f"{where}: world schemaVersion {world.schema_version} but this ringwright "
            f"understands {SCHEMA_VERSION}; run the same ringwright version in the operator "
            "and the training image"
        )
    return world


def parse_report(text: str, *, where: str = "report") -> Report:
    """Parse one pod's report."""
    try:
        return Report.model_validate_json(text)
    except ValidationError as err:
        raise ContractError(f"{where}: not a valid ringwright report: {err}") from err


def parse_stats(text: str, *, where: str = "stats") -> MemberStats:
    """Parse one pod's :class:`MemberStats`."""
    try:
        return MemberStats.model_validate_json(text)
    except ValidationError as err:
        raise ContractError(f"{where}: not valid ringwright member stats: {err}") from err


def _dumps(doc: object) -> str:
    return json.dumps(doc, sort_keys=True, separators=(",", ":"))
