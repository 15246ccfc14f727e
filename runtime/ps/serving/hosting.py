"""What a parameter server holds and says: the job's configuration, its hosted shards
(primary or replica) and counters, and the errors a request can meet."""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import torch

from ..partition import Kind, Partition, TensorSpec, partition
from ..wire.codec import Header
from .consistency import Consistency
from .optim import ServerOptimizer
from .shard import ShardState


class Role(StrEnum):
    PRIMARY = "primary"
    REPLICA = "replica"
    MOVING = "moving"
    """Being handed to its new home (a resize): served by nobody until the home takes it."""
    MOVED = "moved"
    """Handed to its new home: the copy left here is not promoted until the new home
    refreshes it (then a replica) or a grace period passes (a new home busy taking a
    large shard may leave a probe unanswered: that is no failure)."""

    @property
    def held_by_others(self) -> bool:
        """This copy is not the shard's primary: another server's copy may replace it."""
        return self in (Role.REPLICA, Role.MOVED)


class NotServing(RuntimeError):
    """A request for a shard this server does not serve as primary; ``moved_to``: the
    server it was just handed to, when known (the caller goes there without asking
    every server)."""

    def __init__(self, message: str, moved_to: int | None = None) -> None:
        super().__init__(message)
        self.moved_to = moved_to


class IncompletePush(RuntimeError):
    """A push named staged chunks that this server does not hold (they went to a server
    that has since failed, or were abandoned): the worker must send it whole."""


@dataclass(frozen=True)
class JobConfig:
    """What the first worker tells every PS: the model's tensors and how to train them."""

    specs: tuple[TensorSpec, ...]
    shards: int
    optimizer: ServerOptimizer
    consistency: Consistency
    data: dict[str, Any]
    """samples, pieceSize, epochs, requeueStale for the data-shard service."""

    def partition(self) -> Partition:
        return partition(self.specs, self.shards)

    def to_json(self) -> dict[str, Any]:
        return {"specs": [[s.name, list(s.shape), s.itemsize, s.kind.value, s.init_std]
                          for s in self.specs],
                "shards": self.shards, "optimizer": self.optimizer.to_json(),
                "consistency": self.consistency.to_json(), "data": self.data}

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> JobConfig:
        specs = tuple(TensorSpec(n, tuple(shape), size, Kind(kind), *rest)
                      for n, shape, size, kind, *rest in doc["specs"])
        return cls(specs, int(doc["shards"]), ServerOptimizer.from_json(doc["optimizer"]),
                   Consistency.from_json(doc["consistency"]), dict(doc["data"]))


Gradients = tuple[dict[str, torch.Tensor], dict[str, tuple[torch.Tensor, torch.Tensor]]]
"""Dense gradients by slice key, and (ids, rows) per table."""


@dataclass
class Hosted:
    """One shard on this server, primary or replica."""

    state: ShardState
    version: int
    role: Role
    cond: threading.Condition = field(default_factory=threading.Condition)
    round: dict[str, Gradients | None] = field(default_factory=dict)
    """Sync: pushes of the current round by worker (None: a worker without data)."""
    clean_since: int = -1
    """Primary: the version of the last copy taken for the other copy's host, or handed
    over to this server; the state tracks what changed since
    (:meth:`.shard.ShardState.changes`)."""
    held_at: tuple[str, int] | None = None
    """Primary after a hand-over: the old home's address, which keeps the shard at the
    version handed over; the first copy to it need send only what changed since."""
    moved_at: float = 0.0
    """When the shard was handed to its new home (role MOVED)."""
    moved_to: int | None = None
    """The server it was handed to (role MOVED)."""
    replicated: int = -1
    """Version last sent to (primary) or received from (replica) the other copy."""
    pushes: dict[str, tuple[str, Header]] = field(default_factory=dict)
    """Per worker: the id of its last push here and the reply it got, so that a push
    retried after a lost reply is answered again, not applied twice."""


@dataclass
class Stats:
    applied: int = 0
    stale: int = 0
    staleness: Counter[int] = field(default_factory=Counter)
    """Applied pushes by staleness (versions behind)."""
    stale_staleness: Counter[int] = field(default_factory=Counter)
    """Dropped pushes by staleness."""
