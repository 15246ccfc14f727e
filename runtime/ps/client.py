"""A worker's side of the transport: routing, pull, push, failover to replicas.

Shard ``s`` lives on PS ``s`` with its replica on PS ``(s+1) % n``. When a call to a
shard's server fails because the server is gone, the client asks the replica's host
to promote it and carries on there: no storage read, and only the updates since the
last replication are lost (counted in :attr:`PSClient.lost_updates`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
import numpy as np
import torch

from ..kvlog import log_event, runtime_logger
from .codec import Header, Tensors
from .partition import Kind, Partition
from .server import JobConfig
from .shard import dense_key, initial_values
from .transport import Stub, result, unavailable

_log = runtime_logger("ps.client")


def replica_host(shard: int, servers: int) -> int:
    """The PS that keeps the replica of ``shard``."""
    return (shard + 1) % servers


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


@dataclass
class PendingPull:
    """A pull in flight; :meth:`PSClient.finish_pull` waits for it."""

    parts: list[tuple[int, Header, Tensors]]
    """(shard, header, tensors) of each request: large shards are pulled in chunks."""
    futures: list[grpc.Future[bytes]]
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


class PSClient:
    """Talks to every parameter server of a job for one worker."""

    def __init__(self, addresses: Sequence[str], worker: str, *,
                 call_timeout: float = 60.0, chunk_bytes: int = 8 << 20,
                 clock: Callable[[], float] = time.monotonic,
                 logger: logging.Logger = _log) -> None:
        self.worker = worker
        self.stubs = [Stub(a) for a in addresses]
        self.route = list(range(len(addresses)))
        self.versions = [0] * len(addresses)
        self.lost_updates = 0
        self.failovers: list[tuple[int, float]] = []
        """(shard, clock time) of each failover this client performed."""
        self.call_timeout = call_timeout
        self.chunk_bytes = chunk_bytes
        self._push_id = 0
        self.clock = clock
        self.log = logger
        self.config: JobConfig | None = None
        self.partition: Partition | None = None

    @property
    def servers(self) -> int:
        return len(self.stubs)

    def set_addresses(self, addresses: Sequence[str]) -> None:
        """Follow a new list of PS addresses (a replacement PS came up elsewhere)."""
        for i, address in enumerate(addresses):
            if self.stubs[i].address != address:
                self.stubs[i].close()
                self.stubs[i] = Stub(address)

    def close(self) -> None:
        for stub in self.stubs:
            stub.close()

    # -- set-up ----------------------------------------------------------------------

    def wait_ready(self, timeout: float) -> None:
        """Wait until every server accepts connections (servers start beside workers)."""
        for stub in self.stubs:
            try:
                grpc.channel_ready_future(stub.channel).result(timeout=timeout)
            except grpc.FutureTimeoutError as exc:
                raise TimeoutError(f"parameter server {stub.address} not reachable "
                                   f"within {timeout:.0f}s") from exc

    def discover(self) -> dict[int, int]:
        """Route each shard to the server that serves it as primary; returns the route."""
        for i, stub in enumerate(self.stubs):
            try:
                status, _ = stub.call("Status", {}, timeout=5.0)
            except grpc.RpcError as exc:
                if not unavailable(exc):
                    raise
                continue
            for shard, info in status["shards"].items():
                if info["role"] == "primary":
                    self.route[int(shard)] = i
                    self.versions[int(shard)] = int(info["version"])
        return dict(enumerate(self.route))

    def initialize(self, config: JobConfig, params: Mapping[str, torch.Tensor]) -> None:
        """Create every shard from ``params`` unless it exists (the first worker wins)."""
        self.config, self.partition = config, config.partition()
        if config.shards != self.servers:
            raise ValueError(f"config for {config.shards} shards but {self.servers} servers")
        for shard in range(self.servers):
            header = {"shard": shard, "config": config.to_json()}
            reply, _ = self._call(shard, "Init", header,
                                  initial_values(self.partition, shard, params))
            self.versions[shard] = int(reply["version"])

    # -- calls with failover ---------------------------------------------------------

    def _call(self, shard: int, method: str, header: Header,
              tensors: Tensors | None = None) -> tuple[Header, Tensors]:
        while True:
            used = self.route[shard]
            try:
                return self.stubs[used].call(method, header, tensors, timeout=self.call_timeout)
            except grpc.RpcError as exc:
                if not self._recover(shard, exc, used):
                    raise

    def _recover(self, shard: int, exc: grpc.RpcError, used: int) -> bool:
        """After a failed call to server ``used``: fail over to the replica (True: retry)
        or give up."""
        if self.route[shard] != used:
            return True  # failed over meanwhile (a call in flight to the dead server)
        if unavailable(exc):
            return self.failover(shard)
        if exc.code() is grpc.StatusCode.FAILED_PRECONDITION:
            # Not served there (any more): another worker may have failed it over.
            before = list(self.route)
            self.discover()
            return self.route != before
        return False

    def failover(self, shard: int) -> bool:
        """Promote ``shard``'s replica; False when its host is the one that failed."""
        backup = replica_host(shard, self.servers)
        if self.route[shard] == backup or self.servers == 1:
            return False
        try:
            reply, _ = self.stubs[backup].call("Promote", {"shard": shard}, timeout=5.0)
        except grpc.RpcError as exc:
            log_event(self.log, logging.ERROR, "ps_failover_failed", shard=shard,
                      error=exc.code())
            return False
        version = int(reply["version"])
        lost = max(0, self.versions[shard] - version)
        self.lost_updates += lost
        self.route[shard] = backup
        self.versions[shard] = version
        self.failovers.append((shard, self.clock()))
        log_event(self.log, logging.WARNING, "ps_failover", shard=shard, to=backup,
                  version=version, lost_updates=lost)
        return True

    # -- pull ------------------------------------------------------------------------

    def start_pull(self, ids: Mapping[str, torch.Tensor], *, dense: bool = True,
                   min_versions: Mapping[int, int] | None = None,
                   timeout: float = 30.0) -> PendingPull:
        """Start pulling the dense parameters and the rows ``ids`` touches, from every shard."""
        part = self._partition()
        unique: dict[str, tuple[torch.Tensor, np.ndarray[Any, Any]]] = {}
        parts: list[tuple[int, Header, Tensors]] = []
        first: dict[int, Tensors] = {}
        for s in range(self.servers):
            base = {"shard": s, "timeout": timeout,
                    "minVersion": (min_versions or {}).get(s, 0)}
            chunks = dense_chunks(part, s, self.chunk_bytes) if dense else [[]]
            for i, keys in enumerate(chunks):
                tensors: Tensors = {}
                parts.append((s, {**base, "dense": keys}, tensors))
                if i == 0:
                    first[s] = tensors  # the rows travel with the first chunk
        for name, raw in ids.items():
            u = torch.unique(raw.reshape(-1))
            owners = part.row_shards(name, u.numpy())
            unique[name] = (u, owners)
            for s in range(self.servers):
                first[s][f"i/{name}"] = u[torch.from_numpy(owners == s)]
        servers = [self.route[s] for s, _, _ in parts]
        futures = [self.stubs[server].start("Pull", header, tensors, timeout=self.call_timeout)
                   for server, (_, header, tensors) in zip(servers, parts, strict=True)]
        return PendingPull(parts, futures, servers, unique, dense)

    def finish_pull(self, pending: PendingPull) -> Pulled:
        """Wait for a pull started with :meth:`start_pull` and assemble its tensors."""
        part = self._partition()
        got: dict[str, torch.Tensor] = {}
        versions: dict[int, int] = {}
        rows_of: dict[int, Tensors] = {}
        for (s, header, tensors), future, server in zip(
                pending.parts, pending.futures, pending.servers, strict=True):
            try:
                reply = result(future)
            except grpc.RpcError as exc:
                if not self._recover(s, exc, server):
                    raise
                retry = {**header, "minVersion": min(header["minVersion"], self.versions[s])}
                reply = self._call(s, "Pull", retry, tensors)
            # A chunked pull may straddle an update (async): claim the oldest version.
            versions[s] = min(versions.get(s, 1 << 62), int(reply[0]["version"]))
            got.update(reply[1])
            if any(k.startswith("i/") for k in tensors):
                rows_of[s] = reply[1]
        for s, v in versions.items():
            self.versions[s] = v
        out = Pulled({}, {}, versions)
        if pending.dense:
            for spec in part.specs:
                if spec.kind is Kind.DENSE:
                    out.dense[spec.name] = torch.empty(spec.numel, dtype=torch.float32)
            for d in part.dense:
                out.dense[d.name][d.start:d.stop] = got[dense_key(d.name, d.start)]
            for spec in part.specs:
                if spec.kind is Kind.DENSE:
                    out.dense[spec.name] = out.dense[spec.name].reshape(spec.shape)
        for name, (u, owners) in pending.ids.items():
            rows = torch.empty((len(u), part.spec(name).shape[1]), dtype=torch.float32)
            for s in range(self.servers):
                mask = torch.from_numpy(owners == s)
                if bool(mask.any()):
                    rows[mask] = rows_of[s][name]
            out.rows[name] = (u, rows)
        return out

    def pull(self, ids: Mapping[str, torch.Tensor], **kwargs: Any) -> Pulled:
        """A blocking pull (see :meth:`start_pull`)."""
        return self.finish_pull(self.start_pull(ids, **kwargs))

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
        requests: dict[int, tuple[Header, Tensors]] = {
            s: ({"shard": s, "worker": self.worker, "version": versions.get(s, 0),
                 "skip": skip, "retire": retire}, {})
            for s in range(self.servers)}
        if data is not None:
            requests[0][0]["data"] = dict(data)
        for d in part.dense if dense else ():
            grad = dense[d.name].reshape(-1)[d.start:d.stop]
            requests[d.shard][1][f"g/{dense_key(d.name, d.start)}"] = grad
        for name, (ids, rows) in sparse.items():
            owners = torch.from_numpy(part.row_shards(name, ids.numpy()))
            for s in range(self.servers):
                mask = owners == s
                requests[s][1][f"i/{name}"] = ids[mask]
                requests[s][1][f"r/{name}"] = rows[mask]
        self._stage(requests)
        servers = dict(enumerate(self.route))
        futures = {s: self.stubs[servers[s]].start("Push", *req, timeout=self.call_timeout)
                   for s, req in requests.items()}
        verdicts, staleness = {}, {}
        accepted = True
        for s, future in futures.items():
            try:
                reply, _ = result(future)
            except grpc.RpcError as exc:
                if not self._recover(s, exc, servers[s]):
                    raise
                reply, _ = self._call(s, "Push", *requests[s])
            verdicts[s], staleness[s] = str(reply["verdict"]), int(reply["staleness"])
            if reply.get("dataAccepted") is False:
                accepted = False
        return PushResult(verdicts, staleness, accepted)

    def _stage(self, requests: dict[int, tuple[Header, Tensors]]) -> None:
        """Send all but the first chunk of each large push ahead, concurrently; the
        ``Push`` then names them (and carries the first chunk and the rows)."""
        part = self._partition()
        staged: list[tuple[int, Header, Tensors]] = []
        for s, (header, tensors) in requests.items():
            chunks = dense_chunks(part, s, self.chunk_bytes)
            if len(chunks) < 2:
                continue
            self._push_id += 1
            header["staged"] = f"{self._push_id}"
            for keys in chunks[1:]:
                moved = {f"g/{k}": tensors.pop(f"g/{k}") for k in keys if f"g/{k}" in tensors}
                staged.append((s, {"worker": self.worker, "staged": header["staged"]}, moved))
        servers = [self.route[s] for s, _, _ in staged]
        futures = [self.stubs[server].start("Stage", h, t, timeout=self.call_timeout)
                   for server, (_, h, t) in zip(servers, staged, strict=True)]
        for (s, h, t), future, server in zip(staged, futures, servers, strict=True):
            try:
                result(future)
            except grpc.RpcError as exc:
                if not self._recover(s, exc, server):
                    raise
                self._call(s, "Stage", h, t)

    # -- data and end ----------------------------------------------------------------

    def lease(self) -> Header:
        """The next piece of data for this worker (from the server holding shard 0)."""
        reply, _ = self._call(0, "Lease", {"worker": self.worker})
        return reply

    def status(self, server: int) -> Header:
        reply, _ = self.stubs[server].call("Status", {}, timeout=5.0)
        return reply

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
