"""The configuration of a real node's containerd, CNI network and kubelet (pure)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .layout import REAL_NODE_LABEL, NodeLayout

KUBELET_PORT = 10250
KUBELET_HEALTHZ_PORT = 10248
CNI_PLUGINS = ("bridge", "host-local", "loopback")
"""The CNI plugins a node's network uses (containerd adds ``loopback`` on its own)."""

_UNUSED_CONTAINERD_PLUGINS = (
    # /opt/containerd would be created on the host; the snapshotters are not used.
    "io.containerd.internal.v1.opt",
    "io.containerd.snapshotter.v1.aufs",
    "io.containerd.snapshotter.v1.btrfs",
    "io.containerd.snapshotter.v1.devmapper",
    "io.containerd.snapshotter.v1.zfs",
)


def _toml(value: str | bool | list[str]) -> str:
    # JSON's string and list forms are valid TOML for the plain values used here.
    return json.dumps(value)


def containerd_config(layout: NodeLayout, *, sandbox_image: str, cni_bin_dir: Path,
                      runc: Path) -> str:
    """containerd's config (version 2; every omitted setting keeps its default)."""
    sock = str(layout.containerd_socket)
    cri = 'plugins."io.containerd.grpc.v1.cri"'
    lines = [
        "version = 2",
        f"root = {_toml(str(layout.containerd_root))}",
        f"state = {_toml(str(layout.containerd_state))}",
        f"disabled_plugins = {_toml(list(_UNUSED_CONTAINERD_PLUGINS))}",
        "[grpc]",
        f"  address = {_toml(sock)}",
        "[ttrpc]",
        f"  address = {_toml(sock + '.ttrpc')}",
        f"[{cri}]",
        f"  sandbox_image = {_toml(sandbox_image)}",
        # Lowering a container's OOM score needs CAP_SYS_RESOURCE, which this host's
        # root may lack: keep every score at or above containerd's own.
        "  restrict_oom_score_adj = true",
        # Loading the AppArmor profile would change the host's kernel state.
        "  disable_apparmor = true",
        # Pod network namespaces are bind-mounted under the state folder, not /run/netns.
        "  netns_mounts_under_state_dir = true",
        # Exec and attach streams: the kubelet, in the host's namespace, reaches this
        # address over the node's link (port 0: any free one, in the URL it hands out).
        f"  stream_server_address = {_toml(layout.peer_ip)}",
        '  stream_server_port = "0"',
        f"[{cri}.cni]",
        f"  bin_dir = {_toml(str(cni_bin_dir))}",
        f"  conf_dir = {_toml(str(layout.cni_conf_dir))}",
        f"[{cri}.containerd]",
        '  snapshotter = "overlayfs"',
        '  default_runtime_name = "runc"',
        f"[{cri}.containerd.runtimes.runc]",
        '  runtime_type = "io.containerd.runc.v2"',
        f"[{cri}.containerd.runtimes.runc.options]",
        f"  BinaryName = {_toml(str(runc))}",
        "  SystemdCgroup = false",
    ]
    return "\n".join(lines) + "\n"


def cni_config(layout: NodeLayout) -> dict[str, Any]:
    """A bridge network inside the node's namespace; pods take addresses from the node's
    pod CIDR and route through the bridge, which routes to the host over the link."""
    return {
        "cniVersion": "1.0.0",
        "name": "realnode",
        "plugins": [{
            "type": "bridge",
            "bridge": "cni0",
            "isGateway": True,
            # No NAT: nothing leaves the node's namespace but replies to the host.
            "ipMasq": False,
            "ipam": {
                "type": "host-local",
                "ranges": [[{"subnet": layout.pod_cidr}]],
                "routes": [{"dst": "0.0.0.0/0"}],
                "dataDir": str(layout.ipam_dir),
            },
        }],
    }


def kubelet_config(layout: NodeLayout) -> dict[str, Any]:
    """The kubelet's KubeletConfiguration."""
    return {
        "apiVersion": "kubelet.config.k8s.io/v1beta1",
        "kind": "KubeletConfiguration",
        # Every port on the node's own address, so nodes (and clusters) never collide.
        "address": layout.node_ip,
        "port": KUBELET_PORT,
        "readOnlyPort": 0,
        "healthzBindAddress": layout.node_ip,
        "healthzPort": KUBELET_HEALTHZ_PORT,
        # The API server presents no client certificate; the node's address exists only
        # on this host, where every process is root anyway.
        "authentication": {"anonymous": {"enabled": True}, "webhook": {"enabled": False}},
        "authorization": {"mode": "AlwaysAllow"},
        "containerRuntimeEndpoint": f"unix://{layout.containerd_socket}",
        "cgroupDriver": "cgroupfs",
        "cgroupRoot": layout.cgroup,
        # This host mounts cgroups v1 (hybrid) and has no swap accounting to offer.
        "failCgroupV1": False,
        "failSwapOn": False,
        # No iptables chains in the host's namespace.
        "makeIPTablesUtilChains": False,
        # Images are built locally and cannot be pulled again: never collect them, and
        # evict nothing over a host disk that other work fills. Under disk pressure the
        # kubelet deletes every unused image, the sandbox image too, and the node can
        # start no pod after (seen when parallel runs imported 2.8 GB images at once):
        # absolute floors, far below the 1% (2.5 GB here) that was crossed then.
        "imageGCHighThresholdPercent": 100,
        "imageGCLowThresholdPercent": 99,
        "evictionHard": {"memory.available": "1Mi", "nodefs.available": "100Mi",
                         "nodefs.inodesFree": "1%", "imagefs.available": "100Mi",
                         "imagefs.inodesFree": "1%"},
        "registerWithTaints": [{"key": REAL_NODE_LABEL, "value": "true",
                                "effect": "NoSchedule"}],
        # Ready reaches the API within 5 s of the runtime being ready (default: 10 s).
        "nodeStatusUpdateFrequency": "5s",
        # Renewed every 5 s, well within the controller manager's 20 s grace (as KWOK's).
        "nodeLeaseDurationSeconds": 20,
    }


def kubelet_argv(layout: NodeLayout, kubelet: Path, kubeconfig: Path) -> list[str]:
    """The kubelet's command line (what its configuration file cannot hold)."""
    labels = ",".join(f"{k}={v}" for k, v in sorted(layout.spec.labels().items()))
    return [
        str(kubelet), f"--config={layout.kubelet_config}", f"--kubeconfig={kubeconfig}",
        f"--root-dir={layout.kubelet_root}", f"--hostname-override={layout.name}",
        f"--node-ip={layout.node_ip}", f"--node-labels={labels}", "--v=1",
    ]
