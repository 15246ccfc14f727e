"""A world of one process, for ``python train.py`` with no job around it.

Under a debugger, in a notebook or in a quick local try, nobody publishes a world.
Rather than fail, the runtime then trains as the only member of a fixed world: rank
0 of 1, no store to connect to, no peers to heartbeat, every collective the identity.
The same script runs unchanged in a job, where the operator's environment selects the
real sources.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import TypeVar

import torch

from ringwright.world import JobRef, Member, StoreAddress, World

from ..collectives.backend import CollectiveError, PeerFailureListener
from ..collectives.flat import gradients
from ..membership.source import WorldBox

T = TypeVar("T")

SOLO_POD = "solo-0"
"""The pod name of a process that runs without a job."""


def solo_world(pod: str = SOLO_POD) -> World:
    """Generation 0 of a job of one member, ``pod``, with the runtime's defaults
    (no learning-rate rescaling, no checkpoints)."""
    return World(job=JobRef(namespace="local", name="solo"), generation=0,
                 store=StoreAddress(address="127.0.0.1"),
                 members=(Member(rank=0, pod=pod, ip="127.0.0.1"),))


class SoloSource:
    """The one world of a process without a job; no newer one ever comes."""

    def __init__(self, world: World) -> None:
        self._box = WorldBox()
        self._box.offer(world, "solo")

    def latest(self) -> World | None:
        """The one world."""
        return self._box.latest()

    def wait_for_world(self, after_generation: int, timeout: float) -> World:
        """The one world, unless it is not newer than ``after_generation``: then the
        wait times out, as nothing else will be published."""
        return self._box.wait_newer(after_generation, timeout)

    def close(self) -> None:
        """Nothing to stop."""
        return


class SoloBackend:
    """Collectives of a group of one: every operation leaves its input as it is."""

    def __init__(self, device: torch.device) -> None:
        self._device = device

    @property
    def name(self) -> str:
        """``solo``, in logs."""
        return "solo"

    @property
    def device(self) -> torch.device:
        """The state's device."""
        return self._device

    def init(self, world: World, rank: int, superseded: Callable[[], bool],
             on_peer_failure: PeerFailureListener) -> None:
        """Nothing to connect: the only member has arrived."""
        if world.size != 1 or rank != 0:
            raise CollectiveError(
                f"a solo run cannot join a world of {world.size} as rank {rank}")

    def abort(self, reason: str) -> None:
        """No peer can fail, so nothing is ever blocked."""
        return

    def failure_of(self, err: BaseException) -> CollectiveError | None:
        """Every error is the script's own: none is a peer's failure."""
        return err if isinstance(err, CollectiveError) else None

    def shutdown(self, *, left_cleanly: bool = False) -> None:
        """No group to leave."""
        return

    def close(self) -> None:
        """No group and no store to leave."""
        return

    def broadcast_tensors(self, tensors: Sequence[torch.Tensor], src: int) -> None:
        """The only rank's tensors are everyone's."""
        return

    def broadcast_object(self, obj: T, src: int) -> T:
        """The only rank's object is everyone's."""
        return obj

    def allgather_object(self, obj: T) -> list[T]:
        """One rank, one object."""
        return [obj]

    def allreduce_gradients(self, params: Iterable[torch.Tensor], *, average: bool) -> None:
        """A sum or mean over one rank; missing gradients become zeros, as in a group of
        several (so an optimizer steps the same way alone or in a job)."""
        gradients(params)

    def allreduce_(self, flat: torch.Tensor, name: str) -> None:
        """A sum over one rank."""
        return

    def allreduce_max(self, value: int) -> int:
        """The largest of one value."""
        return value

    def barrier(self) -> None:
        """Everyone (this process) has arrived."""
        return
