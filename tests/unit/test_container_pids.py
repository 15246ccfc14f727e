"""Finding a real node's container processes on the host, from the pod's status."""

from __future__ import annotations

from pathlib import Path

from ringwright.devcluster.realnode import container_pids

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
