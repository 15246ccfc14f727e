"""A worker's health endpoint, and the host discovery script that probes it.

The discovery a careful horovodrun user writes instead of ``cat hosts``: it lists a host
of the inventory only if the worker there answers a probe within
:data:`PROBE_TIMEOUT_S`. The worker answers from a thread of its own, so a slow training
step still answers; a frozen (SIGSTOPped) process does not, as its thread is stopped too
(the kernel still accepts the connection, so the probe waits for a reply, not for the
connect), and a host cut off the network lets the connect time out. A host where nothing
listens (connection refused) has no worker yet, and stays listed: horovodrun starts one
there.

Probes go only to loopback or to the benchmark's own network namespaces (the subnet
given on the command line); any other address in the inventory is an error.

    health_probe.py discover HOSTS_FILE PORTS_JSON SUBNET LOG   (the discovery script)

Standard library only: horovodrun runs the script once a second.
"""

from __future__ import annotations

import ipaddress
import json
import socket
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

PROBE_TIMEOUT_S = 1.0
"""How long a probe waits for a worker's answer (connect and reply together)."""

PING, PONG = b"ping\n", b"ok\n"


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
                        conn.sendall(PONG)
                except OSError:
                    pass

    threading.Thread(target=answer, name="health", daemon=True).start()


def healthy(host: str, port: int) -> bool:
    """Whether ``host`` should be listed: its worker answered, or none listens yet."""
    try:
        with socket.create_connection((host, port), timeout=PROBE_TIMEOUT_S) as sock:
            sock.settimeout(PROBE_TIMEOUT_S)
            sock.sendall(PING)
            return sock.recv(len(PONG)) == PONG
    except ConnectionRefusedError:
        return True
    except OSError:
        return False


def allowed(host: str, subnet: str) -> bool:
    """Whether ``host`` is loopback or inside the benchmark's namespaces' ``subnet``."""
    address = ipaddress.ip_address(socket.gethostbyname(host))
    return address.is_loopback or address in ipaddress.ip_network(subnet)


def discover(hosts_file: Path, ports: dict[str, int], subnet: str, log: Path) -> int:
    """Print ``host:1`` for every host of ``hosts_file`` that passes :func:`healthy`,
    probing them all at once; append what was listed, and when, to ``log``."""
    hosts = [line.split(":")[0] for line in hosts_file.read_text().split()]
    strangers = [h for h in hosts if not allowed(h, subnet)]
    if strangers:
        print(f"refusing to probe {strangers}: not loopback nor in {subnet}", file=sys.stderr)
        return 1
    with ThreadPoolExecutor(len(hosts) or 1) as pool:
        answers = list(pool.map(lambda h: healthy(h, ports[h]), hosts))
    listed = [h for h, ok in zip(hosts, answers, strict=True) if ok]
    with log.open("a") as out:
        out.write(json.dumps({"t": time.time(), "listed": listed}) + "\n")
    print("".join(f"{h}:1\n" for h in listed), end="")
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] != ["discover"] or len(sys.argv) != 6:
        print(__doc__, file=sys.stderr)
        sys.exit(2)
    sys.exit(discover(Path(sys.argv[2]), json.loads(Path(sys.argv[3]).read_text()),
                      sys.argv[4], Path(sys.argv[5])))
