"""Operator throughput: a 256-worker TrainingJob against 256 pods created by a plain script.

Both run on one fresh local cluster with the large inventory (10 racks x 8 nodes x 8
GPUs), one after the other, in the same run:

* baseline: a script creates 256 one-GPU pods, one request after another, and waits
  until the scheduler bound them and KWOK made them Running;
* operator: ``python -m ringwright.operator`` with its default settings; the job is
  applied and timed until all 256 pods are Running (and until the job's status says
  Running, which needs the world published).

Prints both times, their ratio and the operator's peak RSS (VmHWM). Nothing asserts on
time.

    python tests/bench/bench_operator.py [--workers 256]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from ringwright.devcluster.control_plane import Cluster  # noqa: E402
from ringwright.devcluster.install import install_api  # noqa: E402
from ringwright.kube import KubeClient, api_path  # noqa: E402
from ringwright.operator.apibase import API_VERSION  # noqa: E402
from ringwright.operator.manifests import JOB_LABEL  # noqa: E402

WAIT_S = 900.0
IMAGE = "ringwright/training:dev"


def wait_until(what: str, probe: Callable[[], bool], interval: float = 0.25) -> float:
    """Poll ``probe``; return the wall time at which it first held."""
    deadline = time.monotonic() + WAIT_S
    while not probe():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(interval)
    return time.time()


def running(kube: KubeClient, namespace: str, selector: str) -> int:
    pods = kube.list(api_path("v1", "pods", namespace), labelSelector=selector,
                     fieldSelector="status.phase=Running")
    return len(pods)


def namespace(kube: KubeClient, name: str) -> str:
    kube.create(api_path("v1", "namespaces"),
                {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}})
    # Pods need the namespace's default ServiceAccount before they are admitted.
    wait_until(f"the default ServiceAccount in {name}", lambda: kube.get_or_none(
        api_path("v1", "serviceaccounts", name, "default")) is not None)
    return name


def baseline(kube: KubeClient, workers: int) -> float:
    """Seconds for a plain script to create ``workers`` one-GPU pods and see them Running."""
    ns = namespace(kube, "baseline")
    started = time.time()
    for i in range(workers):
        kube.create(api_path("v1", "pods", ns), {
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": f"plain-{i}", "labels": {"app": "plain"}},
            "spec": {"containers": [{"name": "train", "image": IMAGE, "resources": {
                "limits": {"nvidia.com/gpu": "1"}}}]},
        })
    done = wait_until("every plain pod Running", lambda: running(kube, ns, "app=plain") == workers)
    kube.delete(api_path("v1", "namespaces", name=ns))
    wait_until("the baseline namespace gone",
               lambda: kube.get_or_none(api_path("v1", "namespaces", name=ns)) is None)
    return done - started


def job_manifest(workers: int) -> dict[str, Any]:
    return {
        "apiVersion": API_VERSION, "kind": "TrainingJob", "metadata": {"name": "big"},
        "spec": {"gpusPerWorker": 1,
                 "workers": {"min": workers, "replicas": workers, "max": workers,
                             "template": {"spec": {"containers": [
                                 {"name": "train", "image": IMAGE}]}}}},
    }


def peak_rss_mib(pid: int) -> float:
    """The process's peak resident set size so far (VmHWM), in MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmHWM for pid {pid}")


def with_operator(cluster: Cluster, kube: KubeClient, workers: int,
                  log: Path) -> tuple[float, float, float]:
    """Seconds to all pods Running and to status Running, and the operator's peak RSS."""
    ns = namespace(kube, "jobs")
    env = {**os.environ, "KUBECONFIG": str(cluster.kubeconfig)}
    with log.open("wb") as out:
        op = subprocess.Popen([sys.executable, "-m", "ringwright.operator"], env=env,
                              stdout=out, stderr=subprocess.STDOUT, cwd="/")
    try:
        # Timed from the apply, once the operator has logged in and opened its watches.
        wait_until("the operator to log in", lambda: op.poll() is not None or
                   "Initial authentication has finished" in log.read_text(errors="replace"))
        if op.poll() is not None:
            raise RuntimeError(f"the operator exited:\n{log.read_text()[-3000:]}")
        time.sleep(2)
        started = time.time()
        kube.create(api_path(API_VERSION, "trainingjobs", ns), job_manifest(workers))
        pods_done = wait_until("every worker Running",
                               lambda: running(kube, ns, f"{JOB_LABEL}=big") == workers)
        status_done = wait_until("the job Running", lambda: (kube.get(
            api_path(API_VERSION, "trainingjobs", ns, "big")).get("status") or {}).get(
            "phase") == "Running")
        rss = peak_rss_mib(op.pid)
    finally:
        op.terminate()
        op.wait(timeout=30)
    return pods_done - started, status_done - started, rss


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=256)
    args = parser.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="ringwright-bench-operator-"))
    cluster = Cluster(name="bench-operator", root=work / "cluster")
    print(f"starting a cluster with the large inventory in {work} ...", flush=True)
    cluster.up(inventory="large")
    try:
        with cluster.client() as kube:
            install_api(kube)
            plain = baseline(kube, args.workers)
            pods, status, rss = with_operator(cluster, kube, args.workers, work / "operator.log")
    finally:
        cluster.down()
    n = args.workers
    print(f"\n{'':40} {'seconds':>8} {'ratio':>6}")
    print(f"{f'plain script, {n} pods -> Running':40} {plain:8.2f} {1.0:6.2f}")
    print(f"{f'TrainingJob, {n} workers -> pods Running':40} {pods:8.2f} {pods / plain:6.2f}")
    print(f"{f'TrainingJob, {n} workers -> job Running':40} {status:8.2f} {status / plain:6.2f}")
    print(f"operator peak RSS: {rss:.0f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
