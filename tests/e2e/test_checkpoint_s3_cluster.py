"""Checkpoints in object storage through the operator: the job names an s3:// path, a
Secret with the credentials and the server's endpoint; its pods (run by the pod host with
the environment the operator gave them) checkpoint to a real S3 server, and a new job
with the same spec resumes from the bucket.

The test process itself holds no AWS credentials or endpoint, so the pods can have
learned them only from the job's spec and the Secret.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from ringwright.devcluster.podhost import PodHost
from ringwright.devcluster.s3server import S3Server
from ringwright.kube import KubeClient, api_path
from ringwright.operator.plan.manifests import JOB_LABEL
from ringwright.runtime.checkpoint.checkpointer import Checkpointer
from ringwright.runtime.checkpoint.s3 import S3Storage
from tests.e2e.test_elastic_job import HostThread
from tests.jobs import OperatorProcess, get_status, tj_path, training_job
from tests.runtime.elastic_traces import Traces
from tests.s3 import new_bucket
from tests.waiting import wait_for

pytestmark = [pytest.mark.cluster, pytest.mark.e2e]

ROOT = Path(__file__).resolve().parents[2]
WORKER = ROOT / "tests" / "runtime" / "state_worker.py"
SAMPLES, BATCH, WORKERS = 64, 4, 2


def run_job(kube: KubeClient, ns: str, name: str, checkpoint: dict[str, object],
            workdir: Path, epochs: int) -> Traces:
    """Create the job, host its pods until it succeeds and every worker has exited, and
    return the workers' traces.

    The job succeeds when rank 0 exits; its pods are kept (cleanPodPolicy None), so the
    other worker's last records (it exits a moment later) are not cut off by its pod's
    deletion."""
    kube.create(tj_path(ns), training_job(name, replicas=WORKERS, minimum=WORKERS,
                                          gpusPerWorker=0, checkpoint=checkpoint,
                                          runPolicy={"cleanPodPolicy": "None"}))
    env = {"TRACE_DIR": str(workdir / "trace"), "EPOCHS": str(epochs),
           "SAMPLES": str(SAMPLES), "BATCH": str(BATCH), "COMMIT_EVERY": "4",
           "STEP_SLEEP": "0.02", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    runner = HostThread(PodHost(kube, ns, name, [sys.executable, str(WORKER)], workdir,
                                extra_env=env, readiness_grace=120))
    try:
        try:
            wait_for(lambda: get_status(kube, ns, name).get("phase") == "Succeeded",
                     f"job {name} to succeed", timeout=400)
            wait_for(lambda: all(p["status"].get("phase") == "Succeeded"
                                 for p in kube.list(api_path("v1", "pods", ns),
                                                    labelSelector=f"{JOB_LABEL}={name}")),
                     f"job {name}: every worker to exit 0", timeout=120)
        except AssertionError as err:
            raise AssertionError(f"{err}\nstatus: {get_status(kube, ns, name)}\n"
                                 f"{runner.tails()}") from err
    finally:
        runner.close()
    return runner.traces()


def test_pods_checkpoint_to_s3_with_the_secrets_credentials_and_a_new_job_resumes(
        kube: KubeClient, namespace: str, operator: OperatorProcess, s3_server: S3Server,
        tmp_path: Path) -> None:
    assert not {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT_URL",
                "AWS_ENDPOINT_URL_S3"} & os.environ.keys(), "pods must not inherit them"
    bucket = new_bucket(s3_server)
    kube.create(api_path("v1", "secrets", namespace), {
        "apiVersion": "v1", "kind": "Secret", "metadata": {"name": "s3-creds"},
        "stringData": {"AWS_ACCESS_KEY_ID": s3_server.access_key,
                       "AWS_SECRET_ACCESS_KEY": s3_server.secret_key}})
    checkpoint: dict[str, object] = {
        "path": bucket.url("jobs/tj"), "credentialsSecret": "s3-creds",
        "endpoint": s3_server.endpoint, "intervalSteps": 4, "keep": 2}

    first = run_job(kube, namespace, "first", checkpoint, tmp_path / "first", epochs=1)
    steps = Checkpointer(S3Storage(bucket.url("jobs/tj"), client=bucket.client)).steps()
    last = max(r["step"] for _, r in first.events("commit"))
    assert len(steps) == 2 and steps[-1] == last, (steps, bucket.keys())

    second = run_job(kube, namespace, "second", checkpoint, tmp_path / "second", epochs=2)
    starts = second.starts(second.generations()[0])
    assert {r["step"] for r in starts.values()} == {last}, "resumed from the bucket"
    assert {r["hash"] for r in starts.values()} == {
        r["hash"] for _, r in first.events("commit") if r["step"] == last}
    done = [r for _, r in second.events("done")]
    assert len(done) == WORKERS
    assert {r["seen"] for r in done} == {2 * SAMPLES}, "each sample of both epochs once"
