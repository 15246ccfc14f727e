"""Operator metrics (Prometheus): how reconciling goes and what it did to jobs.

What a round did is read from its plan, which is data, by :func:`effects` (pure); the
handlers make three small calls per round: time it, time the planning, and record
the effects once the plan is applied. API failures are counted where a round fails.
"""

from __future__ import annotations

import collections
import contextlib
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from ringwright.objects import Obj
from ringwright.world import Phase, ReportKind

from .api.models import JobPhase
from .apply.refusals import Refused
from .plan.manifests import ROLE_LABEL
from .plan.pods import PodState, view
from .plan.reconcile import Observed, Plan

# Reconcile rounds take milliseconds to a few seconds (API round trips).
ROUND_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
PLAN_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)


class LossCause:
    """Why a member was lost (the ``cause`` label)."""

    POD_FAILED = "pod_failed"
    POD_GONE = "pod_gone"
    STALLED = "stalled"


@dataclass(frozen=True)
class Effects:
    """What one applied plan did, in the terms the metrics count."""

    phase: str
    created: dict[str, int] = field(default_factory=dict)
    """New pods per role."""
    deleted: dict[str, int] = field(default_factory=dict)
    """Deleted pods per role."""
    published: bool = False
    lost: list[str] = field(default_factory=list)
    """One cause per member newly counted as lost."""
    unschedulable: str = ""
    """The reason, when the job just became unschedulable."""


def _schedulable(status: Obj) -> tuple[str, str]:
    for c in status.get("conditions") or []:
        if c.get("type") == "Schedulable":
            return str(c.get("status", "")), str(c.get("reason", ""))
    return "", ""


def effects(observed: Observed, plan: Plan) -> Effects:
    """Read from ``plan`` (and what it was planned from) what a round changed."""
    before: Obj = observed.job.get("status") or {}
    created = collections.Counter(
        str(p["metadata"].get("labels", {}).get(ROLE_LABEL, "")) for p in plan.create)
    fresh = sorted(set(plan.status.get("lostPods") or []) - set(before.get("lostPods") or []))
    # Most rounds delete nothing and lose nothing: read only the pods they name.
    named = set(plan.delete) | {key.split("/", 1)[0] for key in fresh}
    views = {v.name: v for v in (view(p) for p in observed.pods
                                 if p["metadata"]["name"] in named) if v is not None}
    deleted = collections.Counter(
        views[name].role if name in views else "" for name in plan.delete)
    stalled = {name for name, r in observed.reports.items() if r.kind == ReportKind.STALLED}
    by_key = {f"{v.name}/{v.uid}": v for v in views.values()}
    lost = []
    for key in fresh:
        pod = by_key.get(key)
        if pod is None:
            lost.append(LossCause.POD_GONE)
        elif pod.state == PodState.FAILED:
            lost.append(LossCause.POD_FAILED)
        elif pod.name in stalled:
            lost.append(LossCause.STALLED)
        else:
            lost.append(LossCause.POD_GONE)
    status, reason = _schedulable(plan.status)
    newly = status == "False" and _schedulable(before) != (status, reason)
    return Effects(
        phase=str(plan.status.get("phase") or before.get("phase") or JobPhase.PENDING.value),
        created=dict(created), deleted=dict(deleted), published=plan.world is not None,
        lost=lost, unschedulable=reason if newly else "")


def goodput_fractions(status: Obj) -> dict[str, float]:
    """The phase fractions of a status in its wire form (none before any stats)."""
    found = status.get("goodput") or {}
    return {p.value: float(found[p.value]) for p in Phase if p.value in found}


class OperatorMetrics:
    """The operator's metrics, in a registry of their own (several may live in a test)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.reconcile_seconds = Histogram(
            "ringwright_operator_reconcile_seconds", "One observe-plan-apply round.",
            buckets=ROUND_BUCKETS, registry=r)
        self.planning_seconds = Histogram(
            "ringwright_operator_planning_seconds", "The pure planning step of a round.",
            buckets=PLAN_BUCKETS, registry=r)
        self.api_errors = Counter(
            "ringwright_operator_api_errors", "API requests that failed a round, by verb "
            "and HTTP status code.", ["verb", "code"], registry=r)
        self.jobs = Gauge(
            "ringwright_operator_jobs", "TrainingJobs this operator reconciles, by phase.",
            ["phase"], registry=r)
        self.generations_published = Counter(
            "ringwright_operator_world_generations_published", "World generations published.",
            registry=r)
        self.members_lost = Counter(
            "ringwright_operator_members_lost", "Pods counted as lost, by cause.", ["cause"],
            registry=r)
        self.placement_failures = Counter(
            "ringwright_operator_placement_failures", "Times a job became unschedulable, by "
            "reason.", ["reason"], registry=r)
        self.pods_created = Counter(
            "ringwright_operator_pods_created", "Pods created, by role.", ["role"], registry=r)
        self.pods_deleted = Counter(
            "ringwright_operator_pods_deleted", "Pods deleted, by role.", ["role"], registry=r)
        self.writes_refused = Counter(
            "ringwright_operator_writes_refused", "Writes the API server refused (quota, "
            "admission), by namespace, verb and kind; they are retried after a per-job "
            "backoff.", ["namespace", "verb", "kind"], registry=r)
        self.goodput = Gauge(
            "ringwright_operator_job_goodput_ratio", "Fraction of a job's member time by "
            "phase (training is the goodput; detecting, reforming, syncing, replaying the "
            "rest), over the job's life, from its status.goodput (``job_name``, as the "
            "runtime's metrics name the job: ``job`` is Prometheus's own).",
            ["namespace", "job_name", "phase"], registry=r)
        self._phases: dict[tuple[str, str], str] = {}
        self._lock = threading.Lock()
        for phase in JobPhase:
            self.jobs.labels(phase.value).set(0)

    def round(self) -> contextlib.AbstractContextManager[object]:
        """Time one reconcile round (observe, plan, apply)."""
        return self.reconcile_seconds.time()

    def planning(self) -> contextlib.AbstractContextManager[object]:
        """Time the planning step."""
        return self.planning_seconds.time()

    def api_error(self, verb: str, code: int) -> None:
        """Count an API request that failed a round."""
        self.api_errors.labels(verb, str(code)).inc()

    def refused(self, namespace: str, refusals: Iterable[Refused]) -> None:
        """Count writes the API server refused in ``namespace``."""
        for r in refusals:
            self.writes_refused.labels(namespace, r.verb, r.kind).inc()

    def applied(self, namespace: str, name: str, observed: Observed, plan: Plan) -> None:
        """Count what an applied plan did."""
        done = effects(observed, plan)
        for role, n in done.created.items():
            self.pods_created.labels(role).inc(n)
        for role, n in done.deleted.items():
            self.pods_deleted.labels(role).inc(n)
        if done.published:
            self.generations_published.inc()
        for cause in done.lost:
            self.members_lost.labels(cause).inc()
        if done.unschedulable:
            self.placement_failures.labels(done.unschedulable).inc()
        self._set_phase((namespace, name), done.phase)
        for phase, fraction in goodput_fractions(plan.status).items():
            self.goodput.labels(namespace, name, phase).set(fraction)

    def forget(self, namespace: str, name: str) -> None:
        """The job is gone: stop counting it in ``jobs``, drop its goodput."""
        self._set_phase((namespace, name), None)
        for phase in Phase:
            with contextlib.suppress(KeyError):
                self.goodput.remove(namespace, name, phase.value)

    def _set_phase(self, key: tuple[str, str], phase: str | None) -> None:
        with self._lock:
            if phase is None:
                self._phases.pop(key, None)
            else:
                self._phases[key] = phase
            counts = collections.Counter(self._phases.values())
            for p in {*counts, *(ph.value for ph in JobPhase)}:
                self.jobs.labels(p).set(counts.get(p, 0))

