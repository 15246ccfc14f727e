"""Real nodes in the local cluster: a kubelet and containerd per node, running real
containers (runc) beside the KWOK nodes.

:func:`start_real_nodes` starts a set of nodes against a running cluster and returns
once every node is Ready with its labels and its ``nvidia.com/gpu`` capacity (patched
onto the node's status: there is no device plugin); :meth:`RealNodeSet.stop` and
:func:`stop_real_nodes` remove them completely. KWOK manages only the nodes the
inventory creates (their ``kwok.x-k8s.io/node`` annotation), so it never touches a
real node; every real node carries the :data:`REAL_NODE_LABEL` label and a NoSchedule
taint of that key, so only pods that ask for one land there. No image can be pulled:
pods run the local image :func:`pause_image` names, with ``imagePullPolicy: Never``.

Needs root and the host packages :data:`APT_PACKAGES` names (``scripts/
install_host_packages.sh`` installs them); :func:`missing_requirements` says what is
missing. :mod:`ringwright.devcluster.node` holds the parts.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import signal
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import yaml

from ringwright.kube import ApiError, KubeClient, api_path
from ringwright.objects import Obj

from .build import ensure_binaries
from .inventory import GPU_RESOURCE
from .node import apiproxy, configs, host, image, image_store
from .node.layout import (
    API_PROXY_PORT,
    REAL_NODE_LABEL,
    NodeLayout,
    RealNodeSpec,
    backbone_netns,
    layouts,
)
from .node.registry import Registry, SetRecord
from .versions import cache_root

__all__ = [
    "APT_PACKAGES", "REAL_NODE_LABEL", "RealNodeError", "RealNodeSet", "RealNodeSpec",
    "container_pids", "crash_container", "missing_requirements", "node_ready", "pause_image",
    "requirements_message", "start_real_nodes", "stop_real_nodes", "sweep_stale_real_nodes",
]

log = logging.getLogger("ringwright.devcluster.realnode")

APT_PACKAGES = ("containerd", "runc", "containernetworking-plugins", "gcc", "libc6-dev",
                "iproute2", "util-linux", "mount", "nftables")
"""Debian/Ubuntu packages real nodes need (containerd 1.6+, runc, the CNI plugins, a
C compiler with a static libc for the local image, ip, nsenter/unshare, mount, nft)."""
COMMANDS = ("containerd", "containerd-shim-runc-v2", "ctr", "runc", "gcc", "ip", "nsenter",
            "unshare", "mount", "umount", "nft")
CNI_BIN_DIRS = (Path("/usr/lib/cni"), Path("/opt/cni/bin"))
"""Where Debian's and upstream's CNI plugin packages put the plugins."""


class RealNodeError(RuntimeError):
    """Real nodes could not be started here."""


def cni_bin_dir() -> Path | None:
    """The first folder holding every CNI plugin a node uses."""
    return next((d for d in CNI_BIN_DIRS
                 if all((d / p).is_file() for p in configs.CNI_PLUGINS)), None)


def missing_requirements() -> list[str]:
    """What this machine lacks to run real nodes (empty: nothing)."""
    missing = []
    if os.geteuid() != 0:
        missing.append("root (network namespaces, cgroups and mounts)")
    missing += [f"the `{c}` command" for c in COMMANDS if shutil.which(c) is None]
    if cni_bin_dir() is None:
        missing.append(f"the CNI plugins {', '.join(configs.CNI_PLUGINS)} in one of "
                       f"{', '.join(map(str, CNI_BIN_DIRS))}")
    if not host.cgroup_hierarchies():
        missing.append("a mounted cgroup hierarchy under /sys/fs/cgroup")
    if "overlay" not in Path("/proc/filesystems").read_text():
        missing.append("the kernel's overlay filesystem (modprobe overlay)")
    return missing


def requirements_message(missing: Sequence[str]) -> str:
    """What is missing and how to install it."""
    return (f"real nodes cannot run here; missing: {'; '.join(missing)}. On Debian or "
            f"Ubuntu, as root: apt-get update && apt-get install -y "
            f"{' '.join(APT_PACKAGES)} (scripts/install_host_packages.sh does it)")


def pause_image() -> str:
    """The local image real nodes hold: sandbox image and test image at once (its
    ``/pause`` prints ``uid=... gid=...`` given ``id``, or echoes ``echo ...``)."""
    return image.image_ref()


def container_pids(pod: Obj, container: int = 0, proc: Path = Path("/proc")) -> list[int]:
    """The host's ids of the processes of ``pod``'s container number ``container``, on
    a real node of this machine (none before it runs): the runtime's container id names
    the process's cgroup. A test or a benchmark signals them to crash a container
    without touching its pod, as a fault inside it would."""
    statuses = (pod.get("status") or {}).get("containerStatuses") or []
    if len(statuses) <= container or not statuses[container].get("containerID"):
        return []
    container_id = str(statuses[container]["containerID"]).split("//")[-1]
    pids = []
    for entry in proc.iterdir():
        if entry.name.isdigit():
            try:
                if container_id in (entry / "cgroup").read_text():
                    pids.append(int(entry.name))
            except OSError:  # gone meanwhile
                continue
    return sorted(pids)


def crash_container(pod: Obj, container: int = 0, sig: int = signal.SIGKILL,
                    proc: Path = Path("/proc")) -> list[int]:
    """Signal every process of ``pod``'s container number ``container`` (a fault inside
    the container: the kubelet sees it exit and restarts it in the same pod); the ids
    signalled, none when the container does not run on this machine."""
    pids = container_pids(pod, container, proc)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):  # exited meanwhile
            os.kill(pid, sig)
    return pids


def _image_cache() -> Path:
    return cache_root() / "realnode"


@dataclass
class RealNodeSet:
    """A running set of real nodes; :meth:`stop` removes them."""

    record: SetRecord
    registry: Registry
    seeded: frozenset[Path] = frozenset()
    """The archives whose images the nodes started with."""

    @property
    def nodes(self) -> list[NodeLayout]:
        return self.record.layouts()

    @property
    def names(self) -> list[str]:
        return [n.name for n in self.nodes]

    def load_image(self, archive: Path) -> None:
        """Import the OCI archive ``archive`` into every node's containerd (no registry
        is reachable: pods of its image use ``imagePullPolicy: Never``), unless the
        nodes started with it."""
        if archive in self.seeded:
            return
        ctr = Path(shutil.which("ctr") or "ctr")
        for layout in self.nodes:
            image.import_image(ctr, layout.containerd_socket, archive)

    def stop(self, kube: KubeClient | None = None) -> None:
        """Stop every process and remove every host resource of the set (idempotent);
        with ``kube``, also delete its Node objects and the pods bound to them."""
        with self.registry.locked():
            self.registry.teardown(self.record)
        if kube is not None:
            _forget_nodes(kube, self.names)


def start_real_nodes(kube: KubeClient, cluster_dir: Path, kubeconfig: Path,
                     specs: Sequence[RealNodeSpec], *, kubelet: Path | None = None,
                     registry: Registry | None = None, timeout: float = 180.0,
                     images: Sequence[Path] = ()) -> RealNodeSet:
    """Start ``specs`` as real nodes of the cluster whose state folder is
    ``cluster_dir``, holding the images of the OCI archives ``images`` (besides the
    sandbox image) from the start; return once each is Ready with its labels and GPUs.

    Node objects left under the same names (an earlier run's) are deleted first, so the
    kubelets register afresh with their labels and taint. On failure, everything
    started is removed again and the error carries the failing component's log.
    """
    missing = missing_requirements()
    if missing:
        raise RealNodeError(requirements_message(missing))
    cni_dir = cni_bin_dir()
    assert cni_dir is not None
    kubelet = kubelet or ensure_binaries(("kubelet",))["kubelet"]
    ref, archive = image.ensure_archive(_image_cache())
    containerd, ctr = (Path(shutil.which(c) or c) for c in ("containerd", "ctr"))
    store = image_store.ensure_store([archive, *images], _image_cache(),
                                     containerd=containerd, ctr=ctr)
    registry = registry or Registry()
    with registry.locked():
        record = registry.claim(cluster_dir.resolve())
        record.nodes = [n.to_record() for n in layouts(
            list(specs), record.slot, cluster_dir.resolve() / "realnodes")]
        registry.save(record)
    nodes = RealNodeSet(record, registry, frozenset(images))
    _forget_nodes(kube, nodes.names)
    try:
        service = _api_service(kube)
        api_server = _api_server(kubeconfig)
        host.create_backbone(backbone_netns(record.slot))
        for layout in nodes.nodes:
            _start_node(layout, record, registry, cluster_dir / "logs", kubelet=kubelet,
                        kubeconfig=kubeconfig, sandbox_image=ref, store=store,
                        cni_dir=cni_dir, service=service, api_server=api_server)
        host.route_between(nodes.nodes)
        _wait_ready(kube, nodes, cluster_dir / "logs", timeout)
        for layout in nodes.nodes:
            quantity = str(layout.spec.gpus)
            kube.merge_patch(api_path("v1", "nodes", name=layout.name, subresource="status"),
                             {"status": {"capacity": {GPU_RESOURCE: quantity},
                                         "allocatable": {GPU_RESOURCE: quantity}}})
    except BaseException:
        nodes.stop(kube)
        raise
    log.info("real nodes up: %s (slot %d)", ", ".join(nodes.names), record.slot)
    return nodes


def stop_real_nodes(cluster_dir: Path, registry: Registry | None = None) -> None:
    """Remove every set of real nodes of the cluster in ``cluster_dir`` (host side
    only: the cluster may be gone). Nothing to do where none ever ran."""
    registry = registry or Registry()
    if not _usable(registry):
        return
    with registry.locked():
        for record in registry.records():
            if Path(record.cluster_dir) == cluster_dir.resolve():
                registry.teardown(record)


def sweep_stale_real_nodes(registry: Registry | None = None) -> list[int]:
    """Remove every set of real nodes on this machine whose starter is gone (a crashed
    or killed run), whichever cluster it belonged to; the slots freed."""
    registry = registry or Registry()
    if not _usable(registry):
        return []
    with registry.locked():
        return registry.sweep()


def _usable(registry: Registry) -> bool:
    """Whether sets may be recorded there: none ever ran on the machine when the folder
    is missing, and only root (who made it) may change them."""
    return registry.folder.is_dir() and os.access(registry.folder, os.W_OK)


def _api_service(kube: KubeClient) -> tuple[str, int]:
    """The ``kubernetes`` Service's cluster IP and port: what in-cluster clients dial."""
    spec = kube.get(api_path("v1", "services", "default", "kubernetes"))["spec"]
    return spec["clusterIP"], int(spec["ports"][0]["port"])


def _api_server(kubeconfig: Path) -> tuple[str, int]:
    """The API server's address in ``kubeconfig`` (on loopback here)."""
    doc = yaml.safe_load(kubeconfig.read_text())
    url = urlsplit(doc["clusters"][0]["cluster"]["server"])
    assert url.hostname is not None and url.port is not None, url
    return url.hostname, url.port


def _start_node(layout: NodeLayout, record: SetRecord, registry: Registry, logs: Path, *,
                kubelet: Path, kubeconfig: Path, sandbox_image: str, store: Path,
                cni_dir: Path, service: tuple[str, int], api_server: tuple[str, int]
                ) -> None:
    """Create one node's network, cgroup and mount namespace; start its API relay and
    containerd on a root seeded with the images of ``store``, then start its kubelet."""
    shutil.rmtree(layout.dir, ignore_errors=True)
    for folder in (layout.containerd_root, layout.containerd_state, layout.cni_conf_dir,
                   layout.ipam_dir, layout.kubelet_root):
        folder.mkdir(parents=True)
    runc, containerd = (Path(shutil.which(c) or c) for c in ("runc", "containerd"))
    layout.containerd_config.write_text(configs.containerd_config(
        layout, sandbox_image=sandbox_image, cni_bin_dir=cni_dir, runc=runc))
    (layout.cni_conf_dir / "10-realnode.conflist").write_text(
        json.dumps(configs.cni_config(layout), indent=1))
    layout.kubelet_config.write_text(yaml.safe_dump(configs.kubelet_config(layout)))
    host.create_network(layout)
    host.create_cgroup(layout.cgroup)
    image_store.seed_root(store, layout.containerd_root)

    def started(proc: host.Proc) -> host.Proc:
        record.processes.append(proc)
        registry.save(record)
        return proc

    relay = (layout.node_ip, API_PROXY_PORT)
    relay_log = logs / f"realnode-{layout.name}-api-proxy.log"
    proxy = started(host.spawn(
        "api-proxy", layout.name,
        [sys.executable, str(Path(apiproxy.__file__)), f"{relay[0]}:{relay[1]}",
         f"{api_server[0]}:{api_server[1]}"], relay_log))
    host.wait_for_port(relay, proxy, relay_log, timeout=30)
    host.expose_api(layout, service, relay)
    holder = started(host.start_mount_holder(layout, logs / f"realnode-{layout.name}.log"))
    containerd_log = logs / f"realnode-{layout.name}-containerd.log"
    daemon = started(host.spawn(
        "containerd", layout.name,
        host.in_node(holder, [str(containerd), "--config", str(layout.containerd_config)],
                     netns=layout.netns), containerd_log))
    host.wait_for_cri(layout.containerd_socket, daemon, containerd_log, timeout=60)
    started(host.spawn("kubelet", layout.name,
                       host.in_node(holder, configs.kubelet_argv(layout, kubelet, kubeconfig)),
                       logs / f"realnode-{layout.name}-kubelet.log"))


def node_ready(node: Obj) -> bool:
    """Whether ``node`` reports Ready=True."""
    conditions = (node.get("status") or {}).get("conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


def _wait_ready(kube: KubeClient, nodes: RealNodeSet, logs: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    waiting = set(nodes.names)
    while waiting:
        for proc in nodes.record.processes:
            if proc.node in waiting and not proc.alive():
                name = f"realnode-{proc.node}-{proc.role}.log"
                raise RealNodeError(f"the {proc.role} of real node {proc.node} exited; last "
                                    f"lines of {logs / name}:\n{host.tail(logs / name)}")
        for name in sorted(waiting):
            node = kube.get_or_none(api_path("v1", "nodes", name=name))
            if node is not None and node_ready(node):
                waiting.discard(name)
        if waiting and time.monotonic() > deadline:
            name = sorted(waiting)[0]
            kubelet_log = logs / f"realnode-{name}-kubelet.log"
            raise RealNodeError(f"real node {name} not Ready after {timeout:.0f}s; last "
                                f"lines of {kubelet_log}:\n{host.tail(kubelet_log)}")
        time.sleep(0.5)


def _forget_nodes(kube: KubeClient, names: Sequence[str]) -> None:
    """Delete the Node objects ``names`` and every pod bound to them, at once (no
    kubelet is left to confirm a graceful deletion)."""
    for name in names:
        try:
            for pod in kube.list(api_path("v1", "pods"), fieldSelector=f"spec.nodeName={name}"):
                meta = pod["metadata"]
                kube.delete(api_path("v1", "pods", meta["namespace"], meta["name"]), grace=0)
            kube.delete(api_path("v1", "nodes", name=name))
        except (ApiError, OSError) as err:
            log.warning("could not delete real node %s from the cluster: %s", name, err)
