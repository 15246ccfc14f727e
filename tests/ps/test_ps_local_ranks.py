"""PS-mode worker pods of three local ranks each (the pod entry point): every rank is
a worker the servers know by ``<pod>/<local rank>``; a killed pod's pieces are
requeued and every sample is accounted for exactly once."""

from __future__ import annotations

from pathlib import Path

from tests.ps.harness import LocalPSJob, ps_done
from tests.ps.test_ps_elastic import ARGS, ASYNC, SAMPLES


def test_a_killed_pod_of_three_ranks_with_exact_accounting(tmp_path: Path) -> None:
    job = LocalPSJob(tmp_path, 2, [*ARGS, "--slow", "0.05"], ASYNC, local_ranks=3)
    try:
        job.start_all(["w0", "w1"])
        job.wait_steps("w1", 6)  # the three ranks of w1 share its trace file
        job.kill("w1")
        job.publish(["w0"])  # the operator drops the dead pod's ranks together
        codes = job.wait_all()
        assert codes["w0"] == codes["ps-0"] == codes["ps-1"] == 0, job.logs()
        log = (tmp_path / "w0.log").read_text()
        done = sorted(line.split("worker=")[1].split()[0]
                      for line in log.splitlines() if "ps_worker_done" in line)
        assert done == ["w0", "w0/1", "w0/2"], log[-3000:]
        counts = ps_done((tmp_path / "ps-0.log").read_text())
        for epoch in range(2):
            got = counts["trained"].get(epoch, 0) + counts["dropped"].get(epoch, 0)
            assert got == SAMPLES, f"epoch {epoch}: {counts}"
        assert sum(counts["requeued"].values()) > 0, counts
    finally:
        job.close()
