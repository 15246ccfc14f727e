"""Which server serves each shard, and how a worker finds out again after a failure.

Shard ``s`` lives on its home server with a replica on the next one
(:mod:`..placement`; with as many shards as servers, PS ``s`` and ``(s+1) % n``); after a
failover the two swap roles, and after a resize the shard moves to its new home. When a
call fails, the client asks every server what it serves (a short ``Status``, bounded so
that a dead server costs at most ``probe_s``) and :func:`decide` picks the next step from
the answers: retry where the shard is served as primary (a slow or briefly unreachable
primary is not a dead one), promote a replica when no primary answers, or wait and ask
again (also while the shard is being handed to its new home). A shard without a primary
for ``deadline_s`` fails the call with :class:`ShardUnavailable`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import grpc

from ...kvlog import log_event, runtime_logger
from ..placement import Placement
from .transport import DETECT_S, Stub, result

_log = runtime_logger("ps.client")

TRANSIENT = frozenset({
    grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED})
"""Failures of the call or the connection, which a live server may cause too."""

RETRYABLE = TRANSIENT | frozenset({
    # Not served there (any more): the shard moved.
    grpc.StatusCode.FAILED_PRECONDITION,
    # A push named staged chunks the server does not hold: resend it whole.
    grpc.StatusCode.ABORTED,
})
"""Call failures that a retry elsewhere or later may cure; others are raised."""


@dataclass(frozen=True)
class RecoverySettings:
    """How hard a worker tries to reach a shard before its call fails."""

    deadline_s: float = 30.0
    """How long a shard may be without a reachable primary before the call fails."""
    probe_s: float = 0.5
    """Bound on each ``Status`` asked of the servers after a failure (keeps the
    failover of a killed PS within its 2 s goal)."""
    backoff_s: float = 0.05
    """First pause between tries; doubles up to ``max_backoff_s``."""
    max_backoff_s: float = 1.0
    detect_s: float = DETECT_S
    """A server that leaves the transport's pings unanswered this long (frozen, or cut
    off) fails the calls in flight to it, which starts the recovery."""


ShardView = Mapping[int, tuple[str, int]]
"""What one server said it holds: shard -> (role, version)."""


@dataclass(frozen=True)
class Retry:
    """Call the shard's primary at ``server`` (the one that failed, or where it moved)."""

    server: int


@dataclass(frozen=True)
class Promote:
    """No server serves the shard as primary: promote the replica at ``server``."""

    server: int


@dataclass(frozen=True)
class Wait:
    """Nobody that answered holds the shard: wait and ask again."""


Step = Retry | Promote | Wait


def decide(shard: int, used: int, views: Sequence[ShardView | None],
           placement: Placement | None = None) -> Step:
    """The next step for ``shard`` after a call to server ``used`` failed, from every
    server's answer (None: no answer within the probe bound). ``placement``: where the
    shards live (default: one shard per server answering). Pure."""
    place = placement or Placement(len(views), len(views))
    primaries = [i for i, v in enumerate(views) if _role(v, shard) == "primary"]
    if primaries:
        # Two primaries is a false failover being settled: the home copy steps down
        # when its replication is refused, so the promoted copy is the one to use.
        promoted = [i for i in primaries if i != place.home(shard)]
        return Retry(promoted[0] if promoted else primaries[0])
    if any(_role(v, shard) in ("moving", "moved") for v in views):
        # Being handed to its new home, or just handed (the new home may be too busy
        # taking it to answer a probe): never promote a copy meanwhile.
        return Wait()
    replicas = [i for i, v in enumerate(views) if _role(v, shard) == "replica"]
    if replicas:
        preferred = place.other_copy(shard, used)
        return Promote(preferred if preferred in replicas else replicas[0])
    return Wait()


def _role(view: ShardView | None, shard: int) -> str:
    return "" if view is None else view.get(shard, ("", 0))[0]


class ShardUnavailable(RuntimeError):
    """No server answered as a shard's primary within the recovery deadline."""


@dataclass
class Attempt:
    """One call's recovery so far."""

    started: float
    pause: float
    tried: dict[int, str] = field(default_factory=dict)
    """Server -> how the last call or probe there failed."""


class Routes:
    """Connections to every parameter server of a job and each shard's route."""

    def __init__(self, addresses: Sequence[str], *,
                 recovery: RecoverySettings | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep,
                 logger: logging.Logger | None = None) -> None:
        self.recovery = recovery or RecoverySettings()
        self.stubs = [Stub(a, self.recovery.detect_s) for a in addresses]
        self.placement = Placement(len(addresses), len(addresses))
        """Where the shards live; one shard per server until :meth:`place` says more."""
        self.route = list(range(len(addresses)))
        """Per shard: the server its calls go to."""
        self.versions = [0] * len(addresses)
        """Per shard: the last version seen."""
        self.lost_updates = 0
        self.failovers: list[tuple[int, float]] = []
        """(shard, clock time) of each failover this client performed or followed (a
        shard found on another server after a failed call)."""
        self.clock, self.sleep = clock, sleep
        self.log = logger or _log

    @property
    def servers(self) -> int:
        """Servers known: the job's, and those that left it (they may still be handing
        their shards over)."""
        return len(self.stubs)

    @property
    def shards(self) -> int:
        return len(self.route)

    def place(self, shards: int) -> None:
        """The job has ``shards`` shards (fixed for its life, at least one per server):
        route each to its home until a call finds it elsewhere."""
        self.placement = Placement(shards, self.placement.servers)
        self.route = [self.placement.home(s) for s in range(shards)]
        self.versions = [0] * shards

    def set_addresses(self, addresses: Sequence[str]) -> None:
        """Follow a new list of PS addresses: a replacement PS came up elsewhere, or the
        job's servers grew or shrank. A server that left keeps its connection: it serves
        its shards until it has handed them over, and its calls then fail over."""
        for i, address in enumerate(addresses):
            if i == len(self.stubs):
                self.stubs.append(Stub(address, self.recovery.detect_s))
            elif self.stubs[i].address != address:
                self.stubs[i].close()
                self.stubs[i] = Stub(address, self.recovery.detect_s)
        if len(addresses) != self.placement.servers:
            self.placement = Placement(self.placement.shards, len(addresses))

    def close(self) -> None:
        for stub in self.stubs:
            stub.close()

    def views(self, timeout: float) -> list[ShardView | None]:
        """What every server holds, asked concurrently; None where no answer came."""
        futures = [stub.start("Status", {}, timeout=timeout) for stub in self.stubs]
        out: list[ShardView | None] = []
        for future in futures:
            try:
                status, _ = result(future)
            except grpc.RpcError:
                out.append(None)
                continue
            out.append({int(s): (str(info["role"]), int(info["version"]))
                        for s, info in status["shards"].items()})
        return out

    def discover(self, timeout: float = 5.0) -> dict[int, int]:
        """Route each shard to the server that serves it as primary; returns the route."""
        views = self.views(timeout)
        for shard in range(self.shards):
            step = decide(shard, self.route[shard], views, self.placement)
            if isinstance(step, Retry):
                self._route(shard, step.server, views)
        return dict(enumerate(self.route))

    def _route(self, shard: int, server: int, views: Sequence[ShardView | None]) -> None:
        view = views[server]
        self.route[shard] = server
        if view is not None and shard in view:
            self.versions[shard] = view[shard][1]

    def recover(self, shard: int, exc: grpc.RpcError, used: int,
                attempt: Attempt | None) -> Attempt:
        """After a call for ``shard`` to server ``used`` failed: point the route at a
        live primary (promoting the replica if there is none), pausing between tries;
        the caller retries. Raises ``exc`` when a retry cannot help and
        :class:`ShardUnavailable` past the deadline."""
        code = exc.code()
        if code not in RETRYABLE:
            raise exc
        now = self.clock()
        if attempt is None:
            attempt = Attempt(now, self.recovery.backoff_s)
        attempt.tried[used] = code.name
        if self.route[shard] != used:
            return attempt  # moved meanwhile (a call in flight to the old server)
        moved_to = getattr(exc, "moved_to", None)
        if code is grpc.StatusCode.FAILED_PRECONDITION and moved_to is not None \
                and moved_to != used and 0 <= moved_to < self.servers:
            # Handed over: its old home says where, so no server need be asked.
            self.route[shard] = moved_to
            self.failovers.append((shard, self.clock()))
            log_event(self.log, logging.INFO, "ps_rerouted", shard=shard, to=moved_to,
                      told="moved")
            return attempt
        views = self.views(self.recovery.probe_s)
        for i, view in enumerate(views):
            if view is None:
                attempt.tried.setdefault(i, "no answer")
        step = decide(shard, used, views, self.placement)
        if isinstance(step, Retry):
            self._route(shard, step.server, views)
            if step.server != used:
                # Another worker failed it over (or the primary stepped down): follow.
                self.failovers.append((shard, self.clock()))
                log_event(self.log, logging.INFO, "ps_rerouted", shard=shard, to=step.server)
                return attempt
            log_event(self.log, logging.DEBUG, "ps_call_retry", shard=shard, server=used,
                      error=code.name)
            if code in TRANSIENT:
                # The primary answers: slow or a transient error, not death. Slow but
                # alive is not a failure, so its deadline starts again (a wedged server
                # is the stall watchdog's to find).
                attempt = Attempt(self.clock(), attempt.pause)
            if code is grpc.StatusCode.DEADLINE_EXCEEDED:
                return attempt
        elif isinstance(step, Promote) and self.promote(shard, step.server, code.name):
            return attempt
        if self.clock() - attempt.started >= self.recovery.deadline_s:
            raise ShardUnavailable(self._unavailable(shard, attempt))
        self.sleep(attempt.pause)
        attempt.pause = min(2 * attempt.pause, self.recovery.max_backoff_s)
        return attempt

    def promote(self, shard: int, server: int, cause: str = "") -> bool:
        """Promote the replica of ``shard`` at ``server`` and route there; False when the
        Promote call fails (the caller asks again). ``cause``: how the primary's call
        failed (UNAVAILABLE: refused, or its pings went unanswered)."""
        try:
            reply, _ = self.stubs[server].call("Promote", {"shard": shard},
                                               timeout=max(self.recovery.probe_s, 2.0))
        except grpc.RpcError as exc:
            log_event(self.log, logging.WARNING, "ps_failover_failed", shard=shard,
                      to=server, error=exc.code().name)
            return False
        version = int(reply["version"])
        lost = max(0, self.versions[shard] - version)
        self.lost_updates += lost
        self.route[shard] = server
        self.versions[shard] = version
        self.failovers.append((shard, self.clock()))
        log_event(self.log, logging.WARNING, "ps_failover", shard=shard, to=server,
                  version=version, lost_updates=lost, cause=cause or "-")
        return True

    def _unavailable(self, shard: int, attempt: Attempt) -> str:
        tried = ", ".join(f"ps {i} at {self.stubs[i].address}: {why}"
                          for i, why in sorted(attempt.tried.items()))
        return (f"shard {shard}: no parameter server served it as primary for "
                f"{self.recovery.deadline_s:.0f} s (tried {tried}). Check that the PS pods "
                f"of this job are running and listed in its world; a longer outage can be "
                f"ridden out with a longer RINGWRIGHT_PS_RECOVER_SECONDS.")

