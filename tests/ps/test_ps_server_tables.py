"""A 10,000,000 x 64 embedding table across three servers, trained in a test's memory.

Real PS and worker processes of the wide-and-deep example with ``--server-tables``: its
tables are on the meta device, so no worker holds them and each server creates the rows
training touches (Zipf-distributed ids, as clicks are). Held whole, the deep table's
values and Adagrad state alone would be 5.1 GB (1.7 GB on each server, and a replica's
as much again); the processes' peak resident memory shows they never held it.
"""

from __future__ import annotations

import time
from pathlib import Path

from tests.procstat import peak_rss_bytes
from tests.ps.harness import WAIT_S, LocalPSJob, consistency, ps_done

FIELDS = 6  # the example's categorical fields; rows = FIELDS x vocab
VOCAB = 1_666_667
DIM = 64
SAMPLES = 4096
ARGS = ["--samples", str(SAMPLES), "--vocab", str(VOCAB), "--dim", str(DIM),
        "--batch-size", "256", "--piece-batches", "2", "--epochs", "1",
        "--optimizer", "adagrad", "--server-tables"]
WORKERS = ["w0", "w1"]
GiB = 1 << 30
WHOLE_TABLE = FIELDS * VOCAB * DIM * 4
"""Bytes of the deep table's values alone."""


def _peak_rss(pid: int) -> int:
    """The process's peak resident memory so far, 0 once it is gone."""
    try:
        return peak_rss_bytes(pid)
    except ProcessLookupError:
        return 0


def test_a_ten_million_row_table_trains_every_sample_once_without_being_held_whole(
        tmp_path: Path) -> None:
    job = LocalPSJob(tmp_path, 3, ARGS, consistency("Sync"))
    peaks: dict[str, int] = {}
    try:
        job.start_all(WORKERS)
        deadline = time.monotonic() + WAIT_S
        # Peaks are read while the processes live: VmHWM goes with the process.
        while any(p.poll() is None for p in job.procs.values()):
            job.check_alive()
            assert time.monotonic() < deadline, "the job did not finish\n" + job.logs()
            for pod, proc in job.procs.items():
                peaks[pod] = max(peaks.get(pod, 0), _peak_rss(proc.pid))
            time.sleep(0.1)
        codes = job.wait_all()
        assert all(c == 0 for c in codes.values()), job.logs()
        # The data-shard service runs beside shard 0.
        counts = ps_done((tmp_path / "ps-0.log").read_text())
    finally:
        job.close()
    # Every sample trained exactly once (sync: nothing is dropped), counted by the
    # data-shard service and by the workers themselves.
    assert counts["trained"] == {0: SAMPLES}, counts
    assert sum(job.result(w)["trained"] for w in WORKERS) == SAMPLES
    steps = [s for w in WORKERS for s in job.steps(w)]
    assert sorted(i for s in steps for i in range(s["start"], s["stop"])) == list(range(SAMPLES))
    # Memory: every server and worker far below a share of the table it would hold.
    assert all(peaks[p] > 0 for p in job.procs), peaks
    print({p: f"{v / GiB:.2f} GiB" for p, v in peaks.items()})
    for pod, peak in peaks.items():
        assert peak < WHOLE_TABLE // 2, (
            f"{pod} peaked at {peak / GiB:.2f} GiB: it held the table "
            f"({WHOLE_TABLE / GiB:.2f} GiB of values) or a large part of it; {peaks}")
