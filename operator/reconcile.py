"""The pure heart of the operator: ``plan(observed, settings, now) -> Plan``.

No API calls, no clock, no globals: everything comes in as arguments and the result
is data (pods to create and delete, the next world, the next status, events). The
apply layer performs it; tests assert on it directly.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from ringwright.eviction import judge, needs_new_epoch
from ringwright.kube import Obj
from ringwright.operator.checkpoint_condition import CONDITION as CHECKPOINT_CONDITION
from ringwright.operator.checkpoint_condition import checkpoint_condition
from ringwright.operator.completion import completion
from ringwright.operator.conditions import condition, parse_time, rfc3339, set_condition
from ringwright.operator.epochs import EpochsSeen, next_epoch, status_epoch
from ringwright.operator.inventory import Inventory
from ringwright.operator.isolation import harden
from ringwright.operator.manifests import JOB_LABEL, PS, ROLE_LABEL, WORKER, pod
from ringwright.operator.models import CleanPodPolicy, JobPhase, TrainingJobSpec
from ringwright.operator.nodeloss import (
    CRASH_LOOP,
    crash_looping,
    lost_members,
    new_container_restarts,
    with_node_loss_tolerations,
)
from ringwright.operator.phases import TERMINAL, check_transition
from ringwright.operator.pods import PodState, PodView, view
from ringwright.operator.recovery import recovery
from ringwright.operator.schedulingpolicy import SchedulingPolicySpec
from ringwright.operator.settings import OperatorSettings
from ringwright.operator.templates_policy import TEMPLATE_CONDITION, job_violations
from ringwright.operator.worldplan import (
    Candidate,
    build_world,
    decide,
    membership_digest,
    ring_summary,
    world_digest,
)
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
    hold_creates_until: float | None = None
    """Set while the API refuses the job's writes: no pod is created before then."""
    left_behind: Sequence[Obj] = ()
    """Pods of an earlier job of the same name, not yet garbage-collected."""
    policy_error: str = ""
    """Why the named SchedulingPolicy exists but cannot be used (``policy`` is None)."""
    world_annotation_epoch: int = 0
    """The world ConfigMap's epoch annotation (kept even when its document is unreadable)."""
    world_version: str = ""
    """The world ConfigMap's resourceVersion as read; empty when there is none."""
    node_down_since: Mapping[str, float] = field(default_factory=dict)
    """The job's pods' nodes that are NotReady, and since when."""


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
    delete_gracefully: list[str] = field(default_factory=list)
    """Pods deleted with their own terminationGracePeriodSeconds (SIGTERM, checkpoint)."""
    delete_left_behind: list[tuple[str, str]] = field(default_factory=list)
    """(name, uid) of pods an earlier job of the same name left: deleted by UID only."""
    clear_reports: list[str] = field(default_factory=list)
    world: World | None = None
    world_version: str = ""
    """Write ``world`` only over this resourceVersion (empty: only if none exists)."""
    status: Obj = field(default_factory=dict)
    events: list[Event] = field(default_factory=list)
    requeue_after: float | None = None
    delete_job: bool = False

    def soon(self, seconds: float) -> None:
        """Ask to be run again within ``seconds``."""
        if self.requeue_after is None or seconds < self.requeue_after:
            self.requeue_after = max(seconds, 0.05)


PHASE_HISTORY = 32
"""Phase transitions kept in status.phaseHistory (the oldest go first)."""


def empty_world(current: World, epoch: int) -> World:
    """``current`` at ``epoch`` with no members: everyone leaves (suspend)."""
    return current.model_copy(update={"epoch": epoch, "members": (), "ps": (),
                                      "store": current.store.model_copy(update={"address": ""})})


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
        self.status["phaseHistory"] = [
            *(self.status.get("phaseHistory") or []),
            {"phase": phase.value, "reason": reason, "time": rfc3339(self.now)},
        ][-PHASE_HISTORY:]
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
        """Members learn from an empty world that they are out, then their pods get their
        own grace period (SIGTERM: the final checkpoint is written). Nothing here is a
        failure: no member is lost, restarts and backoffLimit are untouched."""
        current = self.obs.world
        if current is not None and (current.members or current.ps):
            epoch = self.next_epoch()
            self.plan.world = empty_world(current, epoch)
            self.plan.world_version = self.obs.world_version
            self.status["world"] = {**(self.status.get("world") or {}),
                                    "epoch": epoch, "size": 0, "racks": 0,
                                    "crossRackEdges": 0, "rackMembers": []}
            self.event("WorldPublished", f"epoch {epoch}: empty (suspended)")
        for p in self.workers + self.ps:
            if p.state != PodState.DELETING:
                self.plan.delete_gracefully.append(p.name)
        self.status["candidate"] = None
        self.status["belowMinSince"] = None
        if self.phase != JobPhase.SUSPENDED:
            self.move(JobPhase.SUSPENDED, "Suspended", "spec.runPolicy.suspend is true; "
                      "pods stop with their grace period, restarts are kept")
        self.condition("Suspended", True, "Suspended", "pods deleted; the job is kept")

    def run(self) -> Plan:
        # They hold the names this job's pods need; not members, never counted.
        self.plan.delete_left_behind = [
            (p["metadata"]["name"], p["metadata"]["uid"]) for p in self.obs.left_behind
            if not p["metadata"].get("deletionTimestamp")]
        if self.phase in TERMINAL:
            self.finished()
            return self.finish()
        self.policy_condition()
        if self.deadline_passed():
            return self.finish()
        if self.obs.policy is not None and self.template_refused():
            return self.finish()
        if self.spec.run_policy.suspend:
            self.suspended()
            return self.finish()
        if self.phase == JobPhase.SUSPENDED:
            self.move(JobPhase.PENDING, "Resumed", "spec.runPolicy.suspend is false")
            self.condition("Suspended", False, "Resumed", "pods are recreated")
        if self.completed():
            return self.finish()
        self.failures()
        if self.phase in TERMINAL:
            return self.finish()
        self.crash_loops()
        self.checkpoints()
        if not self.finishing:
            self.resize()
            self.world()
        return self.finish()

    def policy_condition(self) -> None:
        """Say whether the policy is usable. Without it nothing new is placed, but the
        rest of the lifecycle (failures, suspend, deadline, completion) goes on."""
        name = self.spec.scheduling_policy_name
        if self.obs.policy is not None:
            self.condition("PolicyFound", True, "PolicyFound",
                           f"placing with SchedulingPolicy {name!r}")
        elif self.obs.policy_error:
            self.condition("PolicyFound", False, "PolicyInvalid",
                           f"SchedulingPolicy {name!r} is invalid: {self.obs.policy_error}")
        else:
            self.condition("PolicyFound", False, "PolicyNotFound",
                           f"SchedulingPolicy {name!r} does not exist; create it or set "
                           "spec.schedulingPolicyName to an existing policy")

    def template_refused(self) -> bool:
        """Refuse templates that ask for more than the policy allows: no pod is created."""
        assert self.obs.policy is not None
        found = job_violations(self.job["spec"], self.obs.policy.templates)
        name = self.spec.scheduling_policy_name
        if found:
            message = (f"SchedulingPolicy {name!r} does not allow: " + "; ".join(found)
                       + " (set the named spec.templates field of the policy, or remove "
                       "the field from the template)")
            self.condition(TEMPLATE_CONDITION, False, "TemplateRefused", message)
            self.event("TemplateRefused", message, warning=True)
            self.plan.soon(self.settings.resync_seconds)
            return True
        if condition(list(self.status.get("conditions") or []), TEMPLATE_CONDITION) is not None:
            self.condition(TEMPLATE_CONDITION, True, "TemplateAllowed",
                           f"the templates are within SchedulingPolicy {name!r}")
        return False

    def crash_loops(self) -> None:
        """Pods whose containers wait in CrashLoopBackOff show as a condition."""
        looping = crash_looping(self.workers + self.ps)
        current = condition(list(self.status.get("conditions") or []), CRASH_LOOP)
        if looping:
            message = f"{', '.join(looping)}: a container is waiting in {CRASH_LOOP}"
            if current is None or current.get("status") != "True":
                self.event(CRASH_LOOP, message, warning=True)
            self.condition(CRASH_LOOP, True, CRASH_LOOP, message)
        elif current is not None:
            self.condition(CRASH_LOOP, False, "Running", "no container is in CrashLoopBackOff")

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
        """activeDeadlineSeconds counts from the job's creation, through Pending and
        Suspended too: a job that never becomes schedulable still ends, and says why."""
        limit = self.spec.run_policy.active_deadline_seconds
        start = parse_time(self.meta.get("creationTimestamp")) or parse_time(
            self.status.get("startTime"))
        if limit is None or start is None:
            return False
        if self.now - start < limit:
            self.plan.soon(start + limit - self.now)
            return False
        placed = condition(list(self.status.get("conditions") or []), "Schedulable")
        if self.status.get("startTime") is None and self.phase == JobPhase.PENDING:
            why = (f"{placed.get('reason')}: {placed.get('message')}" if placed is not None
                   and placed.get("status") == "False" else "its pods never all became ready")
            self.move(JobPhase.FAILED, "NeverSchedulable",
                      f"not running {limit}s after creation "
                      f"(spec.runPolicy.activeDeadlineSeconds): {why}")
        else:
            self.move(JobPhase.FAILED, "DeadlineExceeded",
                      f"more than spec.runPolicy.activeDeadlineSeconds={limit} since creation")
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
        # Without a usable policy losses still count, with the default thresholds.
        node_loss = (self.obs.policy or SchedulingPolicySpec()).node_loss
        losses, next_at = lost_members(everyone, self.obs.node_down_since,
                                       node_loss.unready_seconds, self.now)
        for loss in losses:
            lost.append(f"{loss.pod.name}/{loss.pod.uid}")
            self.event(loss.reason, f"{loss.message}; replacing it", warning=True)
        if next_at is not None:
            self.plan.soon(next_at - self.now)
        crashed, self.status["containerRestarts"] = new_container_restarts(
            everyone, self.status.get("containerRestarts") or {})
        known = set(self.status.get("lostPods") or [])
        fresh = [key for key in dict.fromkeys(lost) if key not in known]
        # Remember what was counted while it is still visible, so each loss counts once.
        self.status["lostPods"] = sorted((known | set(fresh)) & (present.keys() | members))
        for key in dict.fromkeys(lost):
            p = present.get(key)
            if p is not None and p.state != PodState.DELETING:
                self.plan.delete.append(p.name)
        if not fresh and not crashed:
            return
        restarts = int(self.status.get("restarts", 0)) + len(fresh) + sum(crashed.values())
        self.status["restarts"] = restarts
        self.status["lastFailureTime"] = rfc3339(self.now)
        limit = self.spec.run_policy.backoff_limit
        if fresh:
            names = ", ".join(key.split("/")[0] for key in fresh)
            self.event("MemberLost", f"lost {names} (restart {restarts} of backoffLimit "
                       f"{limit})", warning=True)
        if crashed:
            names = ", ".join(f"{key.split('/')[0]} ({n})" for key, n in crashed.items())
            self.event("ContainerRestarted", f"containers restarted in {names} (restart "
                       f"{restarts} of backoffLimit {limit})", warning=True)
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
        if self.obs.policy is not None and self.gang_withdrawn():
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
        if self.obs.policy is None:
            self.plan.soon(self.settings.resync_seconds)  # placed once the policy is fixed
            return
        hold = self.obs.hold_creates_until
        if hold is not None and self.now < hold:
            self.plan.soon(hold - self.now)  # a refused create waits out its backoff
            return
        last_failure = parse_time(self.status.get("lastFailureTime"))
        if last_failure is not None:
            ready_at = last_failure + backoff(int(self.status.get("restarts", 0)),
                                              self.settings.backoff_base_seconds,
                                              self.settings.backoff_cap_seconds)
            if self.now < ready_at:
                self.plan.soon(ready_at - self.now)
                return
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
                self.plan.create.append(harden(self.job, pod(
                    self.job, role, index, with_node_loss_tolerations(
                        fragment, self.job["spec"], role == WORKER,
                        self.obs.policy.node_loss.toleration_seconds))))
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
        elif (current is not None and status_epoch(self.status) < current.epoch
              and world_digest(current) == membership_digest([*ready, *ready_ps])):
            # The world went out but the status write after it did not (the operator
            # died, or the API server went away, in between): catch up with it.
            self.mirror(current)
        running = self.phase in (JobPhase.RUNNING, JobPhase.RESTARTING)
        if running and len(ready) < self.spec.workers.min:
            self.below_min(len(ready))
        else:
            self.status["belowMinSince"] = None

    def next_epoch(self) -> int:
        """The next world's epoch: above the document, its annotation and the status."""
        current = self.obs.world
        return next_epoch(EpochsSeen(
            document=current.epoch if current else 0,
            annotation=self.obs.world_annotation_epoch,
            status=status_epoch(self.status)))

    def publish(self, ready: list[PodView], ready_ps: list[PodView]) -> None:
        current = self.obs.world
        epoch = self.next_epoch()
        spec = self.spec
        world = build_world(
            JobRef(namespace=self.meta["namespace"], name=self.meta["name"],
                   uid=self.meta.get("uid", "")),
            epoch, ready, current,
            self.obs.inventory.by_name,
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
        self.plan.world_version = self.obs.world_version
        racks, edges, _ = ring_summary(world)
        self.event("WorldPublished", f"epoch {epoch}: {world.size} workers in {racks} racks "
                   f"({edges} cross-rack ring edges)")
        self.mirror(world)

    def mirror(self, world: World) -> None:
        """The job's phase and status follow ``world``, the world its pods now follow."""
        racks, edges, per_rack = ring_summary(world)
        if self.phase in (JobPhase.PENDING, JobPhase.RESTARTING):
            self.move(JobPhase.RUNNING, "Running", f"world epoch {world.epoch} has "
                      f"{world.size} workers (min {self.spec.workers.min})")
            self.status.setdefault("startTime", rfc3339(self.now))
        if (recovered := recovery(self.status, self.now)) is not None:
            self.status["lastRecovery"] = recovered
        self.status["world"] = {
            **(self.status.get("world") or {}),
            "epoch": world.epoch, "size": world.size, "racks": racks, "crossRackEdges": edges,
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
        deleted = set(self.plan.delete) | set(self.plan.delete_gracefully)
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
