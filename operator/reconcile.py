"""The pure heart of the operator: ``plan(observed, settings, now) -> Plan``.

No API calls, no clock, no globals: everything comes in as arguments and the result
is data (pods to create and delete, the next world, the next status, events). The
apply layer performs it; tests assert on it directly.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from ringwright.eviction import judge, needs_new_epoch
from ringwright.kube import Obj
from ringwright.operator.checkpoint_condition import CONDITION as CHECKPOINT_CONDITION
from ringwright.operator.checkpoint_condition import checkpoint_condition
from ringwright.operator.completion import completion
from ringwright.operator.conditions import condition, parse_time, rfc3339, set_condition
from ringwright.operator.inventory import Inventory
from ringwright.operator.manifests import JOB_LABEL, PS, ROLE_LABEL, WORKER, pod
from ringwright.operator.models import CleanPodPolicy, JobPhase, TrainingJobSpec
from ringwright.operator.phases import TERMINAL, check_transition
from ringwright.operator.pods import PodState, PodView, view
from ringwright.operator.recovery import recovery
from ringwright.operator.schedulingpolicy import SchedulingPolicySpec
from ringwright.operator.settings import OperatorSettings
from ringwright.operator.worldplan import Candidate, build_world, decide, ring_summary
from ringwright.world import (
    CheckpointSettings,
    JobRef,
    LRScaling,
    Report,
    ReportKind,
    TopologySettings,
    World,
)


@dataclass(frozen=True)
class Placement:
    """Placement fragments for the new pods of each role.

    Fewer worker fragments than missing workers means room ran out; no fragments at
    all with a ``reason`` means nothing may be created (gang rule, policy limits).
    """

    workers: list[Obj] = field(default_factory=list)
    ps: list[Obj] = field(default_factory=list)
    reason: str = ""
    message: str = ""
    gpu_model: str = ""
    summary: str = ""


Placer = Callable[[TrainingJobSpec, SchedulingPolicySpec, Inventory, Sequence[PodView]],
                  Placement]
"""(spec, policy, inventory, the job's live pods) -> Placement for what is missing."""


@dataclass(frozen=True)
class Observed:
    """Everything the planner may look at, gathered by the observe step."""

    job: Obj
    pods: Sequence[Obj]
    world: World | None
    reports: dict[str, Report]
    policy: SchedulingPolicySpec | None
    inventory: Inventory


@dataclass(frozen=True)
class Event:
    type: str
    reason: str
    message: str


@dataclass
class Plan:
    """What the apply layer must do, in order: create, mark, publish, delete, status."""

    create: list[Obj] = field(default_factory=list)
    mark_leaving: list[str] = field(default_factory=list)
    delete: list[str] = field(default_factory=list)
    clear_reports: list[str] = field(default_factory=list)
    world: World | None = None
    status: Obj = field(default_factory=dict)
    events: list[Event] = field(default_factory=list)
    requeue_after: float | None = None
    delete_job: bool = False

    def soon(self, seconds: float) -> None:
        """Ask to be run again within ``seconds``."""
        if self.requeue_after is None or seconds < self.requeue_after:
            self.requeue_after = max(seconds, 0.05)


def backoff(restarts: int, base: float, cap: float) -> float:
    """Delay before the next replacement: base, 2·base, 4·base, … up to cap."""
    return float(min(cap, base * math.pow(2, max(restarts - 1, 0))))


VERDICT_MARGIN_S = 2.0
"""Beyond failureDetectSeconds, how long a failed collective waits for a member's
heartbeat verdict before the operator re-forms the same membership."""


class _Round:
    """One planning round; a class only to share the values every step reads."""

    def __init__(self, obs: Observed, settings: OperatorSettings, now: float,
                 placer: Placer) -> None:
        self.obs, self.settings, self.now, self.placer = obs, settings, now, placer
        self.job = obs.job
        self.meta = obs.job["metadata"]
        self.spec = TrainingJobSpec.model_validate(obs.job["spec"])
        self.status: Obj = dict(obs.job.get("status") or {})
        self.generation = int(self.meta.get("generation", 0))
        self.phase = JobPhase(self.status.get("phase", JobPhase.PENDING))
        self.plan = Plan()
        views = [v for v in (view(p) for p in obs.pods) if v is not None]
        self.workers = [v for v in views if v.role == WORKER]
        self.ps = [v for v in views if v.role == PS]
        self.finishing = False
        """The work is done, pods are ending: nothing is replaced or published."""

    # -- helpers -------------------------------------------------------------------

    def event(self, reason: str, message: str, warning: bool = False) -> None:
        self.plan.events.append(Event("Warning" if warning else "Normal", reason, message))

    def condition(self, type_: str, ok: bool, reason: str, message: str) -> None:
        self.status["conditions"] = set_condition(
            list(self.status.get("conditions") or []), type_, ok, reason, message, self.now,
            self.generation)

    def move(self, phase: JobPhase, reason: str, message: str) -> None:
        if phase == self.phase:
            return
        check_transition(self.phase, phase)
        self.event(reason, f"{self.phase} -> {phase}: {message}",
                   warning=phase in (JobPhase.FAILED, JobPhase.RESTARTING))
        self.phase = phase
        if phase in TERMINAL:
            self.status["completionTime"] = rfc3339(self.now)
            self.condition(phase.value, True, reason, message)

    # -- steps ---------------------------------------------------------------------

    def finished(self) -> None:
        policy = self.spec.run_policy.clean_pod_policy
        for p in self.workers + self.ps:
            if p.state == PodState.DELETING:
                continue
            if policy == CleanPodPolicy.ALL or (policy == CleanPodPolicy.RUNNING and p.alive):
                self.plan.delete.append(p.name)
        ttl = self.spec.run_policy.ttl_seconds_after_finished
        done = parse_time(self.status.get("completionTime")) or self.now
        if ttl is not None:
            if self.now >= done + ttl:
                self.plan.delete_job = True
            else:
                self.plan.soon(done + ttl - self.now)

    def suspended(self) -> None:
        for p in self.workers + self.ps:
            if p.state != PodState.DELETING:
                self.plan.delete.append(p.name)
        if self.phase != JobPhase.SUSPENDED:
            self.move(JobPhase.SUSPENDED, "Suspended", "spec.runPolicy.suspend is true")
        self.condition("Suspended", True, "Suspended", "pods deleted; the job is kept")

    def run(self) -> Plan:
        if self.phase in TERMINAL:
            self.finished()
            return self.finish()
        if self.obs.policy is None:
            name = self.spec.scheduling_policy_name
            self.condition("PolicyFound", False, "PolicyNotFound",
                           f"SchedulingPolicy {name!r} does not exist; create it or set "
                           "spec.schedulingPolicyName to an existing policy")
            self.plan.soon(self.settings.resync_seconds)
            return self.finish()
        self.condition("PolicyFound", True, "PolicyFound",
                       f"placing with SchedulingPolicy {self.spec.scheduling_policy_name!r}")
        if self.spec.run_policy.suspend:
            self.suspended()
            return self.finish()
        if self.phase == JobPhase.SUSPENDED:
            self.move(JobPhase.PENDING, "Resumed", "spec.runPolicy.suspend is false")
            self.condition("Suspended", False, "Resumed", "pods are recreated")
        if self.deadline_passed():
            return self.finish()
        if self.completed():
            return self.finish()
        self.failures()
        if self.phase in TERMINAL:
            return self.finish()
        self.checkpoints()
        if not self.finishing:
            self.resize()
            self.world()
        return self.finish()

    def checkpoints(self) -> None:
        """Members' checkpoint-failure reports become the CheckpointFailing condition."""
        current = condition(list(self.status.get("conditions") or []), CHECKPOINT_CONDITION)
        change = checkpoint_condition(self.obs.reports, current)
        if change is None:
            return
        if current is None or (current.get("status") == "True") != change.failing:
            self.event(change.reason, change.message, warning=change.failing)
        self.condition(CHECKPOINT_CONDITION, change.failing, change.reason, change.message)

    def deadline_passed(self) -> bool:
        limit = self.spec.run_policy.active_deadline_seconds
        start = parse_time(self.status.get("startTime"))
        if limit is None or start is None:
            return False
        if self.now - start < limit:
            self.plan.soon(start + limit - self.now)
            return False
        self.move(JobPhase.FAILED, "DeadlineExceeded",
                  f"the job ran longer than spec.runPolicy.activeDeadlineSeconds={limit}")
        self.finished()
        return True

    def completed(self) -> bool:
        """The completion rule of the job's mode: True when the job just succeeded; sets
        ``finishing`` while the work is done but pods are still ending."""
        verdict = completion(self.spec.mode, self.obs.world, self.workers, self.ps,
                             parse_time(self.status.get("workersFinishedTime")), self.now,
                             self.settings.ps_exit_grace_seconds)
        if verdict.workers_finished_at is not None:
            self.status["workersFinishedTime"] = rfc3339(verdict.workers_finished_at)
        if verdict.wait is not None:
            self.plan.soon(verdict.wait)
        self.finishing = verdict.finishing
        if verdict.succeeded:
            self.move(JobPhase.SUCCEEDED, "Completed", verdict.message)
            self.finished()
        return verdict.succeeded

    def failures(self) -> None:
        """Failed pods and members that vanished are replaced within backoffLimit.

        Pods are tracked as ``name/uid``: a replacement reuses its predecessor's name.
        """
        world = self.obs.world
        members = {f"{m.pod}/{m.pod_uid}" for m in world.members} if world else set()
        everyone = self.workers + self.ps
        present = {f"{p.name}/{p.uid}": p for p in everyone}
        lost = [key for key, p in present.items() if p.state == PodState.FAILED]
        lost += sorted(members - present.keys())
        if world is not None:
            # Peers' word, corroborated: several reporters, or one and the pod not Ready.
            unhealthy = {p.name for p in everyone if p.state != PodState.READY}
            for e in judge(world, self.obs.reports, unhealthy):
                pod_ = next((p for p in everyone if p.name == e.pod), None)
                if pod_ is not None and pod_.state != PodState.DELETING:
                    lost.append(f"{pod_.name}/{pod_.uid}")
                    self.event("MemberDead", f"{e.pod} is dead: {e.reason} "
                               f"({', '.join(e.reporters)}); replacing it", warning=True)
        for name, report in self.obs.reports.items():
            pod_ = next((p for p in everyone if p.name == name), None)
            if (report.kind == ReportKind.STALLED and world is not None
                    and report.epoch == world.epoch and pod_ is not None
                    and pod_.state != PodState.DELETING):
                lost.append(f"{pod_.name}/{pod_.uid}")
                self.plan.clear_reports.append(name)
                self.event("MemberStalled",
                           f"{name} reports its training loop stalled; replacing it",
                           warning=True)
        known = set(self.status.get("lostPods") or [])
        fresh = [key for key in dict.fromkeys(lost) if key not in known]
        # Remember what was counted while it is still visible, so each loss counts once.
        self.status["lostPods"] = sorted((known | set(fresh)) & (present.keys() | members))
        for key in dict.fromkeys(lost):
            p = present.get(key)
            if p is not None and p.state != PodState.DELETING:
                self.plan.delete.append(p.name)
        if not fresh:
            return
        restarts = int(self.status.get("restarts", 0)) + len(fresh)
        self.status["restarts"] = restarts
        self.status["lastFailureTime"] = rfc3339(self.now)
        names = ", ".join(key.split("/")[0] for key in fresh)
        limit = self.spec.run_policy.backoff_limit
        self.event("MemberLost", f"lost {names} (restart {restarts} of backoffLimit {limit})",
                   warning=True)
        if restarts > limit:
            self.move(JobPhase.FAILED, "BackoffLimitExceeded",
                      f"{restarts} pod failures exceed spec.runPolicy.backoffLimit={limit}")
            self.finished()

    def gang_withdrawn(self) -> bool:
        """Pods still unbound ``gangTimeoutSeconds`` after creation are deleted, all of them,
        so the next round places the gang again from what is free then."""
        assert self.obs.policy is not None
        limit = self.obs.policy.gang_timeout_seconds
        unbound = [p for p in self.workers + self.ps if p.state == PodState.PENDING
                   and not p.node and p.created is not None]
        if not unbound:
            return False
        oldest = min(p.created or self.now for p in unbound)
        if self.now - oldest < limit:
            self.plan.soon(oldest + limit - self.now)
            return False
        self.plan.delete.extend(p.name for p in unbound)
        self.event("GangTimeout", f"{len(unbound)} pods stayed unbound for {limit}s "
                   "(spec.gangTimeoutSeconds of the SchedulingPolicy); withdrawn, placing "
                   "again", warning=True)
        self.plan.soon(1.0)
        return True

    def resize(self) -> None:
        """Bring the worker (and ps) count to the spec: remove highest ranks, add lowest free."""
        if self.gang_withdrawn():
            return
        wanted = self.spec.workers.replicas
        doomed = set(self.plan.delete)
        alive = [p for p in self.workers if p.alive and p.name not in doomed
                 and p.leaving_since is None]
        ranks = {m.pod: m.rank for m in self.obs.world.members} if self.obs.world else {}
        if len(alive) > wanted:
            # Pods outside the world hold no state: they go first, then the highest ranks.
            order = sorted(alive, key=lambda p: (p.name in ranks, ranks.get(p.name, 0), p.index))
            for p in order[wanted - len(alive):]:
                if p.name in ranks:
                    self.plan.mark_leaving.append(p.name)
                else:
                    self.plan.delete.append(p.name)
            self.event("ScalingDown", f"workers {len(alive)} -> {wanted}")
        for p in self.workers:
            if p.leaving_since is None or p.state == PodState.DELETING:
                continue
            drained = p.state in (PodState.SUCCEEDED, PodState.FAILED)
            if drained or self.now - p.leaving_since >= self.settings.drain_seconds:
                self.plan.delete.append(p.name)
            else:
                self.plan.soon(self.settings.drain_seconds - (self.now - p.leaving_since))
        missing_workers = wanted - len(alive)
        ps_alive = [p for p in self.ps if p.alive and p.name not in doomed]
        missing_ps = (self.spec.ps.replicas - len(ps_alive)) if self.spec.ps else 0
        if missing_workers > 0 or missing_ps > 0:
            self.add_pods(alive + ps_alive, missing_workers)

    def add_pods(self, live: list[PodView], missing_workers: int) -> None:
        last_failure = parse_time(self.status.get("lastFailureTime"))
        if last_failure is not None:
            ready_at = last_failure + backoff(int(self.status.get("restarts", 0)),
                                              self.settings.backoff_base_seconds,
                                              self.settings.backoff_cap_seconds)
            if self.now < ready_at:
                self.plan.soon(ready_at - self.now)
                return
        assert self.obs.policy is not None
        placed = self.placer(self.spec, self.obs.policy, self.obs.inventory, live)
        if placed.reason:
            # Gang rule and policy limits: nothing is created until all of it fits.
            self.condition("Schedulable", False, placed.reason, placed.message)
            if not self.workers:
                self.event(placed.reason, placed.message, warning=True)
            self.plan.soon(self.settings.resync_seconds)
            return
        if len(placed.workers) < missing_workers:
            self.condition("Schedulable", False, "InsufficientCapacity",
                           f"placed {len(placed.workers)} of {missing_workers} missing workers; "
                           "the rest are added when room frees up")
            self.plan.soon(self.settings.resync_seconds)
        else:
            self.condition("Schedulable", True, "Placed", placed.summary)
        # A pod on its way out leaves its index free: its replacement keeps the name (the
        # create is refused as AlreadyExists until the old pod is gone, then it goes through).
        for role, fragments, taken in (
            (WORKER, placed.workers, {p.index for p in self.workers
                                      if p.state != PodState.DELETING}),
            (PS, placed.ps, {p.index for p in self.ps if p.state != PodState.DELETING}),
        ):
            free = (i for i in range(len(taken) + len(fragments) + 1) if i not in taken)
            for fragment, index in zip(fragments, free, strict=False):
                self.plan.create.append(pod(self.job, role, index, fragment))
        if placed.gpu_model:
            self.status["world"] = {**(self.status.get("world") or {}),
                                    "gpuModel": placed.gpu_model}

    def world(self) -> None:
        doomed = set(self.plan.delete) | set(self.plan.mark_leaving)
        ready = [p for p in self.workers if p.state == PodState.READY and p.name not in doomed
                 and p.leaving_since is None]
        current = self.obs.world
        # Members waiting for a world that only a bump would bring: one restarted
        # without state, or a collective failed and no member was found dead.
        verdict_wait = self.spec.fault_tolerance.failure_detect_seconds + VERDICT_MARGIN_S
        force = current is not None and needs_new_epoch(
            current, self.obs.reports, self.now, verdict_wait) is not None
        if current is not None and not force and any(
                r.kind == ReportKind.COLLECTIVE_FAILED and r.epoch == current.epoch
                and not r.suspects for r in self.obs.reports.values()):
            self.plan.soon(verdict_wait)
        pending_doc = self.status.get("candidate") or {}
        pending = (Candidate(pending_doc["digest"], float(pending_doc["since"]))
                   if pending_doc.get("digest") else None)
        ready_ps = [p for p in self.ps if p.state == PodState.READY and p.name not in doomed]
        publish, candidate, wait = decide(
            current, ready, self.spec.workers.replicas, self.spec.workers.min, pending,
            self.now, self.settings.settle_seconds, force, ready_ps)
        self.status["candidate"] = (
            {"digest": candidate.digest, "since": candidate.since} if candidate else None)
        if wait is not None:
            self.plan.soon(wait)
        if publish:
            self.publish(ready, ready_ps)
        running = self.phase in (JobPhase.RUNNING, JobPhase.RESTARTING)
        if running and len(ready) < self.spec.workers.min:
            self.below_min(len(ready))
        else:
            self.status["belowMinSince"] = None

    def publish(self, ready: list[PodView], ready_ps: list[PodView]) -> None:
        current = self.obs.world
        epoch = (current.epoch + 1) if current else 1
        spec = self.spec
        world = build_world(
            JobRef(namespace=self.meta["namespace"], name=self.meta["name"],
                   uid=self.meta.get("uid", "")),
            epoch, ready, current,
            {n.name: n for n in self.obs.inventory.nodes},
            backend=spec.backend.value, mode=spec.mode.value,
            store_port=self.settings.store_port,
            lr=LRScaling(rule=spec.lr_scaling.rule,
                         base_world_size=spec.lr_scaling.base_world_size,
                         warmup_steps=spec.lr_scaling.warmup_steps),
            checkpoint=CheckpointSettings(
                path=spec.checkpoint.path, interval_steps=spec.checkpoint.interval_steps,
                interval_seconds=spec.checkpoint.interval_seconds, keep=spec.checkpoint.keep),
            ps=ready_ps,
            ps_replicas=spec.ps.replicas if spec.ps else 0,
            topology=TopologySettings(
                hierarchical_all_reduce=spec.topology.hierarchical_all_reduce),
        )
        self.plan.world = world
        racks, edges, per_rack = ring_summary(world)
        self.event("WorldPublished", f"epoch {epoch}: {world.size} workers in {racks} racks "
                   f"({edges} cross-rack ring edges)")
        if self.phase in (JobPhase.PENDING, JobPhase.RESTARTING):
            self.move(JobPhase.RUNNING, "Running", f"world epoch {epoch} has {world.size} "
                      f"workers (min {spec.workers.min})")
            self.status.setdefault("startTime", rfc3339(self.now))
        if (recovered := recovery(self.status, self.now)) is not None:
            self.status["lastRecovery"] = recovered
        self.status["world"] = {
            **(self.status.get("world") or {}),
            "epoch": epoch, "size": world.size, "racks": racks, "crossRackEdges": edges,
            "rackMembers": [{"rack": r, "members": n} for r, n in per_rack],
        }

    def below_min(self, ready: int) -> None:
        since = parse_time(self.status.get("belowMinSince"))
        if since is None:
            since = self.now
            self.status["belowMinSince"] = rfc3339(self.now)
        if self.phase == JobPhase.RUNNING:
            self.move(JobPhase.RESTARTING, "BelowMinimum",
                      f"{ready} ready workers, below spec.workers.min="
                      f"{self.spec.workers.min}; waiting for replacements")
        grace = self.settings.below_min_grace_seconds
        if self.phase == JobPhase.RESTARTING and self.now - since >= grace:
            self.move(JobPhase.FAILED, "BelowMinimum",
                      f"fewer than spec.workers.min={self.spec.workers.min} workers for "
                      f"{grace:.0f}s")
            self.finished()
        else:
            self.plan.soon(max(grace - (self.now - since), 0.5))

    def finish(self) -> Plan:
        st = self.status
        st["phase"] = self.phase.value
        st["observedGeneration"] = self.generation
        name = self.meta["name"]
        st["selector"] = f"{JOB_LABEL}={name},{ROLE_LABEL}={WORKER}"
        deleted = set(self.plan.delete)
        live = [p for p in self.workers if p.alive and p.name not in deleted]
        st["workers"] = {
            "desired": self.spec.workers.replicas,
            "active": len(live) + sum(1 for o in self.plan.create
                                      if o["metadata"]["labels"][ROLE_LABEL] == WORKER),
            "ready": sum(1 for p in live if p.state == PodState.READY),
            "succeeded": sum(1 for p in self.workers if p.state == PodState.SUCCEEDED),
            "failed": sum(1 for p in self.workers if p.state == PodState.FAILED),
        }
        if self.spec.ps is not None:
            st["ps"] = {"desired": self.spec.ps.replicas,
                        "active": sum(1 for p in self.ps if p.alive),
                        "ready": sum(1 for p in self.ps if p.state == PodState.READY)}
        self.plan.status = st
        return self.plan


def plan(observed: Observed, settings: OperatorSettings, now: float, placer: Placer) -> Plan:
    """Decide everything for one job from what was observed; performs nothing."""
    return _Round(observed, settings, now, placer).run()
