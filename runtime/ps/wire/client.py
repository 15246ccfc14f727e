"""A worker's side of the transport: pull, push, and retries through failovers.

Routing and recovery live in :mod:`.routing`: when a call fails, the client finds the
shard's live primary (promoting the replica when the primary is gone: no storage
read, and only the updates since the last replication are lost, counted in
:attr:`PSClient.lost_updates`) and retries there, within a deadline.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
import numpy as np
import torch

from ..partition import Kind, Partition
from ..serving.hosting import JobConfig
from ..serving.shard import dense_key, initial_values
from .codec import Header, Tensors
from .routing import Attempt, RecoverySettings, Routes
from .transport import Call, result


@dataclass
class Pulled:
    """What one pull brought: dense tensors (full shapes), rows of the tables, versions."""

    dense: dict[str, torch.Tensor]
    rows: dict[str, tuple[torch.Tensor, torch.Tensor]]
    """Per table: (unique ids ascending, their rows)."""
    versions: dict[int, int]


@dataclass
class PushResult:
    verdicts: dict[int, str]
    staleness: dict[int, int]
    data_accepted: bool = True
    """False when the data-shard service refused the progress (the lease is void)."""

    @property
    def dropped(self) -> bool:
        return any(v == "stale" for v in self.verdicts.values())

    @property
    def judged_staleness(self) -> int:
        """The staleness the verdict was judged on: shard 0's (the others follow it)."""
        return self.staleness.get(0, 0)


@dataclass
class PendingPull:
    """A pull in flight; :meth:`PSClient.finish_pull` waits for it."""

    parts: list[tuple[int, Header, Tensors]]
    """(shard, header, tensors) of each request: large shards are pulled in chunks."""
    futures: list[Call]
    servers: list[int]
    """The server each request went to."""
    ids: dict[str, tuple[torch.Tensor, np.ndarray[Any, Any]]]
    dense: bool


def dense_chunks(part: Partition, shard: int, chunk_bytes: int) -> list[list[str]]:
    """The dense slice keys of ``shard`` grouped into messages of about ``chunk_bytes``:
    gRPC moves several medium messages in flight much faster than one huge one."""
    chunks: list[list[str]] = [[]]
    size = 0
    for d in part.dense_on(shard):
        if size >= chunk_bytes:
            chunks.append([])
            size = 0
        chunks[-1].append(dense_key(d.name, d.start))
        size += (d.stop - d.start) * part.spec(d.name).itemsize
    return chunks


class PSClient(Routes):
    """Talks to every parameter server of a job for one worker."""

    def __init__(self, addresses: Sequence[str], worker: str, *,
                 call_timeout: float = 60.0, chunk_bytes: int = 8 << 20,
                 recovery: RecoverySettings | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 logger: logging.Logger | None = None,
                 beat: Callable[[], None] = lambda: None) -> None:
        """``beat``: called while a pull waits for a version the shard has not reached
        (a sync round still open): waiting for a slow peer is no stall of this worker."""
        super().__init__(addresses, recovery=recovery, clock=clock, logger=logger)
        self.worker = worker
        self.beat = beat
        self.call_timeout = call_timeout
        self.chunk_bytes = chunk_bytes
        self._push_id = 0
        # Push ids must not repeat across restarts of this worker: the server takes a
        # push with the id it saw last for the worker as a retry of it.
        self._nonce = secrets.token_hex(4)
        self.config: JobConfig | None = None
        self.partition: Partition | None = None

    # -- set-up ----------------------------------------------------------------------

    def wait_ready(self, timeout: float, beat: Callable[[], None] = lambda: None) -> None:
        """Wait until every server accepts connections (servers start beside workers),
        calling ``beat`` about once a second: waiting for a server that is still
        starting is not a stall of this worker."""
        deadline = time.monotonic() + timeout
        for stub in self.stubs:
            ready = grpc.channel_ready_future(stub.channel)
            while True:
                try:
                    ready.result(timeout=max(0.0, min(1.0, deadline - time.monotonic())))
                    break
                except grpc.FutureTimeoutError as exc:
                    beat()
                    if time.monotonic() >= deadline:
                        ready.cancel()
                        raise TimeoutError(f"parameter server {stub.address} not reachable "
                                           f"within {timeout:.0f}s") from exc

    def initialize(self, config: JobConfig, params: Mapping[str, torch.Tensor]) -> None:
        """Create every shard from ``params`` unless it exists (the first worker wins)."""
        self.attach(config)
        partition = self._partition()
        for shard in range(self.shards):
            header = {"shard": shard, "config": config.to_json()}
            reply, _ = self._call(shard, "Init", header,
                                  initial_values(partition, shard, params))
            self.versions[shard] = int(reply["version"])

    def attach(self, config: JobConfig) -> None:
        """Use shards that exist already, laid out by ``config``, creating none: for a
        client that only reads (:class:`..evaluator.Evaluator`). Each shard is routed
        to the server that serves it, else to its home."""
        self.config, self.partition = config, config.partition()
        self.place(config.shards)
        self.discover()

    # -- calls with retries -----------------------------------------------------------

    def _call(self, shard: int, method: str, header: Header, tensors: Tensors | None = None,
              attempt: Attempt | None = None) -> tuple[Header, Tensors]:
        """One call to ``shard``'s primary, retried through failovers (``attempt``: the
        recovery already under way for this call)."""
        while True:
            used = self.route[shard]
            try:
                return self.stubs[used].call(method, header, tensors, timeout=self.call_timeout)
            except grpc.RpcError as exc:
                attempt = self.recover(shard, exc, used, attempt)

    # -- pull ------------------------------------------------------------------------

    def start_pull(self, ids: Mapping[str, torch.Tensor], *, dense: bool = True,
                   min_versions: Mapping[int, int] | None = None,
                   timeout: float = 30.0) -> PendingPull:
        """Start pulling the dense parameters and the rows ``ids`` touches, from every shard."""
        part = self._partition()
        unique: dict[str, tuple[torch.Tensor, np.ndarray[Any, Any]]] = {}
        parts: list[tuple[int, Header, Tensors]] = []
        first: dict[int, Tensors] = {}
        for s in range(self.shards):
            base = {"shard": s, "timeout": timeout,
                    "minVersion": (min_versions or {}).get(s, 0)}
            chunks = dense_chunks(part, s, self.chunk_bytes) if dense else [[]]
            for i, keys in enumerate(chunks):
                tensors: Tensors = {}
                parts.append((s, {**base, "dense": keys}, tensors))
                if i == 0:
                    first[s] = tensors  # the rows travel with the first chunk
        for name, raw in ids.items():
            ids_np = _unique(raw)
            u = torch.from_numpy(ids_np)
            owners = part.row_shards(name, ids_np)
            unique[name] = (u, owners)
            # numpy's boolean indexing: torch's costs a quarter of a 4,096-row pull.
            for s in range(self.shards):
                first[s][f"i/{name}"] = torch.from_numpy(ids_np[owners == s])
        servers = [self.route[s] for s, _, _ in parts]
        futures = [self.stubs[server].start("Pull", header, tensors, timeout=self.call_timeout)
                   for server, (_, header, tensors) in zip(servers, parts, strict=True)]
        return PendingPull(parts, futures, servers, unique, dense)

    def finish_pull(self, pending: PendingPull,
                    into: Mapping[str, torch.Tensor] | None = None) -> Pulled:
        """Wait for a pull started with :meth:`start_pull` and assemble its tensors.

        ``into``: dense tensors to write the pulled values into (a model's parameters),
        so a large model is neither allocated again nor copied twice per pull; they are
        returned as the pull's dense values. Each chunk is copied as soon as its reply is
        in, while later ones are still on the wire; after an error the targets hold a mix
        of versions (pull again).
        """
        part = self._partition()
        out = Pulled({}, {}, {})
        flat: dict[str, torch.Tensor] = {}
        if pending.dense:
            for spec in part.specs:
                if spec.kind is Kind.DENSE:
                    target = _target(spec.name, spec.numel, (into or {}).get(spec.name))
                    out.dense[spec.name] = target if target is not None else \
                        torch.empty(spec.shape, dtype=torch.float32)
                    flat[spec.name] = out.dense[spec.name].view(-1)
        slices = ({dense_key(d.name, d.start): (d.name, d.start, d.stop) for d in part.dense}
                  if pending.dense else {})
        rows_of: dict[int, Tensors] = {}
        for (s, header, tensors), future, server in zip(
                pending.parts, pending.futures, pending.servers, strict=True):
            try:
                reply = result(future)
            except grpc.RpcError as exc:
                attempt = self.recover(s, exc, server, None)
                retry = header
                if self.route[s] != server:
                    # Another copy may be behind the one that was asked (updates lost
                    # in the failover): wait for no version it never reaches.
                    retry = {**header, "minVersion": min(header["minVersion"],
                                                         self.versions[s])}
                reply = self._call(s, "Pull", retry, tensors, attempt)
            while self.versions[s] <= int(reply[0]["version"]) < int(header["minVersion"]) \
                    and self.route[s] == server:
                # The server waited as long as it was asked to and the shard is still
                # older (a sync round waits for a slow peer): values from before the
                # round would make this worker's next push a duplicate, dropped. Ask
                # again. A shard that failed over, or went back (restored from a
                # checkpoint), may never reach the version: taken as it is.
                self.beat()
                reply = self._call(s, "Pull", header, tensors)
            # A chunked pull may straddle an update (async): claim the oldest version.
            out.versions[s] = min(out.versions.get(s, 1 << 62), int(reply[0]["version"]))
            for key, value in reply[1].items():
                if key in slices:
                    name, start, stop = slices[key]
                    # numpy copies on this thread; torch would wake its OpenMP pool,
                    # whose spinning threads take the CPU the transport needs.
                    np.copyto(flat[name][start:stop].numpy(), value.numpy())
            if any(k.startswith("i/") for k in tensors):
                rows_of[s] = reply[1]
        for s, v in out.versions.items():
            self.versions[s] = v
        for name, (u, owners) in pending.ids.items():
            rows = np.empty((len(u), part.spec(name).shape[1]), dtype=np.float32)
            for s in range(self.shards):
                mask = owners == s
                if mask.all():
                    np.copyto(rows, rows_of[s][name].numpy())  # no mask to apply
                elif mask.any():
                    rows[mask] = rows_of[s][name].numpy()
            out.rows[name] = (u, torch.from_numpy(rows))
        return out

    def pull(self, ids: Mapping[str, torch.Tensor],
             into: Mapping[str, torch.Tensor] | None = None, **kwargs: Any) -> Pulled:
        """A blocking pull (see :meth:`start_pull` and :meth:`finish_pull`)."""
        return self.finish_pull(self.start_pull(ids, **kwargs), into)

    # -- push ------------------------------------------------------------------------

    def versions_map(self) -> dict[int, int]:
        """The last version seen of every shard."""
        return dict(enumerate(self.versions))

    def push(self, dense: Mapping[str, torch.Tensor],
             sparse: Mapping[str, tuple[torch.Tensor, torch.Tensor]],
             versions: Mapping[int, int], data: Mapping[str, int] | None = None,
             *, skip: bool = False, retire: bool = False) -> PushResult:
        """Push gradients computed from ``versions`` to every shard, in parallel.

        ``sparse``: per table, unique row ids and their gradient rows. ``data``: the
        samples this push trained (piece, start, stop), for the data-shard service.
        ``skip``: no gradient, this worker only takes part in the sync round;
        ``retire``: this worker is done, rounds stop waiting for it.
        """
        part = self._partition()
        self._push_id += 1
        push_id = f"{self._nonce}.{self._push_id}"
        requests: dict[int, tuple[Header, Tensors]] = {
            s: ({"shard": s, "worker": self.worker, "version": versions.get(s, 0),
                 "skip": skip, "retire": retire, "push": push_id}, {})
            for s in range(self.shards)}
        if data is not None:
            requests[0][0]["data"] = dict(data)
        for d in part.dense if dense else ():
            grad = dense[d.name].reshape(-1)[d.start:d.stop]
            requests[d.shard][1][f"g/{dense_key(d.name, d.start)}"] = grad
        for name, (ids, rows) in sparse.items():
            owners = torch.from_numpy(part.row_shards(name, ids.numpy()))
            for s in range(self.shards):
                mask = owners == s
                requests[s][1][f"i/{name}"] = ids[mask]
                requests[s][1][f"r/{name}"] = rows[mask]
        staged = self._stage(requests, push_id)
        servers = dict(enumerate(self.route))
        # Shard 0 judges the step (staleness, sync round) and the other shards follow its
        # verdict, so a step's gradients update every shard or none and the data service's
        # count of trained samples is the truth for all of them. The other shards' tensors
        # were staged meanwhile; only their small Push waits for shard 0's answer.
        first = self._send_pushes({0: requests[0]}, servers, staged)
        verdict = str(first[0]["verdict"])
        for s in range(1, self.shards):
            requests[s][0]["follow"] = verdict
        # The route again: shard 0's push may have gone through a failover.
        replies = {**first, **self._send_pushes(
            {s: r for s, r in requests.items() if s != 0}, dict(enumerate(self.route)),
            staged)}
        verdicts = {s: str(reply["verdict"]) for s, reply in replies.items()}
        staleness = {s: int(reply["staleness"]) for s, reply in replies.items()}
        accepted = all(reply.get("dataAccepted") is not False for reply in replies.values())
        return PushResult(verdicts, staleness, accepted)

    def _send_pushes(self, requests: Mapping[int, tuple[Header, Tensors]],
                     servers: Mapping[int, int], staged: Mapping[int, tuple[int, Tensors]]
                     ) -> dict[int, Header]:
        """Send pushes to their shards concurrently; each shard's reply, retried through
        failovers."""
        futures: dict[int, Call] = {}
        for s, request in requests.items():
            if s in staged and staged[s][0] != servers[s]:
                # Staging failed, or the shard moved since: its chunks are not there.
                request = _whole(request, staged[s][1])
            futures[s] = self.stubs[servers[s]].start("Push", *request,
                                                      timeout=self.call_timeout)
        replies: dict[int, Header] = {}
        for s, future in futures.items():
            try:
                replies[s], _ = result(future)
            except grpc.RpcError as exc:
                attempt = self.recover(s, exc, servers[s], None)
                # The retry carries everything: the chunks staged on a server that died
                # (or that refused the push as incomplete) are gone with it.
                request = _whole(requests[s], staged[s][1]) if s in staged else requests[s]
                replies[s], _ = self._call(s, "Push", *request, attempt)
        return replies

    def _stage(self, requests: dict[int, tuple[Header, Tensors]], push_id: str
               ) -> dict[int, tuple[int, Tensors]]:
        """Send all but the first chunk of each large push ahead, concurrently; the
        ``Push`` then names them (and carries the first chunk and the rows). Per shard
        staged: the server that holds the chunks (-1: staging failed) and the chunks."""
        part = self._partition()
        staged: list[tuple[int, Header, Tensors]] = []
        out: dict[int, tuple[int, Tensors]] = {}
        for s, (header, tensors) in requests.items():
            chunks = dense_chunks(part, s, self.chunk_bytes)
            moved = [{f"g/{k}": tensors.pop(f"g/{k}") for k in keys if f"g/{k}" in tensors}
                     for keys in chunks[1:]]
            moved = [m for m in moved if m]
            if not moved:
                continue
            header["staged"] = push_id
            header["stagedCount"] = sum(len(m) for m in moved)
            out[s] = (self.route[s], {k: v for m in moved for k, v in m.items()})
            staged.extend((s, {"worker": self.worker, "staged": push_id}, m) for m in moved)
        futures = [self.stubs[out[s][0]].start("Stage", h, t, timeout=self.call_timeout)
                   for s, h, t in staged]
        for (s, _, _), future in zip(staged, futures, strict=True):
            try:
                result(future)
            except grpc.RpcError:
                out[s] = (-1, out[s][1])  # the Push carries the chunks itself
        return out

    # -- data and end ----------------------------------------------------------------

    def lease(self) -> Header:
        """The next piece of data for this worker (from the server holding shard 0)."""
        reply, _ = self._call(0, "Lease", {"worker": self.worker})
        return reply

    def status(self, server: int) -> Header:
        reply, _ = self.stubs[server].call("Status", {}, timeout=5.0)
        return reply

    def shard_count(self, timeout: float = 5.0) -> int:
        """The job's shard count as its servers know it (0: no shard created yet): a
        worker or evaluator that comes later takes the layout the first worker chose."""
        futures = [stub.start("Status", {}, timeout=timeout) for stub in self.stubs]
        counts = [0]
        for future in futures:
            try:
                counts.append(int(result(future)[0].get("shardCount", 0)))
            except grpc.RpcError:
                continue
        return max(counts)

    def finish(self) -> None:
        """Tell every reachable server that the data is done."""
        for stub in self.stubs:
            try:
                stub.call("Finish", {}, timeout=2.0)
            except grpc.RpcError:
                continue

    def _partition(self) -> Partition:
        if self.partition is None:
            raise RuntimeError("initialize() the client before pulling or pushing")
        return self.partition


def _unique(ids: torch.Tensor) -> np.ndarray[Any, Any]:
    """The distinct values of ``ids``, sorted (as ``torch.unique``, in half its time for
    a few thousand ids: numpy sorts them on this thread)."""
    flat = np.sort(ids.reshape(-1).numpy())
    keep = np.empty(len(flat), dtype=bool)
    keep[:1] = True
    np.not_equal(flat[1:], flat[:-1], out=keep[1:])
    return flat[keep]


def _target(name: str, numel: int, tensor: torch.Tensor | None) -> torch.Tensor | None:
    """``tensor`` if a pull of ``name`` can be written into it in place."""
    if tensor is None:
        return None
    if tensor.dtype != torch.float32 or tensor.numel() != numel or not tensor.is_contiguous():
        raise ValueError(f"cannot pull {name} into a {tensor.dtype} tensor of "
                         f"{tensor.numel()} elements (contiguous: {tensor.is_contiguous()}); "
                         f"the servers hold {numel} float32 elements")
    return tensor


def _whole(request: tuple[Header, Tensors], staged: Tensors) -> tuple[Header, Tensors]:
    """A staged push as one message: its header without the staging, all its tensors."""
    header, tensors = request
    return ({k: v for k, v in header.items() if k not in ("staged", "stagedCount")},
            {**tensors, **staged})
