"""A binding and a two-sided broadcast for unit tests of the training state."""

from __future__ import annotations

import contextlib
from typing import Any, TypeVar

import torch

from ringwright.runtime.collectives.backend import CollectiveBackend
from ringwright.world import World
from tests.unit.runtime.runtime_fakes import FakeBackend

T = TypeVar("T")


class Wire:
    """What a broadcast source sent, for the receivers that come after it."""

    def __init__(self) -> None:
        self.objects: list[Any] = []
        self.tensors: list[list[torch.Tensor]] = []


class PairBackend(FakeBackend):
    """One side of a broadcast between states in one process: the source sends first,
    then each receiver replays what was sent (tensors copied in place, objects as is)."""

    def __init__(self, wire: Wire, rank: int) -> None:
        super().__init__()
        self.wire = wire
        self.rank = rank
        self.objects_sent: list[Any] = []

    def broadcast_object(self, obj: T, src: int) -> T:
        if self.rank == src:
            self.wire.objects.append(obj)
            self.objects_sent.append(obj)
            return obj
        received: T = self.wire.objects[len(self.objects_sent)]
        self.objects_sent.append(received)
        return received

    def broadcast_tensors(self, tensors: Any, src: int) -> None:
        if self.rank == src:
            self.wire.tensors.append([t.detach().clone() for t in tensors])
            return
        sent = self.wire.tensors[-1]
        assert [t.shape for t in sent] == [t.shape for t in tensors]
        with torch.no_grad():
            for mine, theirs in zip(tensors, sent, strict=True):
                mine.copy_(theirs)


class Binding:
    """A member of ``world`` at ``rank`` with the given backend; counts progress reports."""

    def __init__(self, world: World, rank: int = 0,
                 backend: CollectiveBackend | None = None) -> None:
        self._backend = backend or FakeBackend()
        self._world = world
        self._rank = rank
        self.progress_calls = 0

    @property
    def backend(self) -> CollectiveBackend:
        return self._backend

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world(self) -> World:
        return self._world

    def check_world(self) -> None:
        return

    def progress(self) -> None:
        self.progress_calls += 1

    def busy(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()
