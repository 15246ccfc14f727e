"""``ssh HOST COMMAND`` between network namespaces, over the namespaces' own links.

horovodrun starts the workers of a host that is not local with ``ssh HOST COMMAND`` and
learns that they ended from ssh's exit status. In the benchmark's partition scenario
every host is a network namespace of this machine with no sshd, so
:class:`NamespaceSsh` starts a small agent in each host's namespace, listening on the
host's address, and puts an ``ssh`` first on the driver's PATH that connects to it,
sends COMMAND, relays its output and exits with its status. Output and status travel
over the link the benchmark cuts, as with a real ssh session without keep-alives: from
a cut-off host nothing reaches the driver, not even the news that its worker exited.
With keep-alives (:data:`ALIVE_ENV` set, as ``ssh -o ServerAliveInterval=1 -o
ServerAliveCountMax=3``), the client gives up on a host it heard nothing from for that
long and exits with ssh's own status for a lost connection.

    namespace_ssh.py agent ADDRESS PORT_FILE      (in a host's namespace)
    namespace_ssh.py ssh PORTS_FILE [SSH ARGS]    (what the ``ssh`` on PATH runs)
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO, TYPE_CHECKING

import psutil

if TYPE_CHECKING:  # the agent and the client run without the test tree's imports
    from tests.runtime.netns import NamespacedPods

OUT, ERR, EXIT, ALIVE = 1, 2, 3, 4
"""Frame kinds from agent to client: the command's stdout, its stderr, its exit status,
and a keep-alive (every :data:`ALIVE_INTERVAL_S` while the command runs)."""

ALIVE_INTERVAL_S = 1.0
ALIVE_ENV = "BENCH_SSH_ALIVE_S"
"""Seconds without any frame after which the client counts the connection lost; unset,
it waits for ever, as ssh without keep-alives."""

_HEADER = struct.Struct("!BI")
LOST = 255
"""ssh's own exit status when the connection ends without the command's."""


def _recv_exact(sock: socket.socket, size: int) -> bytes | None:
    data = b""
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            return None
        data += chunk
    return data


def _send(sock: socket.socket, lock: threading.Lock, kind: int, payload: bytes) -> None:
    with lock:
        sock.sendall(_HEADER.pack(kind, len(payload)) + payload)


def _serve(conn: socket.socket) -> None:
    """Run one client's command; stream its output back, then its exit status."""
    with conn:
        size = _recv_exact(conn, 4)
        command = _recv_exact(conn, struct.unpack("!I", size)[0]) if size else None
        if command is None:
            return
        proc = subprocess.Popen(["sh", "-c", command.decode()], stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                start_new_session=True)
        lock = threading.Lock()

        def relay(pipe: IO[bytes], kind: int) -> None:
            with contextlib.suppress(OSError):
                while chunk := os.read(pipe.fileno(), 65536):
                    _send(conn, lock, kind, chunk)

        def keep_alive() -> None:
            with contextlib.suppress(OSError):
                while proc.poll() is None:
                    time.sleep(ALIVE_INTERVAL_S)
                    _send(conn, lock, ALIVE, b"")

        def hang_up() -> None:
            # The client closed (it was ended): end the command, as sshd does.
            with contextlib.suppress(OSError):
                while conn.recv(4096):
                    pass
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)

        assert proc.stdout is not None and proc.stderr is not None
        relays = [threading.Thread(target=relay, args=(proc.stdout, OUT), daemon=True),
                  threading.Thread(target=relay, args=(proc.stderr, ERR), daemon=True)]
        for thread in relays:
            thread.start()
        threading.Thread(target=hang_up, daemon=True).start()
        threading.Thread(target=keep_alive, daemon=True).start()
        code = proc.wait()
        for thread in relays:
            thread.join()
        with contextlib.suppress(OSError):
            _send(conn, lock, EXIT, struct.pack("!i", code if code >= 0 else 128 - code))


def agent(address: str, port_file: Path) -> int:
    """Serve commands on ``address`` (a free port, written to ``port_file``) forever."""
    server = socket.create_server((address, 0))
    tmp = port_file.with_suffix(".tmp")
    tmp.write_text(str(server.getsockname()[1]))
    tmp.replace(port_file)
    while True:
        conn, _ = server.accept()
        threading.Thread(target=_serve, args=(conn,), daemon=True).start()


def split_ssh_args(args: list[str]) -> tuple[str, str]:
    """(host, command) of an ssh command line; options (``-o X``, ``-p X``...) dropped."""
    options_with_value = {"-o", "-p", "-i", "-l", "-F"}
    host, rest = "", list(args)
    while rest:
        arg = rest.pop(0)
        if arg in options_with_value:
            rest = rest[1:]
        elif arg.startswith("-"):
            continue
        elif host:
            return host, " ".join([arg, *rest])
        else:
            host = arg
    return host, ""


def client(ports_file: Path, args: list[str]) -> int:
    """Run an ssh command line's command on its host's agent; its exit status."""
    host, command = split_ssh_args(args)
    port = json.loads(ports_file.read_text()).get(host)
    if port is None or not command:
        print(f"ssh: no agent for host {host!r} or no command", file=sys.stderr)
        return LOST
    outputs = {OUT: sys.stdout.buffer, ERR: sys.stderr.buffer}
    try:
        with socket.create_connection((host, port)) as sock:
            alive = os.environ.get(ALIVE_ENV)
            sock.settimeout(float(alive) if alive else None)
            payload = command.encode()
            sock.sendall(struct.pack("!I", len(payload)) + payload)
            while header := _recv_exact(sock, _HEADER.size):
                kind, size = _HEADER.unpack(header)
                body = _recv_exact(sock, size)
                if body is None:
                    break
                if kind == EXIT:
                    return int(struct.unpack("!i", body)[0])
                if kind == ALIVE:
                    continue
                outputs[kind].write(body)
                outputs[kind].flush()
    except OSError as err:
        print(f"ssh: {host}: {err}", file=sys.stderr)
    return LOST


class NamespaceSsh:
    """An agent in each of ``hosts`` namespaces of ``network``, and the ``ssh`` to reach
    them: put :attr:`bin_dir` first on the PATH of whoever runs ssh."""

    def __init__(self, network: NamespacedPods, hosts: int, workdir: Path,
                 timeout: float = 60.0) -> None:
        workdir.mkdir(parents=True, exist_ok=True)
        self.agents: list[subprocess.Popen[bytes]] = []
        ports: dict[str, int] = {}
        me = [sys.executable, str(Path(__file__).resolve())]
        try:
            for index in range(hosts):
                address, prefix, _ = network.attach(index)
                port_file = workdir / f"agent-{index}.port"
                self.agents.append(subprocess.Popen(
                    [*prefix, *me, "agent", address, str(port_file)],
                    start_new_session=True))
                deadline = time.monotonic() + timeout
                while not port_file.exists():
                    if self.agents[-1].poll() is not None or time.monotonic() > deadline:
                        raise RuntimeError(f"ssh agent for {address} did not start")
                    time.sleep(0.02)
                ports[address] = int(port_file.read_text())
        except BaseException:
            self.close()
            raise
        ports_file = workdir / "ports.json"
        ports_file.write_text(json.dumps(ports))
        self.bin_dir = workdir / "bin"
        self.bin_dir.mkdir(exist_ok=True)
        ssh = self.bin_dir / "ssh"
        ssh.write_text(f'#!/bin/sh\nexec {" ".join(me)} ssh {ports_file} "$@"\n')
        ssh.chmod(0o755)

    def close(self) -> None:
        """End the agents and every command they started."""
        for proc in self.agents:
            started: list[psutil.Process] = []
            with contextlib.suppress(psutil.Error):
                started = psutil.Process(proc.pid).children(recursive=True)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            for child in started:
                with contextlib.suppress(psutil.Error):
                    child.kill()
            proc.wait()


def main(argv: list[str]) -> int:
    if argv[:1] == ["agent"] and len(argv) == 3:
        return agent(argv[1], Path(argv[2]))
    if argv[:1] == ["ssh"] and len(argv) >= 2:
        return client(Path(argv[1]), argv[2:])
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
