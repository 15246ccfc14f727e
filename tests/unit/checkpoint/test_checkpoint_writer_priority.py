"""The background writer runs at a lower CPU priority than training, in its own thread
only: the training thread keeps its priority."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
import torch

from ringwright.runtime.checkpoint.checkpointer import WRITER_NICE, Checkpointer
from ringwright.runtime.checkpoint.storage import LocalStorage, StagedFile

pytestmark = pytest.mark.skipif(not hasattr(os, "setpriority"), reason="POSIX priorities")


class WatchedStorage(LocalStorage):
    """Local storage that notes the niceness of the thread creating each file."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.nice: list[int] = []

    def create(self, name: str) -> StagedFile:
        self.nice.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
        return super().create(name)


@pytest.mark.parametrize("nice", [WRITER_NICE, 0])
def test_the_writer_thread_alone_runs_at_the_configured_niceness(tmp_path: Path,
                                                                 nice: int) -> None:
    mine = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    storage = WatchedStorage(tmp_path)
    with Checkpointer(storage, writer_nice=nice) as ckpt:
        ckpt.save(1, {"w": torch.ones(4)})
        assert ckpt.flush()
    assert storage.nice and set(storage.nice) == {max(mine, nice)}
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == mine
    assert WRITER_NICE >= 10
