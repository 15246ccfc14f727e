"""``make demo``: a local cluster, the operator, and an elastic job that survives a failure.

1. start (or reuse) the local control plane and show the simulated datacenter;
2. install the CRDs and the default policy, start the operator;
3. apply a TrainingJob; real runtime processes stand in for its pods (127.x pod IPs);
4. show where each worker landed and the ring order;
5. delete one worker's pod mid-training and show the new epoch, the rebuilt ring, the
   rescaled learning rate, training continuing from the last commit, and the replacement
   joining again.
The cluster is left running (``python -m ringwright.devcluster down`` stops it).
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import yaml

from ringwright.devcluster.control_plane import Cluster
from ringwright.devcluster.install import install_api
from ringwright.devcluster.inventory import describe
from ringwright.devcluster.podhost import PodHost
from ringwright.kube import ApiError, KubeClient, api_path
from ringwright.operator.apibase import API_VERSION
from ringwright.world import World, parse_world, world_configmap_name

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "trainingjob-demo.yaml"
NAMESPACE = "demo"
PROGRESS = r" epoch_done "
"""The line rank 0 prints after every data epoch."""
T = TypeVar("T")


def say(text: str) -> None:
    print(f"\n==> {text}", flush=True)


def wait(probe: Callable[[], T | None], what: str, host: PodHost | None = None,
         timeout: float = 180.0) -> T:
    """Poll ``probe`` (keeping the pod host in step) until it answers."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if host is not None:
            host.sync()
        value = probe()
        if value:
            return value
        time.sleep(0.2)
    raise SystemExit(f"demo: timed out waiting for {what}")


def current_world(kube: KubeClient, name: str) -> World | None:
    cm = kube.get_or_none(api_path("v1", "configmaps", NAMESPACE, world_configmap_name(name)))
    text = ((cm or {}).get("data") or {}).get("world.json")
    return parse_world(text) if text else None


def show_world(world: World, edges: int) -> None:
    print(f"world epoch {world.epoch}: {world.size} workers, store at "
          f"{world.store.address}:{world.store.port}")
    print(f"  {'RANK':<5}{'POD':<22}{'IP':<16}{'RACK':<9}{'NVLINK':<14}{'NODE':<18}GPU")
    for m in world.members:
        print(f"  {m.rank:<5}{m.pod:<22}{m.ip:<16}{m.rack:<9}{m.nvlink_domain:<14}"
              f"{m.node:<18}{m.gpu_model}")
    print("  ring: " + " -> ".join(f"{m.rank}({m.rack})" for m in world.members)
          + f" -> 0   cross-rack edges: {edges}")


def kubectl(cluster: Cluster, *args: str) -> None:
    exe = shutil.which("kubectl")
    if exe is None:
        return
    print(f"$ kubectl {' '.join(args)}")
    subprocess.run([exe, "--kubeconfig", str(cluster.kubeconfig), *args], check=False)


def grep_logs(host: PodHost, pattern: str) -> list[str]:
    """Runtime log lines matching ``pattern`` from every pod's process log."""
    found = []
    for path in sorted(host.workdir.glob("*.log")):
        for line in path.read_text(errors="replace").splitlines():
            if re.search(pattern, line):
                found.append(f"{path.stem}: {line.strip()}")
    return found


def main(argv: list[str] | None = None) -> int:
    """Run the demo end to end; returns a process exit code."""
    parser = argparse.ArgumentParser(prog="ringwright-demo", description=__doc__)
    parser.add_argument("--inventory", default="default")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")

    cluster = Cluster()
    say("local control plane (etcd, kube-apiserver, controller-manager, scheduler, KWOK)")
    cluster.up(args.inventory)
    kube = cluster.client()
    print(describe(kube.list(api_path("v1", "nodes"))))
    kubectl(cluster, "get", "nodes", "-L", "ringwright.dev/rack,nvidia.com/gpu.product")

    say("installing CRDs, PriorityClasses and the default SchedulingPolicy")
    install_api(kube)
    work = cluster.dir / "demo"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    env = {**os.environ, "KUBECONFIG": str(cluster.kubeconfig),
           "RINGWRIGHT_SETTLE_SECONDS": "1", "RINGWRIGHT_DRAIN_SECONDS": "15",
           # Replace a lost pod only after the smaller world is out, so the demo shows
           # both steps: the ring shrinking and the replacement joining.
           "RINGWRIGHT_BACKOFF_BASE_SECONDS": "4"}
    operator_log = (work / "operator.log").open("ab")
    operator = subprocess.Popen([sys.executable, "-m", "ringwright.operator"], env=env,
                                stdout=operator_log, stderr=subprocess.STDOUT)
    print(f"operator pid {operator.pid}, log {work / 'operator.log'}")
    try:
        return run_job(cluster, kube, work)
    finally:
        operator.terminate()
        operator.wait(timeout=15)


def run_job(cluster: Cluster, kube: KubeClient, work: Path) -> int:
    """Apply the example job, show placement, inject a failure, show recovery."""
    manifest: dict[str, Any] = yaml.safe_load(EXAMPLE.read_text())
    name = manifest["metadata"]["name"]
    # The pods run on this machine: the job's checkpoint path is a folder of the demo's.
    manifest["spec"]["checkpoint"]["path"] = str(work / "checkpoints")
    if kube.get_or_none(api_path("v1", "namespaces", name=NAMESPACE)) is None:
        kube.create(api_path("v1", "namespaces"), {"metadata": {"name": NAMESPACE}})
    job_path = api_path(API_VERSION, "trainingjobs", NAMESPACE, name)
    if kube.delete(job_path, propagation="Foreground"):
        wait(lambda: kube.get_or_none(job_path) is None, "the previous demo job to go")
    say(f"kubectl apply -f {EXAMPLE.relative_to(ROOT)}")
    kube.create(api_path(API_VERSION, "trainingjobs", NAMESPACE), manifest)

    command = [sys.executable, str(ROOT / "examples" / "train_elastic.py"), "--epochs", "200",
               "--samples", "2048"]
    host = PodHost(kube, NAMESPACE, name, command, work / "pods", readiness_grace=60)
    try:
        world = wait(lambda: (w := current_world(kube, name)) is not None
                     and w.size == manifest["spec"]["workers"]["replicas"] and w,
                     "the first world", host)
        status = kube.get(job_path)["status"]
        say("placement: one GPU model, fewest racks, ring in rack order")
        show_world(world, status["world"]["crossRackEdges"])
        kubectl(cluster, "-n", NAMESPACE, "get", "tj")
        kubectl(cluster, "-n", NAMESPACE, "get", "pods", "-o", "wide")

        say("training: waiting for a few committed steps")
        wait(lambda: len(grep_logs(host, PROGRESS)) >= 2, "training progress", host)
        victim = world.members[-1].pod
        say(f"failure: kubectl delete pod {victim} (rank {world.members[-1].rank})")
        kube.delete(api_path("v1", "pods", NAMESPACE, victim), grace=0)
        shrunk = wait(lambda: (w := current_world(kube, name)) is not None
                      and w.epoch > world.epoch and w, "the next epoch", host)
        show_world(shrunk, kube.get(job_path)["status"]["world"]["crossRackEdges"])
        wait(lambda: grep_logs(host, rf" world_ready .*epoch={shrunk.epoch}\b"),
             "survivors to rebuild the ring", host)
        healed = wait(lambda: (w := current_world(kube, name)) is not None
                      and w.size == world.size and w.epoch >= shrunk.epoch and w,
                      "the replacement to join", host)
        say("the replacement joined; the ring is whole again")
        show_world(healed, kube.get(job_path)["status"]["world"]["crossRackEdges"])
        wait(lambda: grep_logs(host, rf" world_ready .*epoch={healed.epoch}\b"),
             "a rebuilt ring", host)
        for pattern in (r" rolled_back ", r" lr_rescale ", r" world_ready ", PROGRESS):
            for line in grep_logs(host, pattern)[-6:]:
                print("  " + line)
        kubectl(cluster, "-n", NAMESPACE, "describe", "tj", name)
    except ApiError as err:
        print(f"demo: API error: {err}", file=sys.stderr)
        return 1
    finally:
        host.close()
    say(f"done. The cluster keeps running: export KUBECONFIG={cluster.kubeconfig}; "
        "stop it with: python -m ringwright.devcluster down")
    return 0


if __name__ == "__main__":
    sys.exit(main())
