"""The collective operations the runtime needs, behind one interface.

The group manager and the training state only ever call these; the torch.distributed
backend implements them with a process group per world generation, and a Horovod backend
can implement the same protocol. Every failure of a peer (death found by the
heartbeats, lost connection, the last-resort collective timeout) must surface as
:class:`CollectiveError` so that the elastic loop can roll back and rebuild, whatever
library runs the collectives, and whether the runtime or the user's training
function called the collective (:meth:`CollectiveBackend.failure_of`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Protocol, TypeVar

import torch

from ringwright.world import World

from ..membership.liveness import PeerFailure

T = TypeVar("T")

PeerFailureListener = Callable[[PeerFailure], None]
"""Told (from the heartbeat thread) which peers were found dead, just before the abort."""


class CollectiveError(RuntimeError):
    """A collective, or forming a group, failed because of a peer or the network."""


class RankTaken(CollectiveError):
    """Another process already joined this world with this rank (a stale duplicate)."""


class RanksAbsent(CollectiveError):
    """Ranks of the world never showed up while it formed, until the rendezvous deadline:
    rank 0 never served its store, or members never claimed their ranks."""

    def __init__(self, message: str, ranks: tuple[int, ...]) -> None:
        super().__init__(message)
        self.ranks = ranks


LibraryFailure = Callable[[RuntimeError, str], str | None]
"""Names a library's own error (a prefix for the message), or None for any other error."""


def as_collective_failure(err: BaseException, aborted: str | None,
                          library_failure: LibraryFailure) -> CollectiveError | None:
    """``err`` as a collective failure, or None when it is not one.

    Anything raised after the group was aborted (``aborted`` says why) is one, and so is
    what ``library_failure`` recognises as its library's error; other errors (the user's
    own bugs) are not, and propagate.
    """
    if not isinstance(err, RuntimeError):
        return None
    text = str(err).splitlines()[0][:300] if str(err) else type(err).__name__
    if aborted is not None:
        return CollectiveError(f"{text} (group aborted: {aborted})")
    if isinstance(err, CollectiveError):
        return err
    what = library_failure(err, text)
    return CollectiveError(f"{what}: {text}") if what else None


@contextlib.contextmanager
def collective(what: str) -> Iterator[None]:
    """Translate a library failure inside a collective into :class:`CollectiveError`."""
    try:
        yield
    except CollectiveError:
        raise
    except RuntimeError as err:
        # Gloo reports a dead peer as a plain RuntimeError, NCCL and the store as
        # DistError subclasses, Horovod as HorovodInternalError: all RuntimeErrors,
        # and all mean the group is unusable.
        raise CollectiveError(f"{what} failed: {err}") from err


class Superseded(Exception):
    """A newer world was published while this one was being formed; join that one."""


class CollectiveBackend(Protocol):
    """One group of workers per world generation, and the collectives run within it."""

    @property
    def name(self) -> str:
        """Short name for logs (``gloo``, ``nccl``, ``horovod``)."""
        ...

    @property
    def device(self) -> torch.device:
        """Where tensors handed to the collectives live."""
        ...

    def init(self, world: World, rank: int, superseded: Callable[[], bool],
             on_peer_failure: PeerFailureListener) -> None:
        """Form the group of ``world`` as ``rank``; blocks until every member has arrived.

        From the join barrier until :meth:`shutdown` the member heartbeats; when peers
        are found dead the group is aborted (every blocked and later collective
        raises) and ``on_peer_failure`` is called. Raises :class:`Superseded` when
        ``superseded()`` turns true while waiting, :class:`CollectiveError` when the
        group cannot be formed.
        """
        ...

    def abort(self, reason: str) -> None:
        """Make every collective of the current group, blocked or later, fail at once.

        Safe from any thread, at any time (also while the group is being formed).
        """
        ...

    def failure_of(self, err: BaseException) -> CollectiveError | None:
        """``err`` as a collective failure when it means the group broke (a library
        error, or anything raised after the group was aborted); None otherwise."""
        ...

    def shutdown(self, *, left_cleanly: bool = False) -> None:
        """Leave the current group (if any); safe after a failure and when not joined.

        ``left_cleanly``: this member finished or every member agreed to move on, so
        its silence from now on is no failure.
        """
        ...

    def close(self) -> None:
        """Leave for good: the group and anything kept across generations (a store server)."""
        ...

    def broadcast_tensors(self, tensors: Sequence[torch.Tensor], src: int) -> None:
        """Overwrite ``tensors`` in place with ``src``'s values."""
        ...

    def broadcast_object(self, obj: T, src: int) -> T:
        """``src``'s ``obj`` on every rank (pickled; for small, irregular state)."""
        ...

    def allgather_object(self, obj: T) -> list[T]:
        """Every rank's ``obj``, indexed by rank."""
        ...

    def allreduce_gradients(self, params: Iterable[torch.Tensor], *, average: bool) -> None:
        """Sum (or average) the ``.grad`` of ``params`` across ranks, in place.

        A parameter without a gradient on this rank contributes zeros, so ranks whose
        batch was empty still take part.
        """
        ...

    def allreduce_(self, flat: torch.Tensor, name: str) -> None:
        """Sum one contiguous tensor across ranks, in place.

        ``name`` identifies the tensor (the same on every rank); it may be called from
        one helper thread while the training thread waits for it.
        """
        ...

    def allreduce_max(self, value: int) -> int:
        """The largest ``value`` over all ranks."""
        ...

    def barrier(self) -> None:
        """Return once every rank has called it."""
        ...
