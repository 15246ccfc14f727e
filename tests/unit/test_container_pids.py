"""Finding a real node's container processes on the host, from the pod's status."""

from __future__ import annotations

import signal
import subprocess
from pathlib import Path

from ringwright.devcluster.realnode import container_pids, crash_container

CID = "3f1c0ffee5a1d2"


def _proc(tmp_path: Path) -> Path:
    """A /proc with two processes of the container, one of another, one gone meanwhile
    (no cgroup file) and an entry that is no process."""
    proc = tmp_path / "proc"
    for pid, cgroup in ((41, f"12:pids:/rwnode-s0n1/kubepods/pod1/{CID}\n"),
                        (7, f"0::/rwnode-s0n1/kubepods/pod1/{CID}\n"),
                        (99, "0::/rwnode-s0n1/kubepods/pod2/other\n"),
                        (5, None)):
        (proc / str(pid)).mkdir(parents=True)
        if cgroup is not None:
            (proc / str(pid) / "cgroup").write_text(cgroup)
    (proc / "self").mkdir()
    return proc


def _pod(container_id: str | None) -> dict[str, object]:
    status = {"name": "train", "containerID": container_id} if container_id else {"name": "t"}
    return {"status": {"containerStatuses": [status]}}


def test_the_processes_whose_cgroup_the_container_id_names(tmp_path: Path) -> None:
    assert container_pids(_pod(f"containerd://{CID}"), proc=_proc(tmp_path)) == [7, 41]


def test_a_container_not_started_yet_has_no_processes(tmp_path: Path) -> None:
    proc = _proc(tmp_path)
    assert container_pids(_pod(None), proc=proc) == []
    assert container_pids({"status": {}}, proc=proc) == []
    assert container_pids(_pod(f"containerd://{CID}"), container=1, proc=proc) == []


def test_crashing_a_container_signals_each_of_its_processes(tmp_path: Path) -> None:
    proc = _proc(tmp_path)
    child = subprocess.Popen(["sleep", "60"])
    try:
        # The container's processes: the child, and one gone before the signal (an id
        # above any pid_max, so no other process can hold it).
        gone = 2**22 + 1
        for pid in (7, 41):
            (proc / str(pid) / "cgroup").unlink()
        for pid in (child.pid, gone):
            (proc / str(pid)).mkdir()
            (proc / str(pid) / "cgroup").write_text(f"0::/kubepods/pod1/{CID}\n")
        pids = crash_container(_pod(f"containerd://{CID}"), proc=proc)
        assert pids == sorted([child.pid, gone])
        assert child.wait(timeout=10) == -signal.SIGKILL
    finally:
        child.kill()
        child.wait()
