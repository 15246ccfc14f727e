"""A worker's training loop in parameter-server mode.

Per batch: take the pulled parameters, compute, push the gradients together with the
data progress, and overlap the next pull with the work around it. In async mode the
next batch's pull starts before this batch's compute (it reads parameters one push
older, within the staleness bound); in sync mode it starts right after the push and
waits on the server for the round to complete while the next batch is fetched.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import torch
from torch import nn

from ringwright.world import World

from ..kvlog import log_event, runtime_logger
from ..membership.source import MembershipSource
from .env import ps_addresses, wait_until_listed
from .metrics import PSMetrics
from .model import PSModel
from .serving.consistency import Consistency, Mode
from .serving.hosting import JobConfig
from .serving.optim import ServerOptimizer
from .wire.client import PendingPull, PSClient, Pulled
from .wire.routing import RecoverySettings

_log = runtime_logger("ps.worker")

B = TypeVar("B")


@dataclass
class PSJob(Generic[B]):
    """What a PS-mode training script declares (see :mod:`.api`)."""

    model: nn.Module
    loss: Callable[[nn.Module, B], torch.Tensor]
    """The batch's loss (a mean over its samples); the worker calls backward()."""
    fetch: Callable[[torch.Tensor], B]
    """The batch for a tensor of sample indices."""
    samples: int
    batch_size: int = 64
    epochs: int = 1
    piece_batches: int = 8
    """Batches per piece handed out by the data-shard service."""
    optimizer: ServerOptimizer = field(default_factory=ServerOptimizer)
    consistency: Consistency = field(default_factory=Consistency)
    ids: Callable[[B], Mapping[str, torch.Tensor]] | None = None
    """Per embedding module (``name.weight``), the ids a batch looks up, so that only
    those rows are pulled (and early). Required when the model has embeddings."""
    requeue_stale: bool = False
    """Train samples whose gradients were dropped as stale again (they are counted
    either way)."""
    on_step: Callable[[StepInfo], None] | None = None
    final_state: bool = False
    """Pull every parameter (whole tables too) when the data is done, into the report
    (a table the servers create row by row is then created whole)."""
    table_init_std: Mapping[str, float] = field(default_factory=dict)
    """For tables on the meta device, which the servers create row by row: the spread of
    their rows by table name (``module.weight``); 1.0 for those not named."""

    def config(self, servers: int, specs: list[Any]) -> JobConfig:
        data = {"samples": self.samples, "pieceSize": self.batch_size * self.piece_batches,
                "epochs": self.epochs, "requeueStale": self.requeue_stale}
        return JobConfig(tuple(specs), servers, self.optimizer, self.consistency, data)


@dataclass(frozen=True)
class StepInfo:
    step: int
    epoch: int
    samples: int
    loss: float
    dropped: bool
    staleness: int
    failovers: int = 0
    """Failovers this worker performed or followed so far."""
    start: int = 0
    stop: int = 0
    """The step's samples: indices ``[start, stop)`` of its epoch."""


@dataclass
class WorkerReport:
    steps: int = 0
    samples: int = 0
    """Samples of every step, trained or dropped."""
    trained_samples: int = 0
    """Samples whose gradients the servers applied."""
    dropped_samples: int = 0
    """Samples whose gradients were dropped as stale."""
    dropped_pushes: int = 0
    lost_updates: int = 0
    left: bool = False
    """Stopped because the world no longer lists this worker (a planned leave)."""
    final: dict[str, torch.Tensor] = field(default_factory=dict)
    """With :attr:`PSJob.final_state`: every parameter at the end, by name."""


class Worker(Generic[B]):
    """Runs a :class:`PSJob` in one worker pod."""

    def __init__(self, job: PSJob[B], source: MembershipSource, pod: str, port: int, *,
                 world_wait_s: float = 900.0,
                 addresses: Callable[[World, int], list[str]] | None = None,
                 metrics: PSMetrics | None = None,
                 recovery: RecoverySettings | None = None,
                 beat: Callable[[], None] | None = None, local_rank: int = 0,
                 shards: int = 0) -> None:
        """``beat``: called on progress (each step, and while waiting alive), for the
        pod's stall watchdog; ``local_rank``: this process's rank inside its pod;
        ``shards``: the model's shards when the first worker creates them (at least one
        per server; more let the servers grow, see :mod:`.placement`)."""
        self.job, self.source, self.pod, self.port = job, source, pod, port
        self.local_rank = local_rank
        self.shards = shards
        self.name = pod if local_rank == 0 else f"{pod}/{local_rank}"
        """How the servers know this worker (:attr:`ringwright.world.Member.process`)."""
        self.world_wait_s = world_wait_s
        self._addresses = addresses or ps_addresses
        self.binding = PSModel(job.model, job.table_init_std)
        self.report = WorkerReport()
        self.metrics = metrics or PSMetrics()
        self.recovery = recovery
        self.beat = beat or (lambda: None)
        self.client: PSClient | None = None
        self._round: dict[int, int] = {}
        """Sync: the version per shard that completes the round this worker last
        pushed into; every pull after a push waits for it."""

    def run(self) -> WorkerReport:
        """Train until the data is done or this worker leaves the world."""
        world = self._wait_for_me()
        client = PSClient(self._addresses(world, self.port), self.name, recovery=self.recovery,
                          beat=self.beat)
        self.client = client
        try:
            client.wait_ready(self.world_wait_s, self.beat)
            # The layout the first worker chose, once it exists; else this worker's.
            shards = client.shard_count() or max(self.shards, world.ps_count)
            client.initialize(self.job.config(shards, self.binding.specs()),
                              self.binding.initial())
            self.binding.release_tables()
            self._loop(client)
        finally:
            self.report.lost_updates = client.lost_updates
            client.close()
        return self.report

    def _loop(self, client: PSClient) -> None:
        sync = self.job.consistency.mode is Mode.SYNC
        while True:
            self.beat()
            if self._left(client):
                client.push({}, {}, client.versions_map(), retire=True)
                self.report.left = True
                log_event(_log, logging.INFO, "ps_worker_left", pod=self.pod)
                return
            lease = client.lease()
            if lease["status"] == "done":
                if self.job.final_state:
                    if sync:
                        # The round this worker pushed into last may still wait for a
                        # peer's push (or retirement): the final state includes it.
                        self._sync_point(client)
                    self.report.final = self._pull_everything(client)
                client.push({}, {}, client.versions_map(), retire=True)
                client.finish()
                log_event(_log, logging.INFO, "ps_worker_done", pod=self.pod, worker=self.name,
                          steps=self.report.steps, dropped=self.report.dropped_pushes)
                return
            if lease["status"] == "wait":
                if sync:
                    # Without data this round: say so, so the others' round completes.
                    self._sync_point(client)
                    versions = client.versions_map()
                    client.push({}, {}, versions, skip=True)
                    self._round = {s: v + 1 for s, v in versions.items()}
                else:
                    time.sleep(0.02)
                continue
            self._train_piece(client, lease)

    def _sync_point(self, client: PSClient) -> None:
        """Sync: wait until the round this worker last pushed into has completed."""
        if self._round:
            client.pull({}, dense=False, min_versions=self._round)
            self._round = {}

    def _train_piece(self, client: PSClient, lease: Mapping[str, Any]) -> None:
        sync = self.job.consistency.mode is Mode.SYNC
        if sync:
            self._sync_point(client)
        bounds = _batches(int(lease["start"]), int(lease["stop"]), self.job.batch_size)
        current = next(bounds, None)
        pending: PendingPull | None = None
        batch: B | None = None
        # Dense values land in the model's parameters: a pull is finished only after the
        # previous step is done with them (its gradients pushed), so no second copy is made.
        into = self.binding.dense_targets()
        while current is not None:
            start, stop = current
            batch = self.job.fetch(torch.arange(start, stop)) if batch is None else batch
            pulled = client.finish_pull(pending, into) if pending is not None else \
                client.pull(batch_ids(self.job, self.binding, batch), into)
            following = next(bounds, None)
            next_batch = None
            pending = None
            if following is not None and not sync:
                next_batch = self.job.fetch(torch.arange(*following))
                pending = client.start_pull(batch_ids(self.job, self.binding, next_batch))
            self.binding.load(pulled.dense, pulled.rows)
            loss = self.job.loss(self.job.model, batch)
            torch.autograd.backward(loss)
            dense, sparse = self.binding.gradients()
            result = client.push(dense, sparse, pulled.versions,
                                 data={"piece": int(lease["piece"]), "start": start,
                                       "stop": stop})
            if sync:
                self._round = {s: v + 1 for s, v in pulled.versions.items()
                               if result.verdicts.get(s) in ("apply", "buffer")}
            if following is not None and sync:
                waits, self._round = self._round, {}
                next_batch = self.job.fetch(torch.arange(*following))
                pending = client.start_pull(batch_ids(self.job, self.binding, next_batch),
                                            min_versions=waits)
            self._account(int(lease["epoch"]), start, stop, loss.item(), result.dropped,
                          result.judged_staleness, len(client.failovers))
            current, batch = following, next_batch
            if following is not None and (not result.data_accepted or self._left(client)):
                if pending is not None:
                    client.finish_pull(pending)
                return

    def _pull_everything(self, client: PSClient) -> dict[str, torch.Tensor]:
        every = {n: torch.arange(rows) for n, (rows, _) in self.binding.shapes.items()}
        pulled = client.pull(every)
        return {**pulled.dense, **{n: rows for n, (_, rows) in pulled.rows.items()}}

    def _account(self, epoch: int, start: int, stop: int, loss: float, dropped: bool,
                 staleness: int, failovers: int) -> None:
        self.beat()
        self.report.steps += 1
        self.report.samples += stop - start
        if dropped:
            self.report.dropped_samples += stop - start
        else:
            self.report.trained_samples += stop - start
        self.report.dropped_pushes += int(dropped)
        self.metrics.worker_step(dropped=dropped)
        if self.job.on_step is not None:
            self.job.on_step(StepInfo(self.report.steps, epoch, stop - start, loss, dropped,
                                      staleness, failovers, start, stop))

    def _left(self, client: PSClient) -> bool:
        world = self.source.latest()
        if world is None:
            return False
        client.set_addresses(self._addresses(world, self.port))
        return world.member(self.pod, self.local_rank) is None

    def _wait_for_me(self) -> World:
        # Every server up: the first worker creates the shards on them.
        return wait_until_listed(
            self.source, lambda w: w.member(self.pod, self.local_rank) is not None
            and bool(w.ps) and len(w.ps) == w.ps_count, self.world_wait_s, self.beat)


def batch_ids(job: PSJob[B], binding: PSModel, batch: B) -> dict[str, torch.Tensor]:
    """The ids each embedding table of ``job.model`` reads for ``batch``."""
    if job.ids is None:
        if binding.tables:
            raise ValueError("PSJob.ids is required: it names the ids each embedding reads")
        return {}
    return dict(job.ids(batch))


def _batches(start: int, stop: int, size: int) -> Iterator[tuple[int, int]]:
    for a in range(start, stop, size):
        yield a, min(a + size, stop)


def pulled_rows(pulled: Pulled) -> int:
    """Rows a pull brought (for logs and benchmarks)."""
    return sum(len(ids) for ids, _ in pulled.rows.values())
