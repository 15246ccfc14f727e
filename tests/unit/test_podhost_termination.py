"""A graceful pod host stops a deleted pod's process as a kubelet does: SIGTERM first,
SIGKILL only once the pod's terminationGracePeriodSeconds is over."""

from __future__ import annotations

import contextlib
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from ringwright.devcluster.podhost import PodHost
from ringwright.objects import Obj

# Exits 143 on SIGTERM once it wrote "flushed", as the runtime does after its checkpoint;
# with IGNORE set it ignores SIGTERM, as a process stuck in native code would.
CONTAINER = """
import os, signal, sys, time
out = sys.argv[1]
def term(*_):
    open(out, "w").write("flushed")
    sys.exit(143)
signal.signal(signal.SIGTERM, signal.SIG_IGN if os.environ.get("IGNORE") else term)
open(out + ".up", "w").close()
while True:
    time.sleep(0.05)
"""


class FakeKube:
    """The few API calls the pod host makes, over a dict of pods."""

    def __init__(self) -> None:
        self.pods: dict[str, Obj] = {}
        self.config = SimpleNamespace(server="https://127.0.0.1:1", ca_file="/dev/null")

    def list(self, path: str, **params: Any) -> list[Obj]:
        return list(self.pods.values())

    def create(self, path: str, body: Obj) -> Obj:
        return {"status": {"token": "t"}}

    def merge_patch(self, path: str, body: Obj) -> Obj:
        return {}


def pod(name: str, grace: int) -> Obj:
    return {"metadata": {"name": name, "uid": f"uid-{name}", "namespace": "ns"},
            "spec": {"containers": [{"name": "train"}], "terminationGracePeriodSeconds": grace},
            "status": {"phase": "Running", "podIP": "10.0.0.1"}}


def sync_until(host: PodHost, done: Any, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, "timed out"
        host.sync()
        time.sleep(0.05)


@contextlib.contextmanager
def deleted(tmp_path: Path, grace: int, graceful: bool,
            ignore: bool = False) -> Iterator[tuple[PodHost, Path]]:
    """A pod host running pod w0's process, right after w0 was deleted; yields the host
    and the file the process writes on SIGTERM."""
    kube, out = FakeKube(), tmp_path / "w0"
    kube.pods["w0"] = pod("w0", grace=grace)
    env = {"IGNORE": "1"} if ignore else {}
    host = PodHost(kube, "ns", "job", [sys.executable, "-c", CONTAINER, str(out)],  # type: ignore[arg-type]
                   tmp_path / "pods", extra_env=env, graceful=graceful)
    try:
        sync_until(host, lambda: Path(f"{out}.up").exists())
        del kube.pods["w0"]
        host.sync()
        yield host, out
    finally:
        host.close()


def test_a_deleted_pods_process_gets_sigterm_and_its_grace(tmp_path: Path) -> None:
    with deleted(tmp_path, grace=60, graceful=True) as (host, out):
        sync_until(host, lambda: "w0" in host.finished)
        assert host.finished["w0"] == [143]
        assert out.read_text() == "flushed"


def test_a_process_ignoring_sigterm_is_killed_after_the_grace_period(tmp_path: Path) -> None:
    with deleted(tmp_path, grace=1, graceful=True, ignore=True) as (host, _):
        assert "w0" not in host.finished, "killed before its grace period was over"
        sync_until(host, lambda: "w0" in host.finished)
        assert host.finished["w0"] == [-signal.SIGKILL]


def test_without_grace_a_deleted_pods_process_is_killed_at_once(tmp_path: Path) -> None:
    with deleted(tmp_path, grace=60, graceful=False) as (host, out):
        assert host.finished["w0"] == [-signal.SIGKILL]
        assert not out.exists()
