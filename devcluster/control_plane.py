"""Run etcd, kube-apiserver, kube-controller-manager, kube-scheduler and KWOK on loopback.

A cluster lives in a state folder (``<cache>/clusters/<name>``): its certificates,
etcd data, logs, kubeconfig and the process ids of its components. ``up`` is
idempotent (a running cluster is reused), ``down`` stops every component.
"""

from __future__ import annotations

import json
import logging
import random
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import yaml

from ringwright.kube import ApiError, KubeClient, RetryPolicy, api_path, load_kubeconfig
from ringwright.procstat import start_ticks

from .build import Binaries, ensure_binaries
from .inventory import KWOK_NODE_ANNOTATION, load_inventory, node_manifests
from .node.host import Proc, stop
from .pki import Pki, ensure_pki
from .realnode import stop_real_nodes
from .versions import CONTROL_PLANE, cache_root

log = logging.getLogger("ringwright.devcluster")

STAGES = Path(__file__).resolve().parent / "stages" / "kwok.yaml"
# Controllers that need a cloud or real networking are off. Node lifecycle is on: KWOK
# renews every node's Lease, so a node is lost only when a test takes it down (see
# NODE_DOWN_ANNOTATION), and then it is tainted and its pods evicted as on a real cluster.
CONTROLLERS = ",".join((
    "*", "-nodeipam", "-cloud-node-lifecycle", "-service-lb-controller",
    "-route", "-csrsigning", "-persistentvolume-binder", "-attachdetach", "-ttl",
    "-bootstrapsigner", "-tokencleaner",
))
NODE_LEASE_SECONDS = 20
"""KWOK's node Lease duration (renewed at a quarter of it, as a kubelet does); a node
whose Lease is not renewed this long is NotReady (Kubernetes' grace default: 50 s)."""
NODE_DOWN_ANNOTATION = "ringwright.dev/kwok-node-down"
"""A node carrying this annotation reports Ready=False (KWOK's node-down stage), as a node
whose kubelet lost its runtime would; removing it brings the node back."""


class ClusterError(RuntimeError):
    """The local cluster could not be started or reached."""


CONTROL_PLANE_NODE = "control-plane"
"""The node name the control plane's recorded processes carry (they run on no node)."""


EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
"""Where the kernel says which ports it gives the local ends of outgoing connections."""

LISTEN_PORTS_FROM = 20000
"""Lowest port :func:`free_port` hands out: above Kubernetes's own well-known ports
(the kubelet's 10248 and 10250, containerd's stream server's 10010, ...), which the real
nodes bind."""

_DRAW = random.SystemRandom().randrange


def free_port(ephemeral_range: Path = EPHEMERAL_RANGE,
              pick: Callable[[int, int], int] = _DRAW) -> int:
    """A TCP port free on 127.0.0.1 right now, for a server that binds it a little later.

    Drawn below the kernel's ephemeral range: a port from ``bind(0)`` is one the kernel
    may give the local end of any outgoing connection before the server binds it (seen:
    Kueue's health port taken while its CRDs were installed, with two clusters' clients
    busy), while a port below the range is only ever taken on purpose. Where the range
    leaves too little room below it, ``bind(0)`` it is.
    """
    try:
        low = int(ephemeral_range.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 0
    for _ in range(100 if low - LISTEN_PORTS_FROM >= 1000 else 0):
        port = pick(LISTEN_PORTS_FROM, low)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue  # in use: draw again
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        bound: int = s.getsockname()[1]
        return bound


@dataclass
class Cluster:
    """Handle on one local cluster's state folder."""

    name: str = "ringwright"
    root: Path | None = None
    node_lease_seconds: int = NODE_LEASE_SECONDS
    """KWOK's node Lease duration, and how long an unrenewed one takes to make its node
    NotReady. Scale benchmarks lengthen it: KWOK renews each node's Lease every quarter
    of it, 400 writes a second for 2,000 nodes at 20 s, more than two cores serve."""

    @property
    def dir(self) -> Path:
        return self.root or cache_root() / "clusters" / self.name

    @property
    def kubeconfig(self) -> Path:
        return self.dir / "kubeconfig"

    @property
    def _pids_file(self) -> Path:
        return self.dir / "pids.json"

    @property
    def _commands_file(self) -> Path:
        return self.dir / "commands.json"

    def client(self) -> KubeClient:
        return KubeClient(load_kubeconfig(self.kubeconfig))

    def _probe(self) -> KubeClient:
        """A client that answers at once: a probe is retried by its caller's loop."""
        return KubeClient(load_kubeconfig(self.kubeconfig), timeout=5,
                          retry=RetryPolicy(attempts=1))

    def _pids(self) -> dict[str, Proc]:
        """The recorded components, each with its start time: a recorded pid may belong
        to any other process by now (pids are reused within minutes on a busy machine,
        and the file outlives a reboot), and that one must never be signalled. An entry
        without a start time (written by an older version) matches no process."""
        if not self._pids_file.exists():
            return {}
        recorded: dict[str, int | list[int]] = json.loads(self._pids_file.read_text())
        return {name: Proc(name, CONTROL_PLANE_NODE, *(pid if isinstance(pid, list)
                                                         else (pid, -1)))
                for name, pid in recorded.items()}

    def running(self) -> bool:
        """True when every recorded component process is alive and the API answers."""
        pids = self._pids()
        if not pids or not all(p.alive() for p in pids.values()):
            return False
        try:
            with self._probe() as kube:
                kube.get("/readyz")
        except (ApiError, OSError, ValueError):
            return False
        return True

    def up(self, inventory: str = "default", binaries: Binaries | None = None,
           timeout: float = 120.0) -> None:
        """Start the cluster (or reuse a running one) and make sure its nodes exist."""
        if self.running():
            log.info("cluster %s already running (%s)", self.name, self.kubeconfig)
            self._ensure_nodes(inventory)
            return
        self.down()
        bins = binaries or ensure_binaries(CONTROL_PLANE)
        shutil.rmtree(self.dir / "etcd", ignore_errors=True)
        (self.dir / "logs").mkdir(parents=True, exist_ok=True)
        pki = ensure_pki(self.dir / "pki")
        ports = {"etcd": free_port(), "etcd-peer": free_port(), "apiserver": free_port(),
                 "kwok": free_port()}
        self._write_kubeconfig(pki, ports["apiserver"])
        pids: dict[str, Proc] = {}
        try:
            pids["etcd"] = self._spawn("etcd", self._etcd_cmd(bins, ports))
            self._save_pids(pids)
            pids["kube-apiserver"] = self._spawn(
                "kube-apiserver", self._apiserver_cmd(bins, pki, ports))
            self._save_pids(pids)
            self._wait("API server /readyz", timeout, self._api_ready, "kube-apiserver")
            for name, cmd in (
                ("kube-controller-manager", self._controller_manager_cmd(bins, pki)),
                ("kube-scheduler", self._scheduler_cmd(bins)),
                ("kwok", self._kwok_cmd(bins, ports)),
            ):
                pids[name] = self._spawn(name, cmd)
            self._save_pids(pids)
            self._wait("the default ServiceAccount", timeout, self._sa_ready,
                       "kube-controller-manager")
            self._ensure_nodes(inventory)
            self._wait("nodes Ready", timeout, self._nodes_ready, "kwok")
        except BaseException:
            self.down()
            raise
        log.info("cluster %s up: export KUBECONFIG=%s", self.name, self.kubeconfig)

    def down(self) -> None:
        """Stop every component (TERM, then KILL after a few seconds), real nodes first."""
        stop_real_nodes(self.dir)
        stop(list(self._pids().values()), grace=10)
        self._pids_file.unlink(missing_ok=True)
        self._commands_file.unlink(missing_ok=True)

    def restart(self, component: str, timeout: float = 60.0) -> None:
        """Kill one component without warning (SIGKILL) and start it again with the same
        command line, as a crashed control-plane process restarted by its supervisor
        would be; returns once the API server answers again.

        etcd keeps its data folder, so the cluster's state survives; clients see
        connection errors and 5xx answers meanwhile.
        """
        pids = self._pids()
        commands: dict[str, list[str]] = json.loads(self._commands_file.read_text())
        if component not in pids or component not in commands:
            raise ClusterError(f"no running component {component!r}: {sorted(pids)}")
        pids[component].signal(signal.SIGKILL)
        deadline = time.monotonic() + 10
        while pids[component].alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        pids[component] = self._spawn(component, commands[component])
        self._save_pids(pids)
        self._wait("API server /readyz", timeout, self._api_ready, component)
        log.info("restarted %s (pid %d)", component, pids[component].pid)

    # -- component command lines -------------------------------------------------

    def _etcd_cmd(self, bins: Binaries, ports: dict[str, int]) -> list[str]:
        client = f"http://127.0.0.1:{ports['etcd']}"
        peer = f"http://127.0.0.1:{ports['etcd-peer']}"
        return [
            str(bins["etcd"]), "--name=default", f"--data-dir={self.dir / 'etcd'}",
            f"--listen-client-urls={client}", f"--advertise-client-urls={client}",
            f"--listen-peer-urls={peer}", f"--initial-advertise-peer-urls={peer}",
            f"--initial-cluster=default={peer}",
            # A throwaway test store: durability is not worth the fsync latency.
            "--unsafe-no-fsync", "--quota-backend-bytes=4294967296",
            "--log-level=warn",
        ]

    def _apiserver_cmd(self, bins: Binaries, pki: Pki, ports: dict[str, int]) -> list[str]:
        return [
            str(bins["kube-apiserver"]),
            f"--etcd-servers=http://127.0.0.1:{ports['etcd']}",
            "--bind-address=127.0.0.1", "--advertise-address=127.0.0.1",
            f"--secure-port={ports['apiserver']}",
            f"--tls-cert-file={pki.serving_cert}", f"--tls-private-key-file={pki.serving_key}",
            f"--token-auth-file={pki.token_file}",
            "--authorization-mode=RBAC",
            "--service-account-issuer=https://kubernetes.default.svc",
            f"--service-account-key-file={pki.sa_pub}",
            f"--service-account-signing-key-file={pki.sa_key}",
            "--service-cluster-ip-range=10.96.0.0/16",
            # Endpoints may not hold loopback addresses; nothing here needs the
            # `kubernetes` Service's endpoints, so skip reconciling them.
            "--endpoint-reconciler-type=none",
            # Nodes would be created with a not-ready taint that only the (disabled)
            # node lifecycle controller removes; KWOK nodes are ready from the start.
            "--disable-admission-plugins=TaintNodesByCondition",
            "--allow-privileged=true", "--profiling=false",
            # A real node's kubelet (realnode.py) is reached at its address: its host
            # name resolves nowhere.
            "--kubelet-preferred-address-types=InternalIP,Hostname",
            f"--cert-dir={self.dir / 'pki'}",
        ]

    def _controller_manager_cmd(self, bins: Binaries, pki: Pki) -> list[str]:
        return [
            str(bins["kube-controller-manager"]), f"--kubeconfig={self.kubeconfig}",
            f"--service-account-private-key-file={pki.sa_key}",
            f"--root-ca-file={pki.ca_cert}", f"--controllers={CONTROLLERS}",
            "--leader-elect=false", "--secure-port=0",
            "--kube-api-qps=200", "--kube-api-burst=400",
            f"--node-monitor-grace-period={self.node_lease_seconds}s",
            "--node-monitor-period=1s",
        ]

    def _scheduler_cmd(self, bins: Binaries) -> list[str]:
        return [
            str(bins["kube-scheduler"]), f"--kubeconfig={self.kubeconfig}",
            "--leader-elect=false", "--secure-port=0",
            "--kube-api-qps=200", "--kube-api-burst=400",
        ]

    def _kwok_cmd(self, bins: Binaries, ports: dict[str, int]) -> list[str]:
        return [
            str(bins["kwok"]), f"--kubeconfig={self.kubeconfig}", f"--config={STAGES}",
            # Only the inventory's nodes: a real node (realnode.py) has its own kubelet.
            f"--manage-nodes-with-annotation-selector={KWOK_NODE_ANNOTATION}=fake",
            f"--server-address=127.0.0.1:{ports['kwok']}",
            "--node-ip=127.1.0.1", "--cidr=127.9.0.0/16",
            f"--node-lease-duration-seconds={self.node_lease_seconds}",
        ]

    # -- helpers -------------------------------------------------------------------

    def _write_kubeconfig(self, pki: Pki, port: int) -> None:
        doc = {
            "apiVersion": "v1", "kind": "Config", "current-context": self.name,
            "clusters": [{"name": self.name, "cluster": {
                "server": f"https://127.0.0.1:{port}",
                "certificate-authority": str(pki.ca_cert)}}],
            "users": [{"name": "admin", "user": {"token": pki.admin_token}}],
            "contexts": [{"name": self.name, "context": {
                "cluster": self.name, "user": "admin", "namespace": "default"}}],
        }
        self.kubeconfig.write_text(yaml.safe_dump(doc))
        self.kubeconfig.chmod(0o600)

    def _spawn(self, name: str, cmd: list[str]) -> Proc:
        commands = (json.loads(self._commands_file.read_text())
                    if self._commands_file.exists() else {})
        self._commands_file.write_text(json.dumps({**commands, name: cmd}))
        logfile: IO[bytes] = (self.dir / "logs" / f"{name}.log").open("ab")
        # A new session: the components outlive the command that started them
        # (the demo leaves the cluster up) and are stopped by `down`.
        proc = subprocess.Popen(cmd, stdout=logfile, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        logfile.close()
        return Proc(name, CONTROL_PLANE_NODE, proc.pid, start_ticks(proc.pid) or -1)

    def _save_pids(self, pids: dict[str, Proc]) -> None:
        self._pids_file.write_text(json.dumps({n: [p.pid, p.start] for n, p in pids.items()}))

    def _wait(self, what: str, timeout: float, probe: Callable[[], bool], component: str) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for name, proc in self._pids().items():
                if not proc.alive():
                    raise ClusterError(f"{name} exited while waiting for {what}:\n"
                                       f"{self._tail(name)}")
            try:
                if probe():
                    return
            except (ApiError, OSError):
                pass
            time.sleep(0.2)
        raise ClusterError(f"timed out after {timeout:.0f}s waiting for {what}; "
                           f"last log lines of {component}:\n{self._tail(component)}")

    def _tail(self, name: str, lines: int = 25) -> str:
        path = self.dir / "logs" / f"{name}.log"
        if not path.exists():
            return "(no log)"
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])

    def _api_ready(self) -> bool:
        with self._probe() as kube:
            kube.get("/readyz")
        return True

    def _sa_ready(self) -> bool:
        with self.client() as kube:
            return kube.get_or_none(api_path("v1", "serviceaccounts", "default", "default")) \
                is not None

    def _nodes_ready(self) -> bool:
        with self.client() as kube:
            nodes = kube.list(api_path("v1", "nodes"))
        return bool(nodes) and all(_node_ready(n) for n in nodes)

    def _ensure_nodes(self, inventory: str) -> None:
        with self.client() as kube:
            existing = {n["metadata"]["name"] for n in kube.list(api_path("v1", "nodes"))}
            missing = [n for n in node_manifests(load_inventory(inventory))
                       if n["metadata"]["name"] not in existing]
            # Concurrently: one at a time, 10,000 nodes take minutes of round trips.
            with ThreadPoolExecutor(16) as pool:
                list(pool.map(lambda node: kube.create(api_path("v1", "nodes"), node),
                              missing))


def _node_ready(node: dict[str, object]) -> bool:
    status = node.get("status")
    conditions = status.get("conditions", []) if isinstance(status, dict) else []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)
