"""The local launcher counts every member's word about a frozen peer, also the word of
members that exited (for a restart) right after giving it.

Members that find a peer frozen inside ``hvd.init()`` name it and exit one after
another. The launcher used to judge only while no exit was pending, and a restarted
process replaces its predecessor's report: the frozen peer stayed in the next world as
its rank 0, and the restarted members waited on its store until the rendezvous deadline.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import pytest

from ringwright.runtime.local.launcher import LocalJob
from ringwright.world import Report, ReportKind
from tests.waiting import wait_for

# worker-2 stays silent (as frozen). worker-0 names it and exits at once; its restarted
# process reports `joining`, replacing that report. worker-1 names it only once told
# (after both), then exits.
WORKER = """
import os, pathlib, sys, time
from ringwright.world import Report, ReportKind
pod, tmp = os.environ["RINGWRIGHT_POD_NAME"], pathlib.Path(sys.argv[1])
report = pathlib.Path(os.environ["RINGWRIGHT_REPORTS_DIR"]) / f"{pod}.json"
def say(kind, suspects=()):
    report.parent.mkdir(parents=True, exist_ok=True)
    tmp_file = report.with_name("." + report.name)
    tmp_file.write_text(Report(kind=kind, generation=0, at=time.time(),
                               suspects=suspects).to_json())
    tmp_file.replace(report)
started = tmp / f"started-{pod}"
if started.exists():
    say(ReportKind.JOINING)
    time.sleep(3600)
started.touch()
if pod.endswith("-2"):
    time.sleep(3600)
if pod.endswith("-1"):
    while not (tmp / "go").exists():
        time.sleep(0.02)
say(ReportKind.PEER_DEAD, ("frozen-worker-2",))
sys.exit(70)
"""


def _kind(path: Path) -> ReportKind | None:
    try:
        return Report.model_validate_json(path.read_text()).kind
    except (OSError, ValueError):
        return None


def test_a_peer_named_by_members_that_exited_one_after_another_is_evicted(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    # A long settle window: the burst of exits stays open while worker-1 reports.
    job = LocalJob([sys.executable, "-c", WORKER, str(tmp_path)], tmp_path / "job",
                   job="frozen", restart=True, capture_logs=False, settle_s=60.0,
                   evict_grace_s=0.2, fork_workers=False)
    with job:
        job.start(3)
        wait_for(lambda: "pod_failed pod=frozen-worker-0" in caplog.text, "worker-0's exit",
                 timeout=30, interval=0.02)
        # Its restarted process replaced its report before worker-1 gives its own.
        restarted = job.reports_dir / "frozen-worker-0.json"
        wait_for(lambda: _kind(restarted) is ReportKind.JOINING,
                 "the restarted worker-0's report", timeout=30, interval=0.02)
        (tmp_path / "go").touch()
        wait_for(lambda: "pod_evicted pod=frozen-worker-2" in caplog.text,
                 "worker-2's eviction", timeout=30, interval=0.02)
        frozen = job.pod("frozen-worker-2").process
        wait_for(lambda: frozen.poll() is not None, "worker-2 killed after the grace period",
                 timeout=30, interval=0.02)
    assert "named dead by 2 of 3 pods of generation 0" in caplog.text
