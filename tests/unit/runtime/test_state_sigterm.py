"""SIGTERM while a member waits (for a world, for its peers to form a group) ends the
wait at once: the member that was rank 0 writes the last commit, and the process exits
with 143. A real signal to this process; the collectives are fakes."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from ringwright.runtime.checkpoint.checkpointer import Checkpointer
from ringwright.runtime.checkpoint.storage import LocalStorage
from ringwright.runtime.collectives.backend import PeerFailureListener
from ringwright.runtime.elastic import ElasticRuntime
from ringwright.runtime.sampler import ElasticSampler
from ringwright.runtime.settings import RuntimeSettings
from ringwright.runtime.state import State, Terminated
from ringwright.world import CheckpointSettings, World
from tests.unit.runtime.runtime_fakes import FakeBackend, FakeReporter, FakeSource, make_world

ME = "w-0"

# A wait that ignored the signal would block for its full timeout (minutes): fail instead.
pytestmark = pytest.mark.timeout(60)


class HangingBackend(FakeBackend):
    """Forming the group of ``hang_generation`` never completes (a peer that never comes)."""

    def __init__(self, hang_generation: int) -> None:
        super().__init__()
        self.hang_generation = hang_generation
        self.hanging = threading.Event()

    def init(self, world: World, rank: int, superseded: Callable[[], bool],
             on_peer_failure: PeerFailureListener) -> None:
        super().init(world, rank, superseded, on_peer_failure)
        while world.generation == self.hang_generation:
            self.hanging.set()
            time.sleep(0.05)


@pytest.fixture()
def sigterm_when() -> Iterator[Callable[[threading.Event], None]]:
    """Send this process SIGTERM once ``ready`` is set (from a helper thread)."""
    threads: list[threading.Thread] = []

    def arm(ready: threading.Event) -> None:
        def send() -> None:
            if ready.wait(60):
                os.kill(os.getpid(), signal.SIGTERM)
        thread = threading.Thread(target=send, daemon=True)
        thread.start()
        threads.append(thread)

    previous = signal.getsignal(signal.SIGTERM)
    yield arm
    for thread in threads:
        thread.join(5)
    signal.signal(signal.SIGTERM, previous)


def new_state(path: Path) -> State:
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1)
    return State(model, torch.optim.SGD(model.parameters(), lr=0.1), ElasticSampler(64, 2),
                 checkpointer=Checkpointer(LocalStorage(path)))


def test_sigterm_while_forming_writes_the_last_commit_and_exits_143(
        tmp_path: Path, sigterm_when: Callable[[threading.Event], None]) -> None:
    source, backend = FakeSource(), HangingBackend(hang_generation=1)
    no_periodic = CheckpointSettings(path=str(tmp_path))
    source.publish(make_world(0, [ME]).model_copy(update={"checkpoint": no_periodic}))
    state = new_state(tmp_path)

    def train(state: State) -> None:
        while True:
            state.model(torch.ones(1, 2)).sum().backward()
            state.optimizer.step()
            state.advance()
            if state.step == 6:  # the operator adds a member that will never arrive
                source.publish(make_world(1, [ME, "ghost"]).model_copy(
                    update={"checkpoint": no_periodic}))
            if state.step % 4 == 0:
                state.commit()

    sigterm_when(backend.hanging)
    rt = ElasticRuntime(source, ME, settings=RuntimeSettings(termination_grace_s=30),
                        reporter=FakeReporter(), backend_factory=lambda k, d, s: backend)
    with rt, pytest.raises(Terminated) as stopped:
        rt.run(train, state)
    assert stopped.value.code == 128 + signal.SIGTERM and stopped.value.flushed
    restored = Checkpointer(LocalStorage(tmp_path)).restore_latest()
    assert restored is not None and restored.payload["step"] == 8, "the last commit"


class WaitingSource(FakeSource):
    """A source whose operator never publishes; says when someone waits on it."""

    def __init__(self) -> None:
        super().__init__()
        self.waiting = threading.Event()

    def wait_for_world(self, after_generation: int, timeout: float) -> World:
        self.waiting.set()
        return super().wait_for_world(after_generation, timeout)


def test_sigterm_while_waiting_for_a_first_world_exits_143_without_a_checkpoint(
        tmp_path: Path, sigterm_when: Callable[[threading.Event], None]) -> None:
    source = WaitingSource()
    sigterm_when(source.waiting)
    rt = ElasticRuntime(source, ME, settings=RuntimeSettings(world_wait_timeout_s=600),
                        reporter=FakeReporter(), backend_factory=lambda k, d, s: FakeBackend())
    state = new_state(tmp_path)
    with rt, pytest.raises(Terminated) as stopped:
        rt.run(lambda s: None, state)
    assert stopped.value.code == 143
    assert Checkpointer(LocalStorage(tmp_path)).steps() == [], "no state, nothing to write"
