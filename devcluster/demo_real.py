"""``make demo-real``: the demo of ``make demo`` on real kubelet nodes, as a user runs it.

1. start (or reuse) the local control plane; build the ``operator`` and ``training``
   images (or find them in the cache);
2. start two real nodes (kubelet + containerd + runc, :mod:`.realnode`) holding those
   images, made plain schedulable nodes while the KWOK nodes are cordoned;
3. ``helm install`` the chart: the operator runs from its image on the real nodes, two
   replicas electing a leader, the chart's defaults otherwise;
4. apply ``examples/trainingjob-demo.yaml`` with one overlay (``args: [--epochs, N]``,
   as a user's kustomization adds it: the example's 20 epochs end within a minute on
   CPU, before a deleted worker's replacement could rejoin);
5. ``kubectl delete pod`` one worker mid-training and show what ``make demo`` shows, read
   through the API: the world of 3, the replacement joining, training going on, the
   pods' and operator's logs merged, the metrics, and the recovery as measured here.
On the way out (also on a failure or Ctrl-C) the job and the release are removed, the
real nodes stopped and the KWOK nodes put back, so ``make demo`` runs on the cluster
again; ``python -m ringwright.devcluster down`` removes whatever an interrupted run left.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

from ringwright.kube import ApiError, KubeClient, api_path
from ringwright.objects import Obj
from ringwright.operator.api.base import API_VERSION
from ringwright.world import DEFAULT_METRICS_PORT

from . import images
from .buildah import ImageError
from .control_plane import Cluster, ClusterError
from .demo import NAMESPACE, DemoTimeout, Scenario, apply_job, drive, kubectl, say, wait
from .example import EXAMPLE, LONG_EPOCHS, example, with_epochs
from .helm import CHART, Helm, HelmError
from .inventory import describe
from .node.layout import RealNodeSpec
from .pki import SERVICE_IP, names_service_ip
from .podlogs import ApiLogs
from .realnode import (
    RealNodeError,
    missing_requirements,
    requirements_message,
    start_real_nodes,
    stop_real_nodes,
)
from .realnode_only import real_nodes_only
from .scrape import Scrape, scrape
from .timeline import LogLine
from .wheelhouse import WheelhouseError

ROOT = Path(__file__).resolve().parents[1]
NODES = (RealNodeSpec("real-rack-9-node-0", rack="rack-9", nvlink_domain="rack-9-nvl-0",
                      gpu_model="NVIDIA-A100-SXM4-40GB", gpus=4),
         RealNodeSpec("real-rack-9-node-1", rack="rack-9", nvlink_domain="rack-9-nvl-0",
                      gpu_model="NVIDIA-A100-SXM4-40GB", gpus=4))
"""The demo's real nodes: one rack, one GPU model, room for the example's 4 workers
and a replacement."""
RELEASE = "ringwright"
RELEASE_NAMESPACE = "ringwright-system"
"""As the README's ``helm install`` names them."""
OPERATOR_SELECTOR = "app.kubernetes.io/component=operator"
OPERATOR_METRICS_PORT = 9400
"""The chart's default ``metrics.port``."""
EXAMPLE_SAMPLES = 4096
"""Samples per data epoch of the example's script (its default ``--samples``)."""
QUICK_INSTALL = (("scheduling.k8s.io/v1", "priorityclasses", "ringwright-ps"),
                 ("scheduling.k8s.io/v1", "priorityclasses", "ringwright-worker"),
                 (API_VERSION, "schedulingpolicies", "default"))
"""What ``make demo`` applies without helm (:mod:`.install`) under the names the chart
creates: helm adopts no object it did not make, so these go before the install."""
SCENARIO = Scenario(samples=EXAMPLE_SAMPLES, hold_replacement=False, grace=None,
                    timeout=900.0, interval=1.0,
                    measured_on="measured on real nodes: kubelet, containerd, runc")
"""Real containers start in seconds, not at once: the world of 3 comes before the
replacement's without cordoning anything, so the recovery figure is the cluster's own.
The pod is deleted with its grace period, as ``kubectl delete pod`` does (the runtime
flushes a checkpoint on the kubelet's SIGTERM and exits 143)."""


@dataclass
class ApiPods:
    """The job's pods on real nodes: logs and addresses read through the API."""

    logs: ApiLogs

    def sync(self) -> None:
        """Nothing to do: the kubelets run the pods."""

    def lines(self) -> list[LogLine]:
        return self.logs.lines()

    def metrics_urls(self) -> dict[str, str]:
        return {pod: f"http://{ip}:{DEFAULT_METRICS_PORT}/metrics"
                for pod, ip in sorted(self.logs.pods().items()) if ip}


def helm_owned(obj: Obj, release: str) -> bool:
    """Whether ``obj`` belongs to helm release ``release`` (its labels and annotations)."""
    meta = obj.get("metadata") or {}
    return ((meta.get("labels") or {}).get("app.kubernetes.io/managed-by") == "Helm"
            and (meta.get("annotations") or {}).get("meta.helm.sh/release-name") == release)


def clear_quick_install(kube: KubeClient) -> list[str]:
    """Delete the objects of :data:`QUICK_INSTALL` that the release does not own; their
    names."""
    gone = []
    for version, plural, name in QUICK_INSTALL:
        path = api_path(version, plural, name=name)
        found = kube.get_or_none(path)
        if found is not None and not helm_owned(found, RELEASE):
            kube.delete(path)
            gone.append(f"{plural}/{name}")
    return gone


def operator_pods(kube: KubeClient) -> dict[str, str]:
    """The chart's operator pods and their addresses."""
    logs = ApiLogs(kube, RELEASE_NAMESPACE, OPERATOR_SELECTOR)
    return logs.pods()


def leader_metrics(kube: KubeClient) -> Scrape | None:
    """The metrics of the operator replica that acted (published the most worlds)."""
    got = [s for ip in operator_pods(kube).values() if ip
           if (s := scrape(f"http://{ip}:{OPERATOR_METRICS_PORT}/metrics")) is not None]
    key = "ringwright_operator_world_generations_published_total"
    return max(got, key=lambda s: s.get(key), default=None)


def install_chart(cluster: Cluster, kube: KubeClient, helm: Helm) -> None:
    """``helm install`` the chart with its defaults; returns once both replicas are Ready
    and one holds the Lease."""
    cleared = clear_quick_install(kube)
    if cleared:
        print(f"removed what make demo installed without helm: {', '.join(cleared)}")
    print(f"$ helm install {RELEASE} {CHART.relative_to(ROOT)} -n {RELEASE_NAMESPACE} "
          "--create-namespace --wait")
    # upgrade --install: a release an interrupted run left is taken over, not refused.
    helm.check("upgrade", "--install", RELEASE, str(CHART), "--namespace", RELEASE_NAMESPACE,
               "--create-namespace", "--wait", "--timeout", "10m", timeout=660)
    lease = api_path("coordination.k8s.io/v1", "leases", RELEASE_NAMESPACE,
                     "ringwright-operator")
    def leader() -> str | None:
        # The Lease outlives a release (the operator made it): only a holder that is
        # one of these replicas counts. Its identity starts with the pod's name.
        holder = str(((kube.get_or_none(lease) or {}).get("spec") or {})
                     .get("holderIdentity") or "")
        return next((pod for pod in operator_pods(kube) if holder.startswith(f"{pod}-")),
                    None)

    held = wait(leader, "an operator replica to take the Lease", timeout=300, interval=1.0)
    print(f"the operator's leader: {held}")
    kubectl(cluster, "-n", RELEASE_NAMESPACE, "get", "pods", "-o", "wide")


def remove_job(kube: KubeClient, name: str) -> None:
    """Delete the demo job while its operator still runs (it removes its finalizer)."""
    path = api_path(API_VERSION, "trainingjobs", NAMESPACE, name)
    if kube.delete(path, propagation="Foreground"):
        wait(lambda: kube.get_or_none(path) is None, "the demo job to go", timeout=180,
             interval=1.0)


def main(argv: list[str] | None = None) -> int:
    """Run the demo on real nodes end to end; returns a process exit code."""
    parser = argparse.ArgumentParser(prog="ringwright-demo-real", description=__doc__)
    parser.add_argument("--inventory", default="default")
    parser.add_argument("--epochs", type=int, default=LONG_EPOCHS,
                        help="the overlay's --epochs for the example's script")
    parser.add_argument("--png", type=Path, default=None,
                        help="where to write the timeline (default: in the demo's folder)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
    started = time.monotonic()
    missing = missing_requirements()
    if missing:
        print(f"demo-real: {requirements_message(missing)}", file=sys.stderr)
        return 1
    cluster = Cluster()
    try:
        say("local control plane (etcd, kube-apiserver, controller-manager, scheduler, KWOK)")
        if cluster.running() and not names_service_ip(cluster.dir / "pki"):
            print(f"the running cluster's API server certificate does not name {SERVICE_IP}, "
                  "where pods on real nodes reach it (an older checkout made it): "
                  "restarting the cluster with a new one")
            cluster.down()
        cluster.up(args.inventory)
        say("images: the Dockerfile's operator and training targets (built, or cached)")
        built = images.build(["operator", "training"])
        for image in built:
            print(f"  {image.target:<9} {image.archive} "
                  f"({'built' if image.built else 'cached'})")
        work = cluster.dir / "demo-real"
        work.mkdir(parents=True, exist_ok=True)
        helm = Helm.find(cluster.kubeconfig, work)
        if helm is None:
            raise HelmError("no helm binary: run `make binaries`")
        with cluster.client() as kube:
            run(cluster, kube, helm, [image.archive for image in built], args.epochs,
                args.png or work / "timeline.png")
    except (ApiError, ClusterError, DemoTimeout, HelmError, ImageError, RealNodeError,
            WheelhouseError) as err:
        print(f"demo-real: {err}", file=sys.stderr)
        return 1
    say(f"done in {time.monotonic() - started:.0f} s. The real nodes are gone and the KWOK "
        f"nodes back; the cluster keeps running: export KUBECONFIG={cluster.kubeconfig}; "
        "stop it with: python -m ringwright.devcluster down")
    return 0


def run(cluster: Cluster, kube: KubeClient, helm: Helm, archives: list[Path], epochs: int,
        png: Path) -> None:
    """Real nodes, the chart, the example and its failure; everything removed after,
    in the reverse order (a step of the removal that fails is reported, and the
    others still run)."""
    say(f"two real nodes: {', '.join(n.name for n in NODES)} (kubelet, containerd, runc)")
    stop_real_nodes(cluster.dir)  # what an interrupted run of this cluster left
    manifest = with_epochs(example(), epochs)
    with ExitStack() as undo:
        nodes = start_real_nodes(kube, cluster.dir, cluster.kubeconfig, NODES, images=archives)
        undo.callback(_removing, "the real nodes", lambda: nodes.stop(kube))
        kwok = undo.enter_context(real_nodes_only(kube, nodes.names))
        print(f"kubectl taint nodes {' '.join(nodes.names)} ringwright.dev/real-node-; "
              f"kubectl cordon the {len(kwok)} KWOK nodes")
        print(describe(kube.list(api_path("v1", "nodes"))))
        kubectl(cluster, "get", "nodes", "-L", "ringwright.dev/rack,nvidia.com/gpu.product")

        say(f"helm install {RELEASE}: the chart's operator from its image, on the real nodes")
        undo.callback(_removing, f"the release {RELEASE}", lambda: helm.check(
            "uninstall", RELEASE, "--namespace", RELEASE_NAMESPACE, "--wait", "--timeout",
            "5m", "--ignore-not-found", timeout=360))
        install_chart(cluster, kube, helm)

        undo.callback(_removing, "the demo job",
                      lambda: remove_job(kube, manifest["metadata"]["name"]))
        apply_job(kube, NAMESPACE, manifest,
                  f"kubectl apply -f {EXAMPLE.relative_to(ROOT)} with args: [--epochs, "
                  f"{epochs}] (the example's 20 epochs end before a replacement could rejoin)",
                  timeout=SCENARIO.timeout)
        drive(cluster, kube, ApiPods(ApiLogs(kube, NAMESPACE)), manifest, SCENARIO,
              namespace=NAMESPACE, png=png,
              operator_lines=ApiLogs(kube, RELEASE_NAMESPACE, OPERATOR_SELECTOR).lines,
              operator_metrics=lambda: leader_metrics(kube))
        say(f"timeline: {png}")
        say("removing the job, the release and the real nodes; the KWOK nodes back")


def _removing(what: str, remove: Callable[[], object]) -> None:
    """Run one step of the removal; a failure is reported, not raised, so the steps
    after it still run (``python -m ringwright.devcluster down`` removes the rest)."""
    try:
        remove()
    except (ApiError, DemoTimeout, HelmError, OSError) as err:
        print(f"demo-real: could not remove {what}: {err}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
