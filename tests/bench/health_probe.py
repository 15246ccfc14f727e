"""A worker's health endpoint, and the host discovery script that probes it.

The discovery a careful horovodrun user writes instead of ``cat hosts``: it lists a host
of the inventory only if the worker there answers a probe within
:data:`PROBE_TIMEOUT_S`. The worker answers from a thread of its own, so a slow training
step still answers; a frozen (SIGSTOPped) process does not, as its thread is stopped too
(the kernel still accepts the connection, so the probe waits for a reply, not for the
connect), and a host cut off the network lets the connect time out. A host where nothing
listens (connection refused) has no worker yet, and stays listed: horovodrun starts one
there.

Dropping a host is not enough: horovodrun does not end the worker of a host that left
discovery, and its next rendezvous waits for every worker of the last world to report
(ready, or failed by exiting). So the script also does what a liveness probe does: a
worker on this machine (a loopback host) that missed :data:`MISSES_BEFORE_KILL` probes
in a row is killed, and horovodrun sees it fail; its host stays out of the list from then
on (whatever froze the worker may freeze the next). A host of another namespace may be cut
off and out of reach; its worker's launch (``ssh``) ends by ssh's keep-alives instead.

Probes go only to loopback or to the benchmark's own network namespaces (the subnet
given on the command line); any other address in the inventory is an error.

    health_probe.py discover HOSTS_FILE PORTS_JSON SUBNET LOG   (the discovery script)

Standard library only: horovodrun runs the script once a second.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import signal
import socket
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

PROBE_TIMEOUT_S = 1.0
"""How long a probe waits for a worker's answer (connect and reply together)."""

MISSES_BEFORE_KILL = 3
"""Probes in a row a local worker may miss before it is killed (a kubelet's default
``failureThreshold``)."""

PING, PONG = b"ping\n", b"ok"


def serve(host: str, port: int) -> None:
    """Answer every probe on ``host:port`` from a daemon thread, for the process's life."""
    server = socket.create_server((host, port))

    def answer() -> None:
        while True:
            conn, _ = server.accept()
            with conn:
                conn.settimeout(PROBE_TIMEOUT_S)
                try:
                    if conn.recv(len(PING)):
                        conn.sendall(PONG + f" {os.getpid()}\n".encode())
                except OSError:
                    pass

    threading.Thread(target=answer, name="health", daemon=True).start()


def probe(host: str, port: int) -> int | None:
    """The pid of the worker on ``host`` that answered; 0 when none listens (no worker
    yet); None when no answer came within PROBE_TIMEOUT_S."""
    try:
        with socket.create_connection((host, port), timeout=PROBE_TIMEOUT_S) as sock:
            sock.settimeout(PROBE_TIMEOUT_S)
            sock.sendall(PING)
            word, pid = sock.recv(64).split()
            return int(pid) if word == PONG else None
    except ConnectionRefusedError:
        return 0
    except (OSError, ValueError):
        return None


def allowed(host: str, subnet: str) -> bool:
    """Whether ``host`` is loopback or inside the benchmark's namespaces' ``subnet``."""
    address = ipaddress.ip_address(socket.gethostbyname(host))
    return address.is_loopback or address in ipaddress.ip_network(subnet)


def discover(hosts_file: Path, ports: dict[str, int], subnet: str, log: Path) -> int:
    """Print ``host:1`` for every host of ``hosts_file`` whose worker answered (or that
    has none yet), probing them all at once; kill a local worker that missed
    MISSES_BEFORE_KILL probes in a row. Append what was listed and killed, and when, to
    ``log``; what the next run needs (pids, misses, hosts killed) goes beside it."""
    hosts = [line.split(":")[0] for line in hosts_file.read_text().split()]
    strangers = [h for h in hosts if not allowed(h, subnet)]
    if strangers:
        print(f"refusing to probe {strangers}: not loopback nor in {subnet}", file=sys.stderr)
        return 1
    with ThreadPoolExecutor(len(hosts) or 1) as pool:
        answers = dict(zip(hosts, pool.map(lambda h: probe(h, ports[h]), hosts), strict=True))
    state_file = log.with_suffix(".state.json")
    state = json.loads(state_file.read_text()) if state_file.exists() else \
        {"pids": {}, "misses": {}, "killed": []}
    killed: list[str] = []
    for host, pid in answers.items():
        if pid is not None:
            state["misses"][host] = 0
            state["pids"][host] = pid
            continue
        state["misses"][host] = misses = state["misses"].get(host, 0) + 1
        local = ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
        if local and misses == MISSES_BEFORE_KILL and state["pids"].get(host):
            with contextlib.suppress(ProcessLookupError):
                os.kill(state["pids"][host], signal.SIGKILL)
            killed.append(host)
    state["killed"] += killed
    state_file.write_text(json.dumps(state))
    listed = [h for h in hosts if answers[h] is not None and h not in state["killed"]]
    with log.open("a") as out:
        out.write(json.dumps({"t": time.time(), "listed": listed, "killed": killed}) + "\n")
    print("".join(f"{h}:1\n" for h in listed), end="")
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] != ["discover"] or len(sys.argv) != 6:
        print(__doc__, file=sys.stderr)
        sys.exit(2)
    sys.exit(discover(Path(sys.argv[2]), json.loads(Path(sys.argv[3]).read_text()),
                      sys.argv[4], Path(sys.argv[5])))
