"""What a real node creates on the host, piece by piece, and removing each piece:
processes, the node's mount namespace, its network namespace and link, its cgroups.

Every node runs in two namespaces of its own:

* a private mount namespace, held open by a ``sleep`` process, shared by its
  containerd and kubelet: the mounts they make (overlay root filesystems, volumes,
  pod network namespaces) never appear on the host, and the host paths they insist on
  are bound over with the node's folders (:meth:`NodeLayout.binds`);
* a network namespace for containerd (so the CNI bridge and the pods' links live
  there) joined to the host by a veth pair whose host end carries the node's address,
  and to the set's backbone namespace (one bridge) that routes between the nodes' pods;
  it rewrites the ``kubernetes`` Service's address to the API relay on the host.

The kubelet itself stays in the host's network namespace, where the API server is.
:mod:`.registry` records what was made and removes it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from ringwright.procstat import start_ticks

from .layout import (
    BACKBONE_LINK,
    BACKBONE_PREFIX_LEN,
    KUBELET_SYSCTLS,
    LINK_PREFIX,
    LINK_PREFIX_LEN,
    NAME_PREFIX,
    NodeLayout,
)

HOST_PATHS_MADE = ("/var/lib/cni", "/run/containerd")
"""Bind targets that may be missing on the host; created empty when they are."""


class HostError(RuntimeError):
    """A host resource of a real node could not be created."""


def run(argv: Sequence[str], stdin: str | None = None) -> None:
    """Run a command (``stdin`` its input); fail with its output."""
    done = subprocess.run(list(argv), capture_output=True, text=True, check=False,
                          input=stdin)
    if done.returncode != 0:
        raise HostError(f"{' '.join(argv)} failed: {(done.stderr or done.stdout).strip()}")


# -- processes -------------------------------------------------------------------------


@dataclass(frozen=True)
class Proc:
    """A process started for a node: which one (its role) and how to recognise it."""

    role: str
    node: str
    pid: int
    start: int

    def alive(self) -> bool:
        """Whether the process still runs (a zombie child of ours is reaped, not alive)."""
        if start_ticks(self.pid) != self.start:
            return False  # gone, or its pid taken by another process: never reap that one
        with contextlib.suppress(ChildProcessError):
            os.waitpid(self.pid, os.WNOHANG)
        return start_ticks(self.pid) == self.start

    def signal(self, sig: signal.Signals) -> None:
        if self.alive():
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)


def spawn(role: str, node: str, argv: Sequence[str], log: Path) -> Proc:
    """Start ``argv`` in a session of its own (it outlives its starter, as the control
    plane does), its output appended to ``log``."""
    log.parent.mkdir(parents=True, exist_ok=True)
    out: IO[bytes] = log.open("ab")
    try:
        proc = subprocess.Popen(list(argv), stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    finally:
        out.close()
    started = start_ticks(proc.pid)
    if started is None:
        raise HostError(f"{role} of {node} exited at once; see {log}")
    return Proc(role, node, proc.pid, started)


def stop(procs: Sequence[Proc], grace: float = 5.0) -> None:
    """SIGTERM, then SIGKILL whatever is still alive after ``grace`` seconds."""
    for p in procs:
        p.signal(signal.SIGTERM)
    deadline = time.monotonic() + grace
    while any(p.alive() for p in procs) and time.monotonic() < deadline:
        time.sleep(0.05)
    for p in procs:
        p.signal(signal.SIGKILL)
    deadline = time.monotonic() + grace
    while any(p.alive() for p in procs) and time.monotonic() < deadline:
        time.sleep(0.05)


def kill_pids(pids: Sequence[int]) -> None:
    """SIGKILL each of ``pids`` that still exists."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def pids_mentioning(text: str) -> list[int]:
    """Processes whose command line contains ``text`` (a path only our processes use)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(
                errors="replace")
        except OSError:
            continue
        if text in cmdline:
            found.append(int(entry.name))
    return found


def _wait_until(ready: Callable[[], bool], proc: Proc, log: Path, timeout: float,
                missed: Callable[[], str], every: float = 0.1) -> None:
    """Poll ``ready`` until it holds; fail when ``proc`` exits, or after ``timeout`` with
    ``missed()`` (what it did not do) and the tail of its log."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not proc.alive():
            raise HostError(f"{proc.role} of {proc.node} exited; last lines of {log}:\n"
                            f"{tail(log)}")
        if ready():
            return
        time.sleep(every)
    raise HostError(f"{proc.role} of {proc.node} {missed()} within {timeout:.0f}s; "
                    f"last lines of {log}:\n{tail(log)}")


def wait_for_socket(path: Path, proc: Proc, log: Path, timeout: float) -> None:
    """Wait until something accepts connections on unix socket ``path``."""

    def accepts() -> bool:
        with socket.socket(socket.AF_UNIX) as s:
            try:
                s.connect(str(path))
            except OSError:
                return False
            return True

    _wait_until(accepts, proc, log, timeout, lambda: f"did not listen on {path}")


CRI_VERSION = "/runtime.v1.RuntimeService/Version"
"""The CRI call a kubelet makes first (an empty request is a valid one)."""


def wait_for_cri(path: Path, proc: Proc, log: Path, timeout: float) -> None:
    """Wait until containerd's CRI service on unix socket ``path`` answers.

    The socket accepts connections before the CRI plugin has finished starting; a
    kubelet started then exits at once ("validate CRI v1 runtime API ... server is not
    initialized yet"), as a loaded machine showed."""
    import grpc  # the runtime's dependency: this module also serves the system Python

    last = [""]
    with grpc.insecure_channel(f"unix://{path}") as channel:
        version = channel.unary_unary(CRI_VERSION, request_serializer=_raw,
                                      response_deserializer=_raw)

        def answers() -> bool:
            try:
                version(b"", timeout=2.0)
            except grpc.RpcError as err:
                last[0] = str(err.details() if isinstance(err, grpc.Call) else err)
                return False
            return True

        _wait_until(answers, proc, log, timeout,
                    lambda: f"did not answer on its CRI socket {path} (last: {last[0]})",
                    every=0.2)


def _raw(data: bytes) -> bytes:
    return data


def tail(log: Path, lines: int = 30) -> str:
    """The last lines of a log file."""
    if not log.exists():
        return "(no log)"
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])


# -- the node's mount namespace --------------------------------------------------------


def start_mount_holder(layout: NodeLayout, log: Path, timeout: float = 10.0) -> Proc:
    """A process holding the node's new private mount namespace, with the node's
    binds made in it; containerd and the kubelet join it (:func:`in_node`)."""
    for src, dst in layout.binds():
        if dst.startswith("/proc/sys/"):
            src.parent.mkdir(parents=True, exist_ok=True)
            src.write_text(KUBELET_SYSCTLS[dst.removeprefix("/proc/sys/")] + "\n")
        else:
            src.mkdir(parents=True, exist_ok=True)
    for path in HOST_PATHS_MADE:
        os.makedirs(path, exist_ok=True)
    holder = spawn("mount-holder", layout.name,
                   ["unshare", "--mount", "--propagation", "private", "--",
                    "sleep", "infinity"], log)
    ours = os.readlink("/proc/self/ns/mnt")
    deadline = time.monotonic() + timeout
    while _mount_ns(holder.pid) in (ours, None) or _comm(holder.pid) != "sleep":
        if not holder.alive() or time.monotonic() > deadline:
            stop([holder])
            raise HostError(f"unshare did not make a mount namespace for {layout.name}; "
                            f"see {log}:\n{tail(log)}")
        time.sleep(0.02)
    for src, dst in layout.binds():
        run(["nsenter", f"--mount=/proc/{holder.pid}/ns/mnt", "--",
             "mount", "--bind", str(src), dst])
    return holder


def _mount_ns(pid: int) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/ns/mnt")
    except OSError:
        return None


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def in_node(holder: Proc, argv: Sequence[str], netns: str | None = None) -> list[str]:
    """``argv`` run in the node's mount namespace (and network namespace ``netns``)."""
    net = [f"--net=/run/netns/{netns}"] if netns else []
    return ["nsenter", f"--mount=/proc/{holder.pid}/ns/mnt", *net, "--", *argv]


def mounts_under(folder: Path) -> list[str]:
    """Mount points at or below ``folder`` in the host's mount namespace."""
    prefix = str(folder.resolve())
    points = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            point = line.split()[4].encode().decode("unicode_escape")
            if point == prefix or point.startswith(prefix + "/"):
                points.append(point)
    return points


# -- the node's network ----------------------------------------------------------------


BACKBONE_BRIDGE = "br0"


def create_backbone(netns: str) -> None:
    """The set's backbone: a namespace holding one bridge, which every node's namespace
    joins (:func:`create_network`)."""
    run(["ip", "netns", "add", netns])
    for argv in (
        ["ip", "-n", netns, "link", "set", "lo", "up"],
        ["ip", "-n", netns, "link", "add", BACKBONE_BRIDGE, "type", "bridge"],
        ["ip", "-n", netns, "link", "set", BACKBONE_BRIDGE, "up"],
    ):
        run(argv)


def create_network(layout: NodeLayout) -> None:
    """The node's namespace, its link to the host, the route to its pods and its link to
    the set's backbone (:func:`create_backbone` first); it forwards between its pods,
    the host and the backbone."""
    ns, link, backbone = layout.netns, layout.host_link, layout.backbone_netns
    run(["ip", "netns", "add", ns])
    for argv in (
        ["ip", "link", "add", link, "type", "veth", "peer", "name", "eth0", "netns", ns],
        ["ip", "addr", "add", f"{layout.node_ip}/{LINK_PREFIX_LEN}", "dev", link],
        ["ip", "link", "set", link, "up"],
        ["ip", "-n", ns, "link", "set", "lo", "up"],
        ["ip", "-n", ns, "addr", "add", f"{layout.peer_ip}/{LINK_PREFIX_LEN}", "dev", "eth0"],
        ["ip", "-n", ns, "link", "set", "eth0", "up"],
        ["ip", "route", "add", layout.pod_cidr, "via", layout.peer_ip, "dev", link],
        ["ip", "-n", ns, "link", "add", BACKBONE_LINK, "type", "veth", "peer", "name",
         layout.backbone_port, "netns", backbone],
        ["ip", "-n", backbone, "link", "set", layout.backbone_port, "master",
         BACKBONE_BRIDGE],
        ["ip", "-n", backbone, "link", "set", layout.backbone_port, "up"],
        ["ip", "-n", ns, "addr", "add", f"{layout.backbone_ip}/{BACKBONE_PREFIX_LEN}",
         "dev", BACKBONE_LINK],
        ["ip", "-n", ns, "link", "set", BACKBONE_LINK, "up"],
        # The namespace's own setting (a new namespace does not forward).
        ["ip", "netns", "exec", ns, "sh", "-c", "echo 1 > /proc/sys/net/ipv4/ip_forward"],
    ):
        run(argv)


def route_between(nodes: Sequence[NodeLayout]) -> None:
    """Each node's namespace routes the other nodes' pods over the backbone."""
    for node in nodes:
        for other in nodes:
            if other is not node:
                run(["ip", "-n", node.netns, "route", "add", other.pod_cidr, "via",
                     other.backbone_ip, "dev", BACKBONE_LINK])


NAT_TABLE = "ringwright"


def expose_api(layout: NodeLayout, service: tuple[str, int], relay: tuple[str, int]) -> None:
    """In the node's namespace, send the pods' connections to the ``kubernetes``
    Service (``service``: its cluster IP and port) to ``relay`` on the host (what
    kube-proxy would program; :mod:`.apiproxy` listens there)."""
    (ip, port), (to_ip, to_port) = service, relay
    run(["ip", "netns", "exec", layout.netns, "nft", "-f", "-"], stdin=(
        f"table ip {NAT_TABLE} {{\n"
        "  chain prerouting {\n"
        "    type nat hook prerouting priority dstnat; policy accept;\n"
        f"    ip daddr {ip} tcp dport {port} dnat to {to_ip}:{to_port}\n"
        "  }\n"
        "}\n"))


def wait_for_port(address: tuple[str, int], proc: Proc, log: Path, timeout: float) -> None:
    """Wait until something accepts TCP connections at ``address``."""

    def accepts() -> bool:
        with contextlib.suppress(OSError), socket.create_connection(address, timeout=1):
            return True
        return False

    _wait_until(accepts, proc, log, timeout,
                lambda: f"did not listen on {address[0]}:{address[1]}")


def network_namespaces() -> list[str]:
    """Every real node's network namespace on the machine (any cluster)."""
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True,
                         check=False).stdout
    return [line.split()[0] for line in out.splitlines()
            if line.strip() and line.split()[0].startswith(NAME_PREFIX)]


def host_links() -> list[str]:
    """Every real node's host-side link on the machine (any cluster)."""
    out = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True,
                         check=False).stdout
    names = [line.split(":")[1].strip().split("@")[0] for line in out.splitlines()
             if line.count(":") >= 2]
    return [n for n in names if n.startswith(LINK_PREFIX) and not n.startswith(NAME_PREFIX)]


def remove_network(netns: str, link: str) -> None:
    """Delete a node's namespace (after killing what still runs in it) and its link."""
    if netns in network_namespaces():
        pids = subprocess.run(["ip", "netns", "pids", netns], capture_output=True,
                              text=True, check=False).stdout.split()
        kill_pids([int(p) for p in pids if p.isdigit()])
        subprocess.run(["ip", "netns", "delete", netns], capture_output=True, check=False)
    if link in host_links():
        subprocess.run(["ip", "link", "delete", link], capture_output=True, check=False)


# -- cgroups ---------------------------------------------------------------------------


def cgroup_hierarchies() -> list[Path]:
    """Mount points of every cgroup hierarchy (v1 controllers, and v2 where mounted)."""
    points = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            fstype = fields[fields.index("-") + 1]
            if fstype in ("cgroup", "cgroup2"):
                points.append(Path(fields[4]))
    return points


def create_cgroup(name: str) -> None:
    """The kubelet's cgroup root ``name`` in every hierarchy (it must exist first)."""
    for root in cgroup_hierarchies():
        path = root / name.lstrip("/")
        path.mkdir(exist_ok=True)
        # A new v1 cpuset has no CPUs or memory nodes; nothing could run in it.
        for knob in ("cpuset.cpus", "cpuset.mems"):
            if (path / knob).exists() and not (path / knob).read_text().strip():
                (path / knob).write_text((root / knob).read_text())


def cgroup_pids(name: str) -> list[int]:
    """Every process in cgroup ``name`` or below it, in any hierarchy."""
    pids: set[int] = set()
    for root in cgroup_hierarchies():
        top = root / name.lstrip("/")
        if not top.is_dir():
            continue
        for folder, _, _ in os.walk(top):
            with contextlib.suppress(OSError):
                pids.update(int(p) for p in (Path(folder) / "cgroup.procs").read_text().split())
    return sorted(pids)


def remove_cgroup(name: str, timeout: float = 10.0) -> None:
    """Kill every process in cgroup ``name`` and remove it, deepest folder first."""
    deadline = time.monotonic() + timeout
    while (pids := cgroup_pids(name)) and time.monotonic() < deadline:
        kill_pids(pids)
        time.sleep(0.05)
    for root in cgroup_hierarchies():
        top = root / name.lstrip("/")
        while top.is_dir():
            for folder, _, _ in os.walk(top, topdown=False):
                with contextlib.suppress(OSError):
                    os.rmdir(folder)
            if not top.is_dir() or time.monotonic() > deadline:
                break
            # A cgroup whose last task just died stays busy for a moment.
            time.sleep(0.05)


def cgroups_named(prefix: str) -> list[str]:
    """Top-level cgroups whose name starts with ``prefix``, in any hierarchy."""
    names: set[str] = set()
    for root in cgroup_hierarchies():
        with contextlib.suppress(OSError):
            names.update(p.name for p in root.iterdir() if p.is_dir()
                         and p.name.startswith(prefix))
    return sorted(names)
