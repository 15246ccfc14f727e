"""What a real node is called, where its files live and which addresses it has.

Several clusters on one machine may run real nodes at once (one per concurrent test
run), and every node adds a link, an address, a route, a network namespace and cgroups
to the host. A set of real nodes therefore takes a *slot* that no other live set holds
(:mod:`.host` hands them out), and every name and address derives from the slot and the
node's index in its set. Everything here is pure.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ..inventory import GPU_MODEL_LABEL, NVLINK_LABEL, RACK_LABEL

NAME_PREFIX = "rwnode-"
"""Every network namespace and cgroup of a real node starts with this."""
LINK_PREFIX = "rwnode"
"""The host end of every node's link starts with this (interface names: 15 characters)."""
SLOTS = 32
NODES_PER_SLOT = 8

REAL_NODE_LABEL = "ringwright.dev/real-node"
"""Label (value "true") and NoSchedule taint key of every real node: only pods that
tolerate it land there, so the cluster's other tests never meet a real kubelet."""

LINK_PREFIX_LEN = 30
"""The node's link is a /30: its address on the host end, its namespace's on the other."""

BACKBONE_PREFIX_LEN = 25
"""The set's backbone: one bridge in a namespace of its own, every node's namespace on
it at ``10.214.<slot>.<128 + index>/25`` (above the links' /30s in the slot's /24)."""
BACKBONE_LINK = "rt0"
"""The node's end of its link to the backbone (in the node's namespace)."""
API_PROXY_PORT = 6443
"""Where the API server's proxy listens on each node's address (host side)."""

SOCKET_PATH_MAX = 107
"""Longest path a unix socket may have (``sun_path`` holds 108 bytes with its NUL)."""

KUBELET_SYSCTLS = {
    "vm/overcommit_memory": "1",
    "vm/panic_on_oom": "0",
    "kernel/panic": "10",
    "kernel/panic_on_oops": "1",
    "kernel/keys/root_maxkeys": "1000000",
    "kernel/keys/root_maxbytes": "25000000",
}
"""The kernel settings a kubelet insists on: it rewrites any that differ, machine-wide
and for good (or refuses to start, with protectKernelDefaults). A real node's kubelet
sees these values in its own mount namespace instead, so the host keeps its own."""


@dataclass(frozen=True)
class RealNodeSpec:
    """One real node: its name and the topology labels a KWOK node of the inventory has."""

    name: str
    rack: str = "rack-real"
    nvlink_domain: str = ""
    """NVLink domain label; empty: ``<rack>-nvl-0``, as the inventory names them."""
    gpu_model: str = "NVIDIA-H100-80GB-HBM3"
    gpus: int = 8
    """``nvidia.com/gpu`` patched onto the node's capacity (no device plugin here)."""

    def labels(self) -> dict[str, str]:
        """The node's labels (the kubelet adds hostname, os and arch itself)."""
        return {
            REAL_NODE_LABEL: "true",
            RACK_LABEL: self.rack,
            NVLINK_LABEL: self.nvlink_domain or f"{self.rack}-nvl-0",
            GPU_MODEL_LABEL: self.gpu_model,
        }


@dataclass(frozen=True)
class NodeLayout:
    """Names, addresses and folders of node ``index`` of the set in ``slot``."""

    spec: RealNodeSpec
    slot: int
    index: int
    dir: Path
    """The node's own folder (containerd's and the kubelet's state); removed with it."""

    def __post_init__(self) -> None:
        if not 0 <= self.slot < SLOTS or not 0 <= self.index < NODES_PER_SLOT:
            raise ValueError(f"slot {self.slot} / index {self.index} out of range "
                             f"({SLOTS} slots of {NODES_PER_SLOT} nodes)")
        if len(str(self.containerd_socket)) + len(".ttrpc") > SOCKET_PATH_MAX:
            raise ValueError(f"{self.dir} is too deep for a unix socket in it; put the "
                             "cluster's folder on a shorter path")

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def netns(self) -> str:
        """The node's network namespace: containerd, the CNI bridge and its pods' links."""
        return f"{NAME_PREFIX}s{self.slot}n{self.index}"

    @property
    def backbone_netns(self) -> str:
        """The set's backbone namespace: a bridge joining its nodes' namespaces, so each
        node routes to the others' pods without the host forwarding anything."""
        return backbone_netns(self.slot)

    @property
    def backbone_port(self) -> str:
        """The backbone's end of this node's link (a port of its bridge)."""
        return f"n{self.index}"

    @property
    def backbone_ip(self) -> str:
        """The node's namespace on the backbone: the other nodes route its pods here."""
        return f"10.214.{self.slot}.{128 + self.index}"

    @property
    def cgroup(self) -> str:
        """The kubelet's cgroup root (the same name in every hierarchy)."""
        return f"/{self.netns}"

    @property
    def host_link(self) -> str:
        """The host end of the veth pair into the node's namespace (``eth0`` there)."""
        return f"{LINK_PREFIX}{self.slot}-{self.index}"

    @property
    def node_ip(self) -> str:
        """The node's address, on the host end of its link: the kubelet serves there
        and the API server reaches it there (a kubelet refuses a loopback address)."""
        return f"10.214.{self.slot}.{4 * self.index + 1}"

    @property
    def peer_ip(self) -> str:
        """The namespace end of the link: containerd's streaming server (exec, attach)."""
        return f"10.214.{self.slot}.{4 * self.index + 2}"

    @property
    def pod_cidr(self) -> str:
        """The node's pods; routed from the host through the link, so probes reach them."""
        return f"10.215.{NODES_PER_SLOT * self.slot + self.index}.0/24"

    # -- folders and files ----------------------------------------------------------

    @property
    def containerd_config(self) -> Path:
        return self.dir / "containerd.toml"

    @property
    def containerd_socket(self) -> Path:
        return self.dir / "containerd.sock"

    @property
    def containerd_root(self) -> Path:
        return self.dir / "containerd" / "root"

    @property
    def containerd_state(self) -> Path:
        return self.dir / "containerd" / "state"

    @property
    def cni_conf_dir(self) -> Path:
        return self.dir / "cni" / "net.d"

    @property
    def ipam_dir(self) -> Path:
        return self.dir / "cni" / "ipam"

    @property
    def kubelet_root(self) -> Path:
        return self.dir / "kubelet"

    @property
    def kubelet_config(self) -> Path:
        return self.dir / "kubelet.yaml"

    def binds(self) -> list[tuple[Path, str]]:
        """(our folder or file, host path) pairs bound over each other in the node's
        private mount namespace: what containerd, CNI and the kubelet write to fixed
        host paths (shim sockets, CNI's result cache, pod logs) stays in the node's
        folder, and the kubelet reads :data:`KUBELET_SYSCTLS`."""
        binds = [
            (self.dir / "host" / "var-log", "/var/log"),
            (self.dir / "host" / "var-lib-cni", "/var/lib/cni"),
            (self.dir / "host" / "run-containerd", "/run/containerd"),
        ]
        binds += [(self.dir / "host" / "sysctl" / key.replace("/", "."), f"/proc/sys/{key}")
                  for key in KUBELET_SYSCTLS]
        return binds

    # -- the record a later teardown reads ------------------------------------------

    def to_record(self) -> dict[str, Any]:
        """A JSON-able form, enough to rebuild this layout (:meth:`from_record`)."""
        return {"spec": asdict(self.spec), "slot": self.slot, "index": self.index,
                "dir": str(self.dir)}

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> NodeLayout:
        return cls(spec=RealNodeSpec(**record["spec"]), slot=int(record["slot"]),
                   index=int(record["index"]), dir=Path(record["dir"]))


def backbone_netns(slot: int) -> str:
    """The backbone namespace of the set in ``slot``."""
    return f"{NAME_PREFIX}s{slot}b"


def layouts(specs: list[RealNodeSpec], slot: int, root: Path) -> list[NodeLayout]:
    """The layouts of a set of nodes in ``slot``, each in ``root/<name>``."""
    if not specs or len(specs) > NODES_PER_SLOT:
        raise ValueError(f"a set holds 1 to {NODES_PER_SLOT} real nodes, not {len(specs)}")
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise ValueError(f"real node names repeat: {names}")
    return [NodeLayout(spec, slot, i, root / spec.name) for i, spec in enumerate(specs)]
