"""Every process the local launcher starts is a new incarnation with its own uid, as a
pod is: a process started again under its predecessor's name never takes the
predecessor's entry in a world published before the exit was seen (the runtime's rule
for a namesake entry, tests/unit/runtime/test_group.py)."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from ringwright.runtime.local.launcher import LocalJob

# Records its uid; the first incarnation crashes, the second stays until killed.
WORKER = """
import os, sys, time
uids = os.path.join(sys.argv[1], "uids")
with open(uids, "a") as out:
    out.write(os.environ["RINGWRIGHT_POD_UID"] + "\\n")
if len(open(uids).read().split()) == 1:
    sys.exit(3)
time.sleep(600)
"""


def test_a_restarted_process_is_a_new_incarnation(tmp_path: Path) -> None:
    job = LocalJob([sys.executable, "-c", WORKER, str(tmp_path)], tmp_path / "job",
                   job="inc", restart=True, capture_logs=False)
    uids = tmp_path / "uids"
    with job:
        first = job.start(1)
        deadline = time.monotonic() + 60
        while len(uids.read_text().split() if uids.exists() else []) < 2:
            assert time.monotonic() < deadline, "the crashed process was never restarted"
            time.sleep(0.02)
    old, new = uids.read_text().split()
    assert old != new
    assert [m.pod_uid for m in first.members] == [old]
    assert job.pod("inc-worker-0").uid == new
