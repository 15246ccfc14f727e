"""The user API: make a training function elastic with a few lines.

::

    from ringwright.runtime.elastic import run
    from ringwright.runtime.sampler import ElasticSampler
    from ringwright.runtime.state import State

    state = State(model, optimizer, ElasticSampler(len(data), batch_size=32))

    def train(state: State) -> None:
        while state.sampler.epoch < epochs:
            ...forward and backward on state.sampler.batch()...
            state.allreduce_gradients()
            optimizer.step()
            state.advance()
            if state.step % 10 == 0:
                state.commit()

    run(train, state)

With a ``DataLoader(data, batch_sampler=state.sampler, num_workers=N)``, iterate it
inside ``train`` (``for x, y in loader:`` in place of ``state.sampler.batch()``): each
call of ``train`` then starts a fresh iteration at the committed cursor, and the
loader discards what its workers had prefetched.

``run`` joins the job's world, syncs the state, and calls ``train``. When a peer
fails, the collective raises, the state rolls back to its last commit, the runtime
waits for the next world, rebuilds the group, syncs and calls ``train`` again, in the
same process. When a new world is published for a planned change, every rank
notices at the same commit and switches without rolling back.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

import torch

from ringwright.exposition import MetricsEndpoint, serve
from ringwright.kube import KubeClient, KubeConfig, in_cluster_config, load_kubeconfig
from ringwright.world import (
    Backend,
    Env,
    ReportKind,
    World,
    reports_configmap_name,
    world_configmap_name,
)

from .checkpoint.checkpointer import Checkpointer
from .checkpoint.policy import TerminationSignal
from .checkpoint.storage import storage_for
from .collectives.backend import CollectiveBackend, CollectiveError
from .collectives.group import (
    Fenced,
    GroupManager,
    LeftWorld,
    MemberInfo,
    WorldChanged,
    choose_source,
)
from .collectives.torch_backend import TorchDistributedBackend
from .exiting import freeze_objects_at_exit
from .kvlog import log_event, runtime_logger
from .launch import local_rank_from_env
from .local.solo import SOLO_POD, SoloBackend, SoloSource, solo_world
from .membership.file_source import FileMembershipSource
from .membership.health import ReadinessServer, StallWatchdog, show_readiness
from .membership.kube_source import KubeMembershipSource
from .membership.liveness import LagListener, PeerFailure
from .membership.reporter import FileReporter, KubeReporter, LogReporter, Reporter
from .membership.source import MembershipSource
from .metrics import MeteredBackend, RuntimeMetrics, StepMeter
from .settings import RuntimeSettings, SettingsEnv
from .state import State, Terminated
from .state_sync import shared_commit
from .timekeeping import StatsSender, TimeKeeper

_log = runtime_logger("elastic")

INIT_ABANDONED_EXIT = 70
"""Exit status (EX_SOFTWARE) of a member that gave up a Horovod init in which a peer
died: nothing can interrupt ``hvd.init()``, so its container restarts without state
and rejoins a later generation, from the last commit, which one survivor checkpointed."""

R = TypeVar("R")

BackendFactory = Callable[[Backend, torch.device, RuntimeSettings], CollectiveBackend]
"""Builds the collective backend for a backend kind and the state's device."""


def default_backend(kind: Backend, device: torch.device, settings: RuntimeSettings, *,
                    on_heartbeat_lag: LagListener | None = None) -> CollectiveBackend:
    """torch.distributed or Horovod (imported only when asked for: it is optional),
    telling ``on_heartbeat_lag`` how stale the peers' heartbeats are."""
    if kind is Backend.HOROVOD:
        from .collectives.horovod_backend import HorovodBackend

        return HorovodBackend(device, settings, on_heartbeat_lag=on_heartbeat_lag)
    return TorchDistributedBackend(device, settings, on_heartbeat_lag=on_heartbeat_lag)


class _StopWaiting(BaseException):
    """SIGTERM arrived while this member was forming a group, syncing or waiting.

    A BaseException, like KeyboardInterrupt, so that no library's ``except Exception``
    on the way (a store client retrying a connection) swallows it.
    """


class _Interrupter:
    """Signal callback that interrupts the main thread, but only while it is armed.

    Training itself is never interrupted (a half-done step cannot be checkpointed; the
    loop reads the flag at step boundaries). Waits are: a world that never comes or a
    peer that never arrives must not hold a member past its grace period.
    """

    def __init__(self) -> None:
        self.armed = False

    def __call__(self, signum: int) -> None:
        if self.armed:
            self.armed = False
            raise _StopWaiting(signum)

    @contextlib.contextmanager
    def armed_while(self, stop: TerminationSignal | None) -> Iterator[None]:
        """Let a signal interrupt the body (also one that came just before)."""
        if stop is None:
            yield
            return
        self.armed = True
        try:
            if stop.requested:
                raise _StopWaiting(stop.signum)
            yield
        finally:
            self.armed = False


class ElasticRuntime:
    """Runs a training function elastically in one member of a job's world."""

    def __init__(
        self,
        source: MembershipSource,
        pod: str,
        *,
        settings: RuntimeSettings | None = None,
        reporter: Reporter | None = None,
        backend_kind: Backend = Backend.TORCH,
        backend_factory: BackendFactory | None = None,
        clock: Callable[[], float] = time.monotonic,
        metrics: RuntimeMetrics | None = None,
        local_rank: int = 0,
        pod_uid: str = "",
    ) -> None:
        self.source = source
        self.pod = pod
        self.pod_uid = pod_uid
        """The pod's uid, where the pod's environment gives it (``RINGWRIGHT_POD_UID``)."""
        self.local_rank = local_rank
        """This process's rank inside its pod, set by the pod's entry point
        (:mod:`ringwright.runtime.launch`)."""
        self.settings = settings or RuntimeSettings()
        self.reporter = reporter or LogReporter(pod)
        self._backend_kind = backend_kind
        self._backend_factory = backend_factory
        self._clock = clock
        self.watchdog = StallWatchdog(self.settings.stall_timeout_s, clock=clock)
        self._readiness: ReadinessServer | None = None
        self.metrics = metrics or RuntimeMetrics(clock=clock)
        self._metrics_endpoint: MetricsEndpoint | None = None
        self._backend: CollectiveBackend | None = None
        self._started = False
        self._interrupter = _Interrupter()
        self._checkpointer: Checkpointer | None = None
        self.timekeeper = TimeKeeper(clock=clock)
        """Where this member's time goes (phases, step times), sent beside its reports."""
        self._stats = StatsSender(self.timekeeper, self.reporter.stats,
                                  self.settings.stats_interval_s, clock=clock)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None,
                 **setting_overrides: Any) -> ElasticRuntime:
        """Configure from the variables the operator (or a local launcher) sets.

        ``RINGWRIGHT_WORLD_FILE`` selects the local file source; otherwise the world
        ConfigMap is watched with ``$KUBECONFIG`` or the pod's ServiceAccount. With none
        of ``RINGWRIGHT_POD_NAME``, ``RINGWRIGHT_JOB_NAME`` and ``RINGWRIGHT_WORLD_FILE``
        set (``python train.py``, a debugger, a notebook) the process trains alone as a
        world of one (:mod:`~ringwright.runtime.local.solo`): no store, no heartbeats,
        and no stall watchdog unless ``RINGWRIGHT_STALL_TIMEOUT_SECONDS`` asks for one.
        """
        env = os.environ if environ is None else environ
        if not any(env.get(name, "") for name in (Env.POD_NAME, Env.JOB_NAME, Env.WORLD_FILE)):
            return cls.solo(env, **setting_overrides)
        pod = env.get(Env.POD_NAME, "")
        if not pod:
            raise ValueError(f"{Env.POD_NAME} is not set: the runtime needs its pod's name")
        local_rank = local_rank_from_env(env)
        settings = RuntimeSettings.from_env(env, **setting_overrides)
        kind = Backend(env.get(Env.BACKEND) or Backend.TORCH.value)
        world_file = env.get(Env.WORLD_FILE, "")
        if world_file:
            source: MembershipSource = FileMembershipSource(
                Path(world_file), poll_interval=settings.file_poll_interval_s)
            reports_dir = env.get(Env.REPORTS_DIR, "")
            local: Reporter = FileReporter(Path(reports_dir), pod) if reports_dir \
                else LogReporter(pod)
            return cls(source, pod, settings=settings, reporter=local, backend_kind=kind,
                       local_rank=local_rank, pod_uid=env.get(Env.POD_UID, ""))
        job = env.get(Env.JOB_NAME, "")
        if not job:
            raise ValueError(f"set {Env.JOB_NAME} (in a pod) or {Env.WORLD_FILE} (locally)")
        config = _kube_config(env)
        namespace = env.get(Env.NAMESPACE) or config.namespace

        def client() -> KubeClient:
            # Re-read the credentials on every reconnect: projected tokens rotate.
            return KubeClient(_kube_config(env))

        source = KubeMembershipSource(
            client, namespace, env.get(Env.WORLD_CONFIGMAP) or world_configmap_name(job))
        reporter = KubeReporter(
            client, namespace, env.get(Env.REPORTS_CONFIGMAP) or reports_configmap_name(job),
            pod, key=env.get(Env.REPORT_KEY, ""))
        return cls(source, pod, settings=settings, reporter=reporter, backend_kind=kind,
                   local_rank=local_rank, pod_uid=env.get(Env.POD_UID, ""))

    @classmethod
    def solo(cls, environ: Mapping[str, str] | None = None,
             **setting_overrides: Any) -> ElasticRuntime:
        """A runtime that trains this process alone, as rank 0 of a world of one."""
        env = os.environ if environ is None else environ
        if not env.get(SettingsEnv.STALL_TIMEOUT, ""):
            # A breakpoint is no stall, and nobody reads readiness here.
            setting_overrides.setdefault("stall_timeout_s", 0.0)
        settings = RuntimeSettings.from_env(env, **setting_overrides)
        log_event(_log, logging.INFO, "solo_run", pod=SOLO_POD,
                  why=f"none of {Env.POD_NAME}, {Env.JOB_NAME}, {Env.WORLD_FILE} is set")
        return cls(SoloSource(solo_world(SOLO_POD)), SOLO_POD, settings=settings,
                   backend_factory=lambda _kind, device, _settings: SoloBackend(device))

    def run(self, train_fn: Callable[[State], R], state: State) -> R:
        """Call ``train_fn(state)`` until it returns, across any number of world changes.

        Raises :class:`~ringwright.runtime.collectives.group.LeftWorld` (exit status 0) when this
        pod is dropped from the world, :class:`~ringwright.runtime.collectives.group.Fenced`
        (non-zero) when it is dropped or finds no world after a failure. A failure of
        the group, in the runtime's collectives or in ``torch.distributed`` /
        ``horovod.torch`` calls made by ``train_fn`` itself, rolls back to the last
        commit and rejoins.
        """
        if self._backend is None:
            kind, device, settings = self._backend_kind, state.device, self.settings
            inner = (self._backend_factory(kind, device, settings)
                     if self._backend_factory is not None
                     else default_backend(kind, device, settings,
                                          on_heartbeat_lag=self.metrics.heartbeat_lag.set))
            self._backend = MeteredBackend(inner, self.metrics,
                                           on_gradient_wait=self.timekeeper.waited)
            self._leave_stuck_inits(inner, state)
        manager = GroupManager(self.source, self._backend, self.pod, self.settings,
                               self.reporter, self.watchdog, local_rank=self.local_rank,
                               pod_uid=self.pod_uid, clock=self._clock)
        state.bind(StepMeter(manager, state, self.metrics, on_progress=self._stepped))
        if isinstance(state.checkpointer, Checkpointer):
            state.checkpointer.add_listener(self.metrics.checkpoint_written)
        self._start_health(manager)
        stop = self._termination_signal()
        state.stop = stop
        after = manager.generation
        try:
            while True:
                # The watchdog keeps running: joining beats it while it waits alive,
                # so only a member hung while forming or syncing turns unready.
                try:
                    with self._interrupter.armed_while(stop):
                        self._form(manager, state, after)
                except _StopWaiting:
                    log_event(_log, logging.INFO, "stop_while_forming",
                              generation=manager.generation, step=state.step,
                              committed_generation=state.synced_generation)
                    state.stop_if_signalled(committed=True)
                try:
                    return train_fn(state)
                except WorldChanged:
                    manager.leave_cleanly()
                except RuntimeError as raised:
                    err = manager.backend.failure_of(raised)
                    if err is None:
                        raise
                    manager.failed(err)
                    before = state.step
                    state.restore()
                    self.timekeeper.failed(before, state.step)
                    self.metrics.rolled_back(ReportKind.COLLECTIVE_FAILED.value,
                                             before - state.step)
                    log_event(_log, logging.WARNING, "rolled_back", generation=manager.generation,
                              step=state.step, error=err)
                    # Peers failing because the whole job is being stopped: keep the
                    # last commit rather than wait for a world that will not come.
                    state.stop_if_signalled(committed=True)
                after = manager.generation
        except LeftWorld as left:
            flushed = self._checkpoint_when_the_job_stops(state, left.world)
            log_event(_log, logging.INFO, "left_world", pod=self.pod, message=left.message,
                      **({} if flushed is None else {"checkpoint_flushed": flushed}))
            self.reporter.report(ReportKind.LEFT, max(manager.generation, 0), left.message)
            raise
        except Fenced as fenced:
            log_event(_log, logging.WARNING, "fenced", pod=self.pod, message=fenced.message)
            self.reporter.report(ReportKind.LEFT, max(manager.generation, 0), fenced.message)
            raise
        except Terminated as term:
            log_event(_log, logging.INFO, "terminated", pod=self.pod, signal=term.signum,
                      step=term.step, checkpoint_flushed=term.flushed)
            raise
        finally:
            state.stop = None
            if stop is not None:
                stop.uninstall()

    def _checkpoint_when_the_job_stops(self, state: State, world: World) -> bool | None:
        """A world without members stops the whole job (suspended, or evicted by a queue,
        before its pods get SIGTERM): the member that writes checkpoints writes the last
        commit, so the job resumes where it stopped. Whether the write finished within the
        termination grace; None when this member wrote nothing."""
        guard = state.checkpoints
        if world.members or guard is None or state.synced_rank != 0:
            return None
        # Left at a commit: written already if the interval fell on it.
        if state.checkpointed_step != state.step and not state.save_checkpoint():
            return False
        return guard.flush(timeout=self.settings.termination_grace_s)

    def _leave_stuck_inits(self, backend: CollectiveBackend, state: State) -> None:
        """Have a Horovod backend that finds a peer dead inside ``hvd.init()`` save the
        last commit (one survivor writes) and exit for a restart, rather than wait out
        Horovod's timeout of minutes."""
        from .collectives.horovod_backend import HorovodBackend

        if not isinstance(backend, HorovodBackend):
            return

        def abandon(failure: PeerFailure) -> None:
            alive = [p for p in state.synced_members if p not in failure.pods]
            # Every survivor that holds the commit computes the same writer.
            saved = bool(alive) and alive[0] == self.pod and self.local_rank == 0 \
                and state.save_checkpoint(writer=True)
            guard = state.checkpoints
            flushed = saved and guard is not None and guard.flush(
                timeout=self.settings.termination_grace_s)
            log_event(_log, logging.WARNING, "init_abandoned", pod=self.pod,
                      generation=failure.generation, dead=",".join(failure.pods), step=state.step,
                      checkpoint_saved=flushed, exit_code=INIT_ABANDONED_EXIT)
            self.reporter.close()
            for handler in logging.getLogger().handlers:
                handler.flush()
            os._exit(INIT_ABANDONED_EXIT)

        backend.on_stuck_init = abandon

    def _termination_signal(self) -> TerminationSignal | None:
        """Catch SIGTERM so a final checkpoint can be written within the grace period.

        Python delivers signals to the main thread only; a runtime driven from another
        thread leaves SIGTERM's handling to its host.
        """
        if threading.current_thread() is not threading.main_thread():
            return None
        return TerminationSignal(self.settings.termination_grace_s,
                                 callback=self._interrupter).install()

    def close(self) -> None:
        """Leave the group, stop health reporting and watching, flush reports."""
        if self._backend is not None:
            self._backend.close()
        if self._checkpointer is not None:
            self._checkpointer.close()
        self.watchdog.stop()
        if self._readiness is not None:
            self._readiness.stop()
        if self._metrics_endpoint is not None:
            self._metrics_endpoint.stop()
        self.source.close()
        self.reporter.close()

    def __enter__(self) -> ElasticRuntime:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def _form(self, manager: GroupManager, state: State, after: int) -> World:
        """Join the next world and bring every member to one state."""
        backend = manager.backend
        while True:
            self.timekeeper.forming()
            world = manager.join(after)
            after = world.generation
            self._checkpoint_from(world, state, manager)
            try:
                infos = backend.allgather_object(
                    MemberInfo(self.pod, state.synced_generation, state.synced_rank, state.step))
                src = choose_source(infos)
                restored = False
                if src is None:
                    # A fresh start: rank 0 resumes from the newest checkpoint, if any,
                    # and everyone adopts rank 0's state (its initial weights otherwise).
                    restored = manager.rank == 0 and state.restore_checkpoint()
                    src = 0
                skip = shared_commit(infos)
                if not skip:
                    # Marks the start of a possibly long transfer (tests wait for it).
                    log_event(_log, logging.INFO, "sync_started", generation=world.generation,
                              rank=manager.rank, source_rank=src)
                self.timekeeper.syncing()
                state.sync(src, skip=skip)
            except RuntimeError as raised:
                err = backend.failure_of(raised)
                if err is None:
                    raise
                manager.failed(CollectiveError(f"syncing state: {err}"))
                log_event(_log, logging.WARNING, "sync_failed", generation=world.generation,
                          error=err)
                if state.synced_generation >= 0:
                    state.restore()
                continue
            state.follow_world(world, manager.rank)
            self.timekeeper.world_ready(world.generation, state.step)
            self.metrics.world_ready(world, manager.rank, state.lr.factor(state.step))
            log_event(_log, logging.INFO, "world_ready", generation=world.generation,
                      size=world.size, rank=manager.rank, source_rank=src,
                      source_pod=infos[src].pod, from_checkpoint=restored, step=state.step,
                      synced_bytes=state.sync_bytes, lr=state.lr.scaled_lrs()[0])
            return world

    def _stepped(self, state: State) -> None:
        """After every step and commit: time it, and now and then send the stats (one
        process per pod sends them: its local rank 0)."""
        self.timekeeper.stepped(state.step)
        if self.local_rank != 0:
            return
        guard = state.checkpoints
        writes = guard is not None and state.synced_rank == 0
        self._stats.maybe_send(
            checkpointIntervalSteps=state.checkpoint_interval_steps(),
            checkpointWriteSeconds=guard.last_write_s if writes and guard else None,
            mtbfSeconds=state.mtbf_seconds() if state.auto_interval is not None else None)

    def _checkpoint_from(self, world: World, state: State, manager: GroupManager) -> None:
        """Give the state a checkpointer built from ``spec.checkpoint`` unless the script
        brought its own, and route checkpoint failures to the operator."""
        settings = world.checkpoint
        if state.checkpoints is None and settings.path:
            self._checkpointer = Checkpointer(storage_for(settings.path), keep=settings.keep)
            state.use_checkpointer(self._checkpointer, where=settings.path)
            log_event(_log, logging.INFO, "checkpointer_from_job", path=settings.path,
                      keep=settings.keep, interval_steps=settings.interval_steps,
                      interval_seconds=settings.interval_seconds)
        guard = state.checkpoints
        if guard is not None and guard.report is None:
            def report(detail: str, failing: bool) -> None:
                kind = ReportKind.CHECKPOINT_FAILED if failing else ReportKind.CHECKPOINT_OK
                manager.report(kind, detail)

            guard.report = report

    def _start_health(self, manager: GroupManager) -> None:
        if self._started:
            return
        self._started = True
        s = self.settings
        self._readiness = show_readiness(self.watchdog, s, _log)
        if s.metrics_port:
            try:
                self._metrics_endpoint = serve(self.metrics.registry, s.metrics_port,
                                               s.metrics_address)
            except OSError as err:
                # Metrics are for people watching; training goes on without them.
                log_event(_log, logging.WARNING, "metrics_not_served", port=s.metrics_port,
                          address=s.metrics_address, error=err)

        def report_stall(ready: bool, idle_s: float) -> None:
            if not ready:
                manager.report(ReportKind.STALLED, f"no progress for {idle_s:.0f}s")

        self.watchdog.add_listener(report_stall)
        self.watchdog.start()


def run(train_fn: Callable[[State], R], state: State,
        runtime: ElasticRuntime | None = None) -> R:
    """Run ``train_fn`` elastically, with a runtime configured from the environment
    unless one is given (a given runtime stays open for the caller to close)."""
    freeze_objects_at_exit()
    if runtime is not None:
        return runtime.run(train_fn, state)
    with ElasticRuntime.from_env() as rt:
        return rt.run(train_fn, state)


def _kube_config(env: Mapping[str, str]) -> KubeConfig:
    kubeconfig = env.get("KUBECONFIG", "")
    if kubeconfig:
        return load_kubeconfig(kubeconfig.split(os.pathsep)[0])
    return in_cluster_config()
