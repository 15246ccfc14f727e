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

    request: dict[int, tuple[Header, Tensors]]
    futures: dict[int, grpc.Future[bytes]]
    servers: dict[int, int]
    """The server each shard's request went to."""
    ids: dict[str, tuple[torch.Tensor, np.ndarray[Any, Any]]]
    dense: bool


class PSClient:
    """Talks to every parameter server of a job for one worker."""

    def __init__(self, addresses: Sequence[str], worker: str, *,
                 call_timeout: float = 60.0, clock: Callable[[], float] = time.monotonic,
                 logger: logging.Logger = _log) -> None:
        self.worker = worker
        self.stubs = [Stub(a) for a in addresses]
        self.route = list(range(len(addresses)))
        self.versions = [0] * len(addresses)
        self.lost_updates = 0
        self.failovers: list[tuple[int, float]] = []
        """(shard, clock time) of each failover this client performed."""
        self.call_timeout = call_timeout
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
        request: dict[int, tuple[Header, Tensors]] = {
            s: ({"shard": s, "dense": dense, "timeout": timeout,
                 "minVersion": (min_versions or {}).get(s, 0)}, {})
            for s in range(self.servers)}
        for name, raw in ids.items():
            u = torch.unique(raw.reshape(-1))
            owners = part.row_shards(name, u.numpy())
            unique[name] = (u, owners)
            for s in range(self.servers):
                request[s][1][f"i/{name}"] = u[torch.from_numpy(owners == s)]
        servers = dict(enumerate(self.route))
        futures = {s: self.stubs[servers[s]].start("Pull", *req, timeout=self.call_timeout)
                   for s, req in request.items()}
        return PendingPull(request, futures, servers, unique, dense)

    def finish_pull(self, pending: PendingPull) -> Pulled:
        """Wait for a pull started with :meth:`start_pull` and assemble its tensors."""
        part = self._partition()
        replies: dict[int, tuple[Header, Tensors]] = {}
        for s, future in pending.futures.items():
            try:
                replies[s] = result(future)
            except grpc.RpcError as exc:
                if not self._recover(s, exc, pending.servers[s]):
                    raise
                header, tensors = pending.request[s]
                header = {**header, "minVersion": min(header["minVersion"], self.versions[s])}
                replies[s] = self._call(s, "Pull", header, tensors)
        versions = {s: int(h["version"]) for s, (h, _) in replies.items()}
        for s, v in versions.items():
            self.versions[s] = v
        out = Pulled({}, {}, versions)
        if pending.dense:
            for spec in part.specs:
                if spec.kind is Kind.DENSE:
                    out.dense[spec.name] = torch.empty(spec.numel, dtype=torch.float32)
            for d in part.dense:
                out.dense[d.name][d.start:d.stop] = replies[d.shard][1][dense_key(d.name, d.start)]
            for spec in part.specs:
                if spec.kind is Kind.DENSE:
                    out.dense[spec.name] = out.dense[spec.name].reshape(spec.shape)
        for name, (u, owners) in pending.ids.items():
            rows = torch.empty((len(u), part.spec(name).shape[1]), dtype=torch.float32)
            for s in range(self.servers):
                mask = torch.from_numpy(owners == s)
                if bool(mask.any()):
                    rows[mask] = replies[s][1][name]
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
