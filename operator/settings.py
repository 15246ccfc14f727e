"""Operator settings: typed, documented, validated when constructed."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from ringwright.world import DEFAULT_STORE_PORT


class OperatorSettings(BaseModel):
    """Knobs of the reconcile loop. Read from ``RINGWRIGHT_*`` environment variables."""

    model_config = ConfigDict(frozen=True)

    settle_seconds: float = Field(
        default=1.5, ge=0, description="A changed membership must hold this long before it is "
        "published, so a burst of pod events yields one generation (not after a failure once every "
        "remaining member waits for the next world).")
    drain_seconds: float = Field(
        default=30.0, ge=0, description="How long a pod removed by a scale-down may take to "
        "leave cleanly before it is deleted anyway.")
    below_min_grace_seconds: float = Field(
        default=120.0, ge=0, description="How long a running job may stay below "
        "spec.workers.min before it fails.")
    backoff_base_seconds: float = Field(
        default=1.0, ge=0, description="First delay before replacing a failed pod, and before "
        "creating again after the API refused a write; doubles with every further one.")
    backoff_cap_seconds: float = Field(
        default=60.0, ge=0, description="Longest delay before replacing a failed pod or "
        "retrying refused creates.")
    resync_seconds: float = Field(
        default=10.0, gt=0, description="Reconcile every job at least this often.")
    round_spacing_seconds: float = Field(
        default=0.3, ge=0, description="A job's reconcile rounds start at least this far "
        "apart: the pod events of a burst are taken a batch per round (one status write per "
        "batch, not per event). Adds at most this much to a reaction to an event that comes "
        "right after a round.")
    scaffold_resync_seconds: float = Field(
        default=600.0, gt=0, description="Every round re-applies the scaffold objects "
        "(ServiceAccount, Role, RoleBinding, Service, reports ConfigMap, ...) that the watch "
        "cache shows missing or changed; this often, every job's whole scaffold is "
        "re-applied anyway, in case a watch missed an event.")
    ps_exit_grace_seconds: float = Field(
        default=30.0, ge=0, description="ParameterServer mode: after the last worker "
        "finished, how long ps pods may keep serving the last pushes before the job "
        "succeeds and they are deleted.")
    rank_exit_grace_seconds: float = Field(
        default=30.0, ge=0, description="AllReduce mode: the job succeeds when rank 0 exits "
        "0; the other members of its world still running then get this long to exit on "
        "their own (their last steps, logs and metrics) before cleanPodPolicy Running "
        "deletes them.")
    store_port: int = Field(
        default=DEFAULT_STORE_PORT, ge=1, le=65535,
        description="Port of the rendezvous store that rank 0 hosts.")

    network_policy: bool = Field(
        default=True, description="Give every job a NetworkPolicy that admits only its own "
        "pods to its store and collective ports (the operator's pods to readiness).")
    kueue: bool = Field(
        default=False, description="Queue jobs labelled kueue.x-k8s.io/queue-name through "
        "Kueue: each gets a Workload, and pods only once Kueue admits it (docs/kueue.md). "
        "Needs Kueue's CRDs installed.")
    kueue_elastic: bool = Field(
        default=False, description="With kueue: a queued job may grow and shrink after "
        "admission, through Kueue's workload slices (a scale-up waits for quota and grows "
        "the job when Kueue admits it; a scale-down hands quota back at once). Needs Kueue's "
        "ElasticJobsViaWorkloadSlices feature gate (docs/kueue.md).")
    kueue_elastic_topology: bool = Field(
        default=False, description="With kueueElastic: a job with a topology assignment "
        "(an unconstrained or implied request) also grows and shrinks through slices, "
        "its new pods placed in the domains Kueue adds. Needs Kueue's "
        "ElasticJobsViaWorkloadSlicesWithTAS feature gate, under which Kueue v0.17 admits "
        "no required or preferred topology request (docs/kueue.md).")
    operator_namespace: str = Field(
        default="", description="Namespace of the operator's pods, admitted by each job's "
        "NetworkPolicy to the readiness port. Default: the leader-election Lease's namespace "
        "($POD_NAMESPACE); empty when the operator runs outside the cluster.")

    @classmethod
    def from_env(cls, env: dict[str, str]) -> OperatorSettings:
        """Settings from ``RINGWRIGHT_<FIELD>`` variables (e.g. RINGWRIGHT_SETTLE_SECONDS)."""
        values = {name: env[f"RINGWRIGHT_{name.upper()}"] for name in cls.model_fields
                  if f"RINGWRIGHT_{name.upper()}" in env}
        return cls.model_validate(values)
