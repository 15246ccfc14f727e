"""The parameter server's state machine: shards, consistency, replicas, the data service.

Transport-free: :mod:`.transport` maps gRPC calls onto these methods, which take and
return a header (JSON values) and tensors. One condition variable per shard guards its
parameters; sync pulls wait on it for the next version.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable, Mapping
from concurrent import futures
from typing import Any

import torch

from ..data.journal import JournalIn, JournalOut, JournalSend
from ..data.service import DataShardService, Lease, LeaseStatus, Op
from ..metrics import PSMetrics
from ..partition import Partition
from ..wire.codec import Header, Tensors
from .consistency import Mode, Verdict, judge, round_complete
from .hosting import Hosted, IncompletePush, JobConfig, NotServing, Role, Stats
from .shard import Lent, Loan, ShardState, reduce_sparse

DATA_SHARD = 0
"""The data-shard service lives with shard 0 (and fails over with it)."""
COPY_PIECE_BYTES = 4 << 20
"""A whole copy of a shard for another server is taken this much at a time, the shard's
lock let go between pieces: calls for the shard wait for a piece, not for the whole copy
(60-90 ms for 168 MB on two busy cores)."""
COPY_NICE = 10
"""How much lower the CPU priority of the thread that takes and builds whole copies of
shards is: on two busy cores, a 168 MB copy slowed the workers' steps around a resize
by about 0.2 s in all; training goes first, the copy waits."""
FIXES = "+"
"""Prefix of the keys of a whole copy that carry what changed while it was taken."""
MOVE_WAIT_S = 10.0
"""How long a call for a shard being handed over waits for the hand-over to end (it
then fails with :class:`NotServing`, and the worker follows the shard to its new home)."""

MOVED_GRACE_S = 10.0
"""How long the copy a hand-over leaves behind is not promoted (see ``Role.MOVED``)."""

HandOver = Callable[[Header, Tensors], bool]
"""Deliver a shard's whole state to its new home (``Adopt``); True once it serves it."""


class ParameterServer:
    """Everything one PS process hosts."""

    def __init__(self, index: int, clock: Callable[[], float] = time.monotonic,
                 metrics: PSMetrics | None = None, journal: JournalSend | None = None) -> None:
        """``journal`` sends each change of the data-shard service to the replica of
        shard 0 before the change is answered (None: a single server, no replica)."""
        self.index = index
        self.clock = clock
        self.metrics = metrics or PSMetrics()
        self.config: JobConfig | None = None
        self.partition: Partition | None = None
        self.hosted: dict[int, Hosted] = {}
        self.workers: frozenset[str] = frozenset()
        self.retired: set[str] = set()
        """Workers that are done with the data: sync rounds no longer wait for them."""
        self.stats = Stats()
        self.data: DataShardService | None = None
        self.finished = threading.Event()
        self._staged: dict[tuple[str, str], Tensors] = {}
        """Parts of pushes in flight, by (worker, push id)."""
        self._journal_out = JournalOut(journal)
        """Lock order: a shard's condition, then the journal's lock, then ``_lock``."""
        self._journal_in = JournalIn()
        self._lock = threading.Lock()
        """Guards config, hosted (the dict), workers and the data service."""
        self._copier = futures.ThreadPoolExecutor(1, thread_name_prefix=f"ps{index}-copy",
                                                  initializer=_lower_priority)
        """Takes and builds whole copies of shards, at a lower CPU priority."""

    # -- set-up --------------------------------------------------------------------

    def _configure(self, doc: Mapping[str, Any]) -> JobConfig:
        """The job's configuration: the first one given; a later one must describe the
        same tensors, shards and optimizer (the layout the shards were built for)."""
        given = JobConfig.from_json(doc)
        if self.config is None:
            self.config = given
            self.partition = given.partition()
        elif (given.specs, given.shards, given.optimizer) != (
                self.config.specs, self.config.shards, self.config.optimizer):
            raise ValueError(
                f"ps {self.index}: this job's model or optimizer ({_layout(given)}) is not the "
                f"one its shards hold ({_layout(self.config)}), which were restored from a "
                f"checkpoint or created by an earlier worker. Train the model the checkpoint "
                f"was written for, or start from another checkpoint directory.")
        return self.config

    def init(self, header: Header, tensors: Tensors) -> Header:
        """Create shard ``header['shard']`` from initial values unless it exists (first wins)."""
        shard = int(header["shard"])
        with self._lock:
            config = self._configure(header["config"])
            assert self.partition is not None
            created = shard not in self.hosted
            if created:
                state = ShardState(self.partition, shard, config.optimizer, tensors)
                self.hosted[shard] = Hosted(state, 0, Role.PRIMARY)
            if (shard == DATA_SHARD and self.data is None
                    and self.hosted[shard].role is Role.PRIMARY):
                # Also for a shard 0 served without one (restored from a checkpoint that
                # had none): no lease could be given out otherwise.
                d = config.data
                self.data = DataShardService(int(d["samples"]), int(d["pieceSize"]),
                                             int(d["epochs"]),
                                             requeue_stale=bool(d.get("requeueStale")))
            return {"created": created, "version": self.hosted[shard].version}

    def status(self) -> Header:
        """Which shards this server holds, in which role and at which version."""
        with self._lock:
            self._settle_moved()
            return {"index": self.index, "configured": self.config is not None,
                    "shardCount": self.config.shards if self.config is not None else 0,
                    "shards": {str(s): {"role": h.role.value, "version": h.version}
                               for s, h in self.hosted.items()},
                    "applied": self.stats.applied, "stale": self.stats.stale,
                    "staleness": {str(k): v for k, v in sorted(self.stats.staleness.items())},
                    "droppedStaleness": {str(k): v for k, v in
                                         sorted(self.stats.stale_staleness.items())},
                    "data": self._data_summary()}

    def _data_summary(self) -> dict[str, Any] | None:
        if self.data is None:
            return None
        a = self.data.accounting
        return {"epoch": self.data.epoch, "done": self.data.done,
                "trained": {str(k): v for k, v in a.trained.items()},
                "dropped": {str(k): v for k, v in a.dropped.items()},
                "requeued": {str(k): v for k, v in a.requeued.items()},
                "requeuedStale": {str(k): v for k, v in a.requeued_stale.items()}}

    def set_workers(self, workers: frozenset[str]) -> None:
        """The current workers (from the world): sync rounds and data leases follow them."""
        with self._lock:
            gone = self.workers - workers
            self.workers = workers
            hosted = list(self.hosted.values())
            leaving = sorted(gone | (self.data.holders() - workers)) if self.data else []
        tickets = [self._data_op(["release", worker])[1] for worker in leaving]
        self._journaled(max(tickets, default=0))
        for h in hosted:
            with h.cond:
                self._maybe_complete(h)

    # -- serving ---------------------------------------------------------------------

    def _primary(self, shard: int) -> Hosted:
        """The shard if served here; a call for a shard being handed over waits for the
        hand-over to end, so that the worker finds the new home at its first look."""
        with self._lock:
            h = self.hosted.get(shard)
        if h is not None and h.role is Role.MOVING:
            with h.cond:
                h.cond.wait_for(lambda: h.role is not Role.MOVING, MOVE_WAIT_S)
        if h is None or h.role is not Role.PRIMARY:
            moved_to = h.moved_to if h is not None and h.role is Role.MOVED else None
            raise NotServing(f"ps {self.index} does not serve shard {shard}"
                             + (f" (handed to ps {moved_to})" if moved_to is not None else ""),
                             moved_to)
        return h

    def pull(self, header: Header, tensors: Tensors) -> tuple[Header, Tensors]:
        """Dense slices and requested rows of a shard, once it reaches ``minVersion``.
        The slices are the shard's own tensors, lent until the reply is sent: an update
        meanwhile writes a copy of them instead (:meth:`ShardState.lend`)."""
        shard = int(header["shard"])
        h = self._primary(shard)
        self.metrics.pulled(shard)
        deadline = self.clock() + float(header.get("timeout", 30.0))
        with h.cond:
            want = int(header.get("minVersion", 0))
            while h.version < want and h.role is Role.PRIMARY:
                left = deadline - self.clock()
                if left <= 0:
                    break
                h.cond.wait(left)
            return self._read(h, shard, header, tensors)

    def pull_at_once(self, header: Header, tensors: Tensors) -> tuple[Header, Tensors] | None:
        """:meth:`pull`'s reply if it needs no wait: the shard is at ``minVersion`` and
        no update holds it. None otherwise (call :meth:`pull`, which waits)."""
        shard = int(header["shard"])
        with self._lock:
            h = self.hosted.get(shard)
        if h is not None and h.role is Role.MOVING:
            return None  # waits in the pool (:meth:`pull`), not on the loop thread
        h = self._primary(shard)
        if not h.cond.acquire(blocking=False):
            return None
        try:
            if h.version < int(header.get("minVersion", 0)) and h.role is Role.PRIMARY:
                return None
            self.metrics.pulled(shard)
            return self._read(h, shard, header, tensors)
        finally:
            h.cond.release()

    def _read(self, h: Hosted, shard: int, header: Header, tensors: Tensors
              ) -> tuple[Header, Tensors]:
        """A pull's reply, read under ``h.cond``."""
        if h.role is not Role.PRIMARY:
            raise NotServing(f"ps {self.index} stepped down from shard {shard}")
        rows = {k.removeprefix("i/"): v for k, v in tensors.items() if k.startswith("i/")}
        dense = header.get("dense", True)
        loan = Loan(frozenset())
        values = h.state.read(dense if isinstance(dense, list) else bool(dense), rows, loan)
        return {"version": h.version}, Lent(values, loan)

    def push(self, header: Header, tensors: Tensors) -> Header:
        """Gradients computed from ``version``: applied, buffered for the round, or dropped."""
        shard, worker = int(header["shard"]), str(header["worker"])
        h = self._primary(shard)
        assert self.config is not None
        if header.get("retire"):
            with self._lock:
                self.retired.add(worker)
            with h.cond:
                h.round.pop(worker, None)
                self._maybe_complete(h)
                return {"verdict": "retired", "staleness": 0, "version": h.version}
        if "staged" in header:
            with self._lock:
                staged = self._staged.pop((worker, str(header["staged"])), {})
            if len(staged) < int(header.get("stagedCount", 0)):
                raise IncompletePush(f"ps {self.index}: push {header['staged']} of {worker} "
                                     f"names {header['stagedCount']} staged tensors, "
                                     f"{len(staged)} arrived")
            tensors = {**staged, **tensors}
        dense = {k[2:]: v for k, v in tensors.items() if k.startswith("g/")}
        sparse = {k[2:]: (v, tensors[f"r/{k[2:]}"]) for k, v in tensors.items()
                  if k.startswith("i/")}
        reply, ticket = self._take_push(h, shard, worker, header, dense, sparse)
        # The journal is sent once the shard's lock is let go: pulls and other pushes
        # go on meanwhile, and concurrent reports leave in one message.
        self._journaled(ticket)
        return reply

    def _take_push(self, h: Hosted, shard: int, worker: str, header: Header,
                   dense: dict[str, torch.Tensor],
                   sparse: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> tuple[Header, int]:
        """Judge and apply (or buffer, or drop) one push under the shard's lock; the
        reply and the journal ticket of its data report (0: none to wait for)."""
        assert self.config is not None
        skip = bool(header.get("skip"))
        push_id = str(header.get("push", ""))
        with h.cond:
            if h.role is not Role.PRIMARY:
                raise NotServing(f"ps {self.index} stepped down from shard {shard}")
            seen = h.pushes.get(worker)
            if push_id and seen is not None and seen[0] == push_id:
                # A retry of a push already taken: answered once its report is kept.
                return seen[1], self._journal_out.latest() if shard == DATA_SHARD else 0
            pushed_from = min(int(header["version"]), h.version)
            with self._lock:
                workers = len((self.workers | {worker}) - self.retired)
            # The other shards take shard 0's verdict on the step (a worker's client asks
            # shard 0 first), so a step updates every shard or none.
            verdict = Verdict(header["follow"]) if "follow" in header else judge(
                self.config.consistency, h.version, pushed_from, worker in h.round,
                len(h.round), workers)
            staleness = h.version - pushed_from
            self.metrics.pushed(shard, verdict, staleness, skip=skip)
            if skip:
                pass  # no gradient: counts only towards completing a sync round
            elif verdict is Verdict.STALE:
                self.stats.stale += 1
                self.stats.stale_staleness[staleness] += 1
            elif verdict is not Verdict.DUPLICATE:
                self.stats.staleness[staleness] += 1
            if verdict is Verdict.APPLY and self.config.consistency.mode is Mode.ASYNC:
                if not skip:
                    h.state.apply(dense, sparse, 1.0)
                    self._bump(h)
            elif verdict in (Verdict.APPLY, Verdict.BUFFER):
                h.round[worker] = None if skip else (dense, sparse)
                self._maybe_complete(h)
            reply: Header = {"verdict": verdict.value, "staleness": staleness,
                             "version": h.version}
            ticket = 0
            if "data" in header and shard == DATA_SHARD and verdict is not Verdict.DUPLICATE:
                d = header["data"]
                # Refused when the lease is not this worker's (it was given up on): the
                # worker then drops the rest of that piece.
                accepted, ticket = self._data_op(
                    ["report", worker, int(d["piece"]), int(d["start"]), int(d["stop"]),
                     verdict is Verdict.STALE])
                reply["dataAccepted"] = bool(accepted)
            if push_id:
                h.pushes[worker] = (push_id, reply)
            return reply, ticket

    def stage(self, header: Header, tensors: Tensors) -> Header:
        """Hold part of a large push until the ``Push`` naming it arrives (big pushes
        travel as several concurrent messages, which gRPC moves much faster)."""
        key = (str(header["worker"]), str(header["staged"]))
        with self._lock:
            # One staged push per worker at a time: older ones were abandoned.
            self._staged = {k: v for k, v in self._staged.items() if k[0] != key[0] or k == key}
            self._staged.setdefault(key, {}).update(tensors)
        return {}

    def _bump(self, h: Hosted) -> None:
        h.version += 1
        self.stats.applied += 1
        h.cond.notify_all()

    def _maybe_complete(self, h: Hosted) -> None:
        """Sync: apply the round's mean gradient once enough workers pushed (holds h.cond)."""
        assert self.config is not None or not h.round
        if self.config is None or self.config.consistency.mode is not Mode.SYNC:
            return
        with self._lock:
            workers = len(self.workers - self.retired)
        if not round_complete(self.config.consistency, len(h.round), workers):
            return
        pushes = [p for p in h.round.values() if p is not None]
        h.round.clear()
        count = len(pushes)
        if count == 0:
            self._bump(h)  # every worker was without data: keep the round count in step
            return
        dense: dict[str, torch.Tensor] = {}
        for grads, _ in pushes:
            for key, g in grads.items():
                dense[key] = dense[key] + g if key in dense else g.to(torch.float32).clone()
        names = {name for _, sp in pushes for name in sp}
        sparse = {name: reduce_sparse([sp[name] for _, sp in pushes if name in sp])
                  for name in names}
        h.state.apply(dense, sparse, 1.0 / count)
        self._bump(h)

    def lease(self, header: Header) -> Header:
        """A piece of the epoch for a worker (only on the server holding the data service)."""
        self._primary(DATA_SHARD)
        lease, ticket = self._data_op(["lease", str(header["worker"])])
        self._journaled(ticket)
        if lease is None:
            raise NotServing("the data-shard service is not initialised")
        assert isinstance(lease, Lease)
        if lease.status is LeaseStatus.DONE:
            self.finished.set()
        return {"status": lease.status.value, "piece": lease.piece, "epoch": lease.epoch,
                "start": lease.start, "stop": lease.stop}

    def _data_op(self, op: Op) -> tuple[Lease | bool | int | None, int]:
        """Change the data-shard service (None when this server has none) and record
        the change for the journal; with its ticket, which the caller passes to
        :meth:`_journaled` before it answers."""
        with self._journal_out.lock:
            with self._lock:
                if self.data is None:
                    return None, 0
                before = self.data.seq
                result = self.data.perform(op)
                entry = {"term": self.data.term, "from": before, "seq": self.data.seq,
                         "op": op}
            return result, self._journal_out.record(entry) if entry["seq"] != before else 0

    def _journaled(self, ticket: int) -> None:
        """Wait until the replica of shard 0 keeps the changes up to ``ticket``: a
        failover then finds every sample reported so far, and none is trained twice.
        Called holding no lock."""
        if ticket and not self._journal_out.flush(ticket):
            self.resend(DATA_SHARD)  # the next whole copy turns the journal on again

    # -- replicas --------------------------------------------------------------------

    def snapshot(self, shard: int, to: str = "", base: int | None = None
                 ) -> tuple[Header, Tensors] | None:
        """The primary ``shard``'s state for its replica at address ``to``, or None when
        unchanged. ``base``: the version of the last copy ``to`` accepted; when that is
        the last copy taken here, only what changed since travels (``base`` in the
        header), else the whole shard: a large shard copied whole every round kept the
        servers' CPU busy and stalled the workers' steps. A copy of shard 0 carries the
        data-shard service; the changes after it are journaled to ``to`` once it is
        accepted there (:meth:`copied`)."""
        with self._lock:
            h = self.hosted.get(shard)
            config = self.config
        if h is None or config is None or h.role is not Role.PRIMARY:
            return None
        with h.cond:
            if h.replicated == h.version:
                return None
            changes = _changes_since(h, shard, config, base)
            live = {} if changes is not None else h.state.payload()
            h.state.clean()  # what changes from here follows this copy
        header, tensors = changes if changes is not None else self._copier.submit(
            _whole_copy, h, shard, config, live).result()
        with h.cond:
            # The next copy, or a hand-over, to the host of this one need send only what
            # changes from here.
            h.replicated = h.clean_since = int(header["version"])
        if shard == DATA_SHARD:
            # After the parameters, outside their lock (a push holds it while it
            # journals); the data may be newer than them, never older than the journal.
            with self._journal_out.lock, self._lock:
                if self.data is not None:
                    header["data"] = self.data.to_json()
                    self._journal_out.copy_taken(to)
        return header, tensors

    def copied(self, shard: int, to: str) -> None:
        """The server at ``to`` accepted the copy of ``shard`` taken for it."""
        if shard == DATA_SHARD and not self._journal_out.copy_accepted(to):
            self.resend(DATA_SHARD)

    def _incoming(self, header: Header) -> tuple[int, JobConfig, Partition, Hosted | None]:
        """A shard another server sends (a replica's copy or a hand-over): its number,
        the job's configuration (taken from ``header`` if this server has none yet), the
        partition, and this server's own copy of the shard, if any."""
        shard = int(header["shard"])
        with self._lock:
            config = self._configure(header["config"])
            partition = self.partition
            h = self.hosted.get(shard)
        assert partition is not None
        return shard, config, partition, h

    def replicate(self, header: Header, tensors: Tensors) -> Header:
        """Keep (or refresh) a replica of another server's shard; a primary ignores it.
        A copy with a ``base`` carries only what changed since the copy of that version,
        which this server must hold as its replica (refused with ``whole`` otherwise:
        send the whole shard)."""
        shard, config, partition, h = self._incoming(header)
        if h is not None and not h.role.held_by_others:
            return {"accepted": False, "version": h.version}
        version = int(header["version"])
        pushes = _pushes(header)
        base = header.get("base")
        if base is not None:
            with self._lock:
                h = self.hosted.get(shard)
                if h is not None and not h.role.held_by_others:
                    return {"accepted": False, "version": h.version}
                # A copy this server handed over (MOVED) is exactly at that version.
                if h is None or h.role not in (Role.REPLICA, Role.MOVED) \
                        or h.version != int(base):
                    return {"accepted": False, "whole": True,
                            "version": -1 if h is None else h.version}
                h.state.update(tensors)
                h.version, h.replicated, h.pushes = version, version, pushes
                h.role = Role.REPLICA
        else:
            # Copied outside the lock: a large shard must not hold up this server's own.
            state = self._copier.submit(with_fixes, partition, shard, config, tensors).result()
            with self._lock:
                h = self.hosted.get(shard)
                if h is not None and not h.role.held_by_others:
                    return {"accepted": False, "version": h.version}
                self.hosted[shard] = Hosted(state, version, Role.REPLICA, replicated=version,
                                            pushes=pushes)
        if header.get("data") is not None:
            self._journal_in.copy(DataShardService.from_json(header["data"]))
        return {"accepted": True, "version": version}

    def journal(self, entry: Header) -> Header:
        """Replay changes (``entries``) of the data-shard service whose primary copy is
        elsewhere; refused while this server serves shard 0 itself."""
        with self._lock:
            h = self.hosted.get(DATA_SHARD)
        if h is not None and not h.role.held_by_others:
            return {"accepted": False}
        return {"accepted": self._journal_in.entries(list(entry["entries"]))}

    def promote(self, shard: int) -> Header:
        """Serve the replica of ``shard`` as its primary (its primary is gone)."""
        with self._journal_out.lock, self._lock:
            self._settle_moved()
            h = self.hosted.get(shard)
            if h is None or h.role in (Role.MOVING, Role.MOVED):
                # Moving, or just moved: its new home serves it (the worker asks again).
                raise NotServing(f"ps {self.index} holds no replica of shard {shard}")
            if h.role is Role.REPLICA:
                h.role = Role.PRIMARY
                h.replicated = -1
                data = self._journal_in.take() if shard == DATA_SHARD else None
                if data is not None:
                    self._serve_data(data)
            return {"version": h.version}

    def _serve_data(self, data: DataShardService) -> None:
        """Serve the data-shard service as its new primary (holds the journal's lock and
        ``_lock``). A new term: this copy's journal starts afresh, and goes to the
        replica once replication has sent it a whole copy. Leases stay: their holders go
        on from the last sample they reported."""
        data.term, data.seq = data.term + 1, 0
        for worker in sorted(data.holders() - self.workers):
            data.release(worker)
        self.data = data
        self._journal_out.off()

    # -- moves (resizing) ------------------------------------------------------------

    def hand_over(self, shard: int, send: HandOver, base: int | None = None,
                  to: int | None = None) -> tuple[int, float] | None:
        """Hand the primary ``shard`` to its new home through ``send`` (the servers were
        resized). Calls for the shard wait meanwhile and then go to the new home: no
        update is applied here after the copy is taken, so none is lost. ``base``: the
        version of a copy the new home holds; when it is the last whole copy taken here,
        only what changed since travels, else the whole shard. ``to``: the new home's
        index, which calls that come here afterwards are told. Returns the version
        handed over and how long the shard was served by nobody; None when it was not
        handed over (not primary here, a sync round under way: try again, or the new
        home refused it). Called holding no lock."""
        with self._lock:
            h = self.hosted.get(shard)
            config = self.config
        if h is None or config is None:
            return None
        with h.cond:
            if h.role is not Role.PRIMARY or h.round:
                # A round's buffered pushes would be lost with the move: wait for it.
                return None
            h.role = Role.MOVING
            started = self.clock()
            header, tensors = (_changes_since(h, shard, config, base)
                               or _copy_of(h, shard, config))
        data = None
        if shard == DATA_SHARD:
            # Taken, not copied: a lease or release racing the move finds no service
            # here and is retried at the new home.
            with self._journal_out.lock, self._lock:
                data, self.data = self.data, None
                self._journal_out.off()
            header["data"] = data.to_json() if data is not None else None
        adopted = send(header, tensors)
        with h.cond:
            h.role = Role.MOVED if adopted else Role.PRIMARY
            h.moved_at, h.moved_to = self.clock(), to if adopted else None
            h.replicated = -1
            h.cond.notify_all()
            held = self.clock() - started
        if not adopted and data is not None:
            with self._journal_out.lock, self._lock:
                self.data = data
            self.resend(DATA_SHARD)  # its journal is off: a whole copy turns it on again
        return (int(header["version"]), held) if adopted else None

    def adopt(self, header: Header, tensors: Tensors) -> Header:
        """Serve a shard as primary that its old home handed over (``accepted``), unless
        this server serves it already. A hand-over with a ``base`` carries only what
        changed since the copy of that version, which this server must hold (refused
        with ``whole`` otherwise: send the whole shard)."""
        shard, config, partition, h = self._incoming(header)
        if h is not None and not h.role.held_by_others:
            return {"accepted": False, "version": h.version}
        base = header.get("base")
        if base is not None and (h is None or h.version != int(base)):
            return {"accepted": False, "whole": True, "version": -1 if h is None else h.version}
        version = int(header["version"])
        # A whole shard is copied outside the lock, as a replica is; changes are few and
        # go onto the copy held here under it (nothing replaces that copy meanwhile).
        whole = None if base is not None else ShardState.from_payload(
            partition, shard, config.optimizer, tensors)
        with self._journal_out.lock, self._lock:
            if self.hosted.get(shard) is not h or (
                    h is not None and not h.role.held_by_others):
                return {"accepted": False, "whole": True,
                        "version": -1 if h is None else h.version}
            state = whole
            if state is None:
                assert h is not None  # a delta is refused above without a copy here
                h.state.update(tensors)
                state = h.state
            # Changes are tracked from the version handed over, which the old home keeps.
            state.clean()
            origin = header.get("from")
            self.hosted[shard] = Hosted(state, version, Role.PRIMARY, pushes=_pushes(header),
                                        clean_since=version,
                                        held_at=(str(origin), version) if origin else None)
            if shard == DATA_SHARD and header.get("data") is not None:
                self._journal_in.take()  # a replica's copy, older than this one
                self._serve_data(DataShardService.from_json(header["data"]))
        return {"accepted": True, "version": version}

    def drop_replicas(self, keep: Callable[[int], bool]) -> list[int]:
        """Drop the replicas of the shards ``keep`` says no longer belong here (after a
        resize): a stale copy must never be promoted. Returns the shards dropped."""
        with self._lock:
            self._settle_moved()
            gone = [s for s, h in self.hosted.items() if h.role is Role.REPLICA and not keep(s)]
            for shard in gone:
                del self.hosted[shard]
        return gone

    def _settle_moved(self) -> None:
        """Copies left by a hand-over more than :data:`MOVED_GRACE_S` ago and not
        refreshed by the new home since are replicas like any other (holds ``_lock``)."""
        now = self.clock()
        for h in self.hosted.values():
            if h.role is Role.MOVED and now - h.moved_at >= MOVED_GRACE_S:
                h.role = Role.REPLICA

    def step_down(self, shard: int) -> Header | None:
        """Serve ``shard`` no longer (another server was promoted in its place while this
        one was alive): keep it as a replica for the new primary to refresh. Waiting
        pulls and later calls get :class:`NotServing`, so workers look again. Returns
        what was dropped, None when this server was not serving ``shard``."""
        with self._lock:
            h = self.hosted.get(shard)
        if h is None:
            return None
        if shard == DATA_SHARD:
            with self._journal_out.lock:
                self._journal_out.off()
        with h.cond:
            if h.role is not Role.PRIMARY:
                return None
            h.role = Role.REPLICA
            h.replicated = -1
            dropped = len(h.round)
            h.round.clear()  # a sync round's pushes here: the workers push again there
            h.cond.notify_all()
            return {"version": h.version, "roundDropped": dropped}

    def primaries(self) -> list[int]:
        """Shards served here as primary."""
        with self._lock:
            return [s for s, h in self.hosted.items() if h.role is Role.PRIMARY]

    def held_at(self, shard: int) -> tuple[str, int] | None:
        """The address of a server known to hold the primary ``shard`` at a version (its
        old home, after a hand-over), and that version; None if none is known."""
        with self._lock:
            h = self.hosted.get(shard)
        return h.held_at if h is not None and h.role is Role.PRIMARY else None

    def resend(self, shard: int) -> None:
        """Send ``shard`` to its replica next time even if unchanged (a new replica host)."""
        with self._lock:
            h = self.hosted.get(shard)
        if h is not None:
            with h.cond:
                h.replicated = -1

    def checkpoint_payload(self, shard: int, min_version: int = 0
                           ) -> tuple[int, dict[str, torch.Tensor], dict[str, Any]] | None:
        """A private copy of a primary shard's state and its version, once the shard
        reached ``min_version``, with what :meth:`restore` needs besides: the job's
        configuration and, with shard 0, the data-shard service as of the same version
        (its reports ride on shard 0's pushes, under the same lock)."""
        with self._lock:
            h = self.hosted.get(shard)
            config = self.config
        if h is None or config is None or h.role is not Role.PRIMARY:
            return None
        with h.cond:
            if h.version < min_version:
                return None
            extra: dict[str, Any] = {"config": config.to_json()}
            if shard == DATA_SHARD:
                with self._lock:
                    extra["data"] = self.data.to_json() if self.data is not None else None
            return h.version, {k: v.clone() for k, v in h.state.payload().items()}, extra

    def restore(self, shard: int, version: int, payload: Mapping[str, torch.Tensor],
                extra: Mapping[str, Any]) -> None:
        """Serve ``shard`` as checkpointed (the job restarts and no server holds a copy):
        the workers' ``Init`` then finds it, and training goes on from ``version``."""
        with self._journal_out.lock, self._lock:
            config = self._configure(extra["config"])
            assert self.partition is not None
            state = ShardState.from_payload(self.partition, shard, config.optimizer, payload)
            self.hosted[shard] = Hosted(state, version, Role.PRIMARY)
            if shard == DATA_SHARD and extra.get("data") is not None:
                self.data = DataShardService.from_json(extra["data"])

    def finish(self) -> None:
        """A worker saw the last epoch end: the PS may exit."""
        self.finished.set()


def _copy_of(h: Hosted, shard: int, config: JobConfig,
                tensors: Tensors | None = None) -> tuple[Header, Tensors]:
    """A shard's whole state for another server (holds ``h.cond``), or ``tensors`` in
    its place: copies, since the transport encodes them after the lock is let go."""
    header: Header = {"shard": shard, "version": h.version, "config": config.to_json(),
                      "data": None, "pushes": {w: [i, r] for w, (i, r) in h.pushes.items()}}
    if tensors is None:
        tensors = {k: v.clone() for k, v in h.state.payload().items()}
    return header, tensors


def _changes_since(h: Hosted, shard: int, config: JobConfig, base: int | None
                   ) -> tuple[Header, Tensors] | None:
    """What changed in the shard since the copy of version ``base`` (``base`` in the
    header), when that is the last copy taken here or handed over to this server; None
    when only the whole shard will do (holds ``h.cond``)."""
    if base is None or base != h.clean_since:
        return None
    header, tensors = _copy_of(h, shard, config, h.state.changes())
    header["base"] = base
    return header, tensors


def _lower_priority() -> None:
    """Run the calling thread :data:`COPY_NICE` steps nicer (Linux: a thread is a task)."""
    # Where that is not allowed, copies compete with training at the same priority.
    with contextlib.suppress(OSError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), COPY_NICE)


def _whole_copy(h: Hosted, shard: int, config: JobConfig, live: Tensors
                ) -> tuple[Header, Tensors]:
    """A copy of the shard whose state ``live`` is (its payload when the changes were
    last forgotten), taken a piece at a time with ``h.cond`` let go between pieces, then
    what changed meanwhile (keys under :data:`FIXES`), which makes it exact at the
    header's version. Called holding no lock."""
    copies = {k: _copied(v, h.cond) for k, v in live.items()}
    with h.cond:
        header, fixes = _copy_of(h, shard, config, h.state.changes())
        h.state.clean()
    return header, {**copies, **{FIXES + k: v for k, v in fixes.items()}}


def _copied(tensor: torch.Tensor, lock: threading.Condition) -> torch.Tensor:
    """A copy of ``tensor``, :data:`COPY_PIECE_BYTES` at a time under ``lock``."""
    out = torch.empty_like(tensor)
    flat, into = tensor.reshape(-1), out.view(-1)
    step = max(1, COPY_PIECE_BYTES // max(1, tensor.element_size()))
    for start in range(0, flat.numel(), step):
        with lock:
            into[start:start + step].copy_(flat[start:start + step])
    return out


def with_fixes(partition: Partition, shard: int, config: JobConfig, tensors: Tensors
               ) -> ShardState:
    """The shard a whole copy describes: its payload, then what changed while it was
    taken (the :data:`FIXES` keys of :func:`_whole_copy`)."""
    fixes = {k[len(FIXES):]: v for k, v in tensors.items() if k.startswith(FIXES)}
    state = ShardState.from_payload(partition, shard, config.optimizer,
                                    {k: v for k, v in tensors.items()
                                     if not k.startswith(FIXES)})
    if fixes:
        state.update(fixes)
    return state


def _pushes(header: Header) -> dict[str, tuple[str, Header]]:
    """The last push id and reply per worker, as a copy of a shard carries them."""
    return {str(w): (str(i), dict(r)) for w, (i, r) in header.get("pushes", {}).items()}


def _layout(config: JobConfig) -> str:
    tensors = ", ".join(f"{s.name} {list(s.shape)}" for s in config.specs)
    return f"{tensors}; {config.shards} shards; {config.optimizer.kind.value}"
