"""Start Python worker processes by forking a server that imported torch once.

``import torch`` costs about two seconds of CPU; a job that starts (and restarts) many
worker processes on a small machine pays it for each. The fork server is one process
that imports the heavy modules once, single-threaded, and then forks a child per
command: the child takes the command's environment, working directory, output file and
session, and runs the module or script as ``python -m``/``python script.py`` would, as
the process's main program (its exit code, threads and atexit handlers as usual; the
server's modules are not torn down at its exit, see :func:`_run_and_exit`).

A launcher forks its workers only when asked (``RINGWRIGHT_FORK_WORKERS=1``, see
:func:`wanted`): a forked worker starts without paying the import, which is what the test
suite wants and what a measurement of start-up or recovery time must not get (a kubelet
starts a container's interpreter from nothing). Only commands of this very interpreter
are forked (:func:`forkable`); anything else, or an interpreter option, goes through
:mod:`subprocess` as before. Each child gets fresh random seeds; ``PYTHONHASHSEED`` and
the interpreter's flags are the server's, and the server runs unbuffered (``-u``), as
the launchers ask of their workers anyway.

Wire format on a Unix socket pair: a 4-byte length, then JSON; a spawn request carries
the child's output and error descriptors alongside (``SCM_RIGHTS``).
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import io
import json
import os
import random
import runpy
import select
import signal
import socket
import struct
import subprocess
import sys
import threading
from collections.abc import Collection, Mapping, Sequence
from typing import IO, Any, Protocol

from ringwright.procstat import start_ticks

SETTING = "RINGWRIGHT_FORK_WORKERS"
"""``1``: the local launcher, the local cluster's pod host and the test harnesses fork
their Python workers from a fork server."""

PRELOAD = ("torch", "torch._dynamo", "ringwright.runtime.elastic")
"""What the server imports before forking (numpy comes with torch). ``torch._dynamo`` is
imported lazily by the first optimizer a worker makes (about 0.8 s of CPU in each child),
and the runtime's own modules by every worker (about 0.2 s)."""

_LENGTH = struct.Struct("!I")
_ENDING = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
"""Signals that end the server, and its children with it."""

SURVIVE_SIGNALS = "--survive-signals"
"""The server's flag: it ignores :data:`_ENDING` (its children get the default handlers)."""


def wanted(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether ``environ`` asks for forked workers (:data:`SETTING`)."""
    return environ.get(SETTING, "") == "1"


def forkable(argv: Sequence[str]) -> bool:
    """Whether ``argv`` runs a module or script with this interpreter and no options."""
    if len(argv) < 2 or os.path.realpath(argv[0]) != os.path.realpath(sys.executable):
        return False
    return (argv[1] == "-m" and len(argv) > 2) or not argv[1].startswith("-")


def _send(sock: socket.socket, message: Mapping[str, Any], fds: Sequence[int] = ()) -> None:
    data = json.dumps(message).encode()
    payload = _LENGTH.pack(len(data)) + data
    if fds:
        socket.send_fds(sock, [payload], list(fds))
    else:
        sock.sendall(payload)


def _recv_exact(sock: socket.socket, size: int, fds: list[int]) -> bytes | None:
    chunks = b""
    while len(chunks) < size:
        data, got, _, _ = socket.recv_fds(sock, size - len(chunks), 4)
        fds.extend(got)
        if not data:
            return None
        chunks += data
    return chunks


def _recv(sock: socket.socket) -> tuple[dict[str, Any], list[int]] | None:
    """The next message and any descriptors it carried; None once the peer is gone."""
    fds: list[int] = []
    head = _recv_exact(sock, _LENGTH.size, fds)
    if head is None:
        return None
    body = _recv_exact(sock, _LENGTH.unpack(head)[0], fds)
    if body is None:
        return None
    return json.loads(body), fds


def _recv_or_none(sock: socket.socket) -> tuple[dict[str, Any], list[int]] | None:
    try:
        return _recv(sock)
    except OSError:  # reset by a server that died, or closed by this side
        return None


class Process(Protocol):
    """What the launchers use of a worker process: a :class:`subprocess.Popen` or a
    :class:`ForkedProcess`."""

    pid: int
    returncode: int | None

    def poll(self) -> int | None: ...
    def wait(self, timeout: float | None = None) -> int: ...
    def send_signal(self, sig: int) -> None: ...
    def terminate(self) -> None: ...
    def kill(self) -> None: ...


class ForkedProcess:
    """A forked child as the callers of :class:`subprocess.Popen` use one."""

    def __init__(self, server: ForkServer, pid: int, args: Sequence[str]) -> None:
        self._server = server
        self.pid = pid
        self.args = list(args)
        self.started = start_ticks(pid)
        """When it started (None: already gone), to tell it from a later process that
        gets the same pid."""
        self.returncode: int | None = None

    def poll(self) -> int | None:
        """The exit code (negative: the signal), or None while it runs."""
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """Wait for the exit; :class:`subprocess.TimeoutExpired` after ``timeout``."""
        with self._server.changed:
            if not self._server.changed.wait_for(lambda: self.returncode is not None,
                                                 timeout):
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        """Signal the process, unless it has already been reaped."""
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class ForkServer:
    """One server process and the children it forked for this process.

    Thread-safe. The server exits, killing its children, when this side closes (or this
    process dies), so no child outlives the launcher that started it.
    """

    def __init__(self, preload: Sequence[str] = PRELOAD, *,
                 survive_signals: bool = False) -> None:
        """``survive_signals``: SIGTERM, SIGINT and SIGHUP sent to this process's group
        leave the server and its children to their own handlers, instead of ending the
        server and killing the children (for a caller that forwards such signals itself
        and lets its children shut down cleanly); the server still kills its children
        when this process dies."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        flags = [SURVIVE_SIGNALS] if survive_signals else []
        with theirs:
            self._proc = subprocess.Popen(
                [sys.executable, "-u", "-m", "ringwright.runtime.local.forkserver", *flags,
                 str(theirs.fileno()), *preload],
                pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL)
        self._sock = ours
        self.changed = threading.Condition()
        self._children: dict[int, ForkedProcess] = {}
        self._exits: dict[int, int] = {}
        self._started: list[int] = []
        self._spawning = threading.Lock()
        self._closed = False
        self._reader = threading.Thread(target=self._read, daemon=True, name="forkserver")
        self._reader.start()

    def spawn(self, argv: Sequence[str], env: Mapping[str, str], *, stdout: int,
              stderr: int, cwd: str | None = None,
              new_session: bool = False) -> ForkedProcess:
        """Fork a child running ``argv`` (see :func:`forkable`) with ``env``, its output
        and errors to the descriptors ``stdout`` and ``stderr``, input from /dev/null;
        ``new_session``: the child leads its own session and process group."""
        if not forkable(argv):
            raise ValueError(f"the fork server runs this interpreter's modules and scripts "
                             f"only, not {list(argv)}")
        request = {"argv": list(argv[1:]), "env": dict(env), "cwd": cwd or os.getcwd(),
                   "session": new_session}
        with self._spawning, self.changed:
            if self._closed:
                raise RuntimeError("the fork server is closed")
            _send(self._sock, request, [stdout, stderr])
            if not self.changed.wait_for(lambda: self._started or self._closed, 120.0):
                raise RuntimeError("the fork server did not answer within 120 s")
            if not self._started:
                raise RuntimeError(f"the fork server exited (code {self._proc.poll()})")
            pid = self._started.pop(0)
            child = ForkedProcess(self, pid, argv)
            self._children[pid] = child
            if pid in self._exits:  # it exited before we took its pid
                child.returncode = self._exits.pop(pid)
            return child

    def _read(self) -> None:
        while (got := _recv_or_none(self._sock)) is not None:
            message, _ = got
            with self.changed:
                if "started" in message:
                    self._started.append(int(message["started"]))
                else:
                    pid, code = int(message["exited"]), int(message["code"])
                    child = self._children.pop(pid, None)
                    if child is None:
                        self._exits[pid] = code
                    else:
                        child.returncode = code
                self.changed.notify_all()
        with self.changed:
            self._closed = True
            orphans, self._children = list(self._children.values()), {}
        for child in orphans:
            _end_orphan(child)
        with self.changed:
            for child in orphans:
                # Its exit report, if it was ever sent, went with the server.
                child.returncode = -signal.SIGKILL
            self.changed.notify_all()

    @property
    def closed(self) -> bool:
        """Closed, or the server process is gone."""
        return self._closed

    def close(self) -> None:
        """Stop the server; it kills the children still running."""
        with self.changed:
            self._closed = True
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()
        try:
            self._proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()


def _end_orphan(child: ForkedProcess) -> None:
    """Kill a child that its server no longer watches (the server was SIGKILLed, say by
    the OOM killer, and could not take its children with it), unless it is gone."""
    if child.started is None or start_ticks(child.pid) != child.started:
        return
    signal_group(child.pid, signal.SIGKILL)
    # Ours to reap when orphans are handed to this process (a container's init).
    with contextlib.suppress(ChildProcessError):
        os.waitpid(child.pid, 0)


def signal_group(pid: int, sig: int) -> None:
    """Send ``sig`` to the process group that process ``pid`` leads, or to the process
    alone while it leads none (yet): a child forked with a session of its own makes it
    first thing, but on a loaded machine it may not have run at all, and a signal to
    its group would then find no group and reach nobody. Nothing when it is gone."""
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


_shared: ForkServer | None = None
_shared_lock = threading.Lock()


def shared() -> ForkServer:
    """This process's fork server, started on first use and stopped at exit."""
    global _shared
    with _shared_lock:
        if _shared is None or _shared.closed:
            _shared = ForkServer()
            atexit.register(_shared.close)
        return _shared


def start_process(argv: Sequence[str], env: Mapping[str, str], *,
                  output: IO[bytes] | None, fork: bool, cwd: str | None = None,
                  new_session: bool = False) -> Process:
    """Start a worker: forked by this process's fork server when ``fork`` and
    :func:`forkable`, else with :class:`subprocess.Popen`. ``output`` takes its stdout
    and stderr (None: this process's); its stdin is /dev/null."""
    if fork and forkable(argv):
        # None: descriptors 1 and 2, as a subprocess inherits them (sys.stdout may be a
        # capture without a descriptor).
        out = output.fileno() if output is not None else 1
        err = output.fileno() if output is not None else 2
        return shared().spawn(argv, env, stdout=out, stderr=err, cwd=cwd,
                              new_session=new_session)
    return subprocess.Popen(argv, env=env, stdout=output,
                            stderr=subprocess.STDOUT if output is not None else None,
                            stdin=subprocess.DEVNULL, cwd=cwd, start_new_session=new_session)


# -- the server process ------------------------------------------------------------------


def _serve(sock: socket.socket, survive_signals: bool = False) -> dict[str, Any] | None:
    """Fork a child per request and report exits; in a child, return its request."""
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    children: set[int] = set()

    def end(signum: int, _frame: object) -> None:
        # Told to stop (a Ctrl-C or kill of the launcher's process group reaches the
        # server too): its children go first, else those in sessions of their own
        # would train on without a launcher.
        _kill(children)
        _end_by(signum)

    ending = {signum: signal.signal(signum, signal.SIG_IGN if survive_signals else end)
              for signum in _ENDING}
    while True:
        # SIGCHLD interrupts select; Python retries it, and the wake-up byte ends it.
        ready = select.select([sock.fileno(), wake_r], [], [])[0]
        if wake_r in ready:
            os.read(wake_r, 4096)
            _reap(sock, children)
        if sock.fileno() not in ready:
            continue
        got = _recv(sock)
        if got is None:  # the launcher is gone: so are its workers
            _kill(children)
            return None
        request, fds = got
        # Held until the child is recorded (the parent) or has the handlers it should
        # have (the child): an ending signal in between would pass over the new child,
        # or, taken by the server's handler in the child, kill the child's siblings.
        mask = signal.pthread_sigmask(signal.SIG_BLOCK, _ENDING)
        pid = os.fork()
        if pid == 0:
            signal.set_wakeup_fd(-1)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            for signum, handler in ending.items():
                signal.signal(signum, handler)
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)
            os.close(wake_r)
            os.close(wake_w)
            sock.close()
            _become(request, fds)
            return request
        children.add(pid)
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        for fd in fds:
            os.close(fd)
        _send(sock, {"started": pid})


def _kill(children: Collection[int]) -> None:
    """SIGKILL each child, with the process group of one that leads its own session."""
    for pid in children:
        signal_group(pid, signal.SIGKILL)


def _reap(sock: socket.socket, children: set[int]) -> None:
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        children.discard(pid)
        _send(sock, {"exited": pid, "code": os.waitstatus_to_exitcode(status)})


def _become(request: Mapping[str, Any], fds: list[int]) -> None:
    """Turn this fresh fork into the requested process (all but running its code)."""
    if request["session"]:
        os.setsid()
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(fds[0], 1)
    os.dup2(fds[1], 2)
    for fd in {null, *fds} - {0, 1, 2}:
        os.close(fd)
    os.chdir(request["cwd"])
    env: dict[str, str] = request["env"]
    os.environ.clear()
    os.environ.update(env)
    # sys.path[0] is the server's own start-up entry: _run puts the command's there.
    entries = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:] = [sys.path[0], *entries, *[p for p in sys.path[1:] if p not in entries]]
    # Fresh draws, as a new process would make them (the server's state is shared).
    random.seed()
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    threads = env.get("OMP_NUM_THREADS")
    if threads and "torch" in sys.modules:
        # libgomp read the server's environment when torch loaded; apply the child's.
        sys.modules["torch"].set_num_threads(int(threads))


def _run(argv: list[str]) -> None:
    """Run ``argv`` (after the interpreter) as this process's main program."""
    if argv[0] == "-m":
        sys.argv = [argv[1], *argv[2:]]
        sys.path[0] = os.getcwd()
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        script = os.path.abspath(argv[0])
        sys.argv = [argv[0], *argv[1:]]
        sys.path[0] = os.path.dirname(script)
        runpy.run_path(script, run_name="__main__")


def _exit_code(err: SystemExit) -> int:
    """The status ``sys.exit(code)`` gives an interpreter (a message: printed, 1)."""
    if err.code is None or isinstance(err.code, int):
        return err.code or 0
    print(err.code, file=sys.stderr)
    return 1


def _flush_open_files() -> None:
    """Flush every file object of the child (the server's objects are frozen, out of
    :func:`gc.get_objects`). The collection that follows frees a namespace caught in a
    cycle in no set order, and a buffer finalized before its text layer drops the text
    the layer still held; the interpreter's teardown clears a module's names instead."""
    for obj in gc.get_objects():
        if isinstance(obj, io.IOBase):
            with contextlib.suppress(Exception):
                if not obj.closed:
                    obj.flush()
    for stream in (sys.stdout, sys.stderr):  # made by the server: frozen
        with contextlib.suppress(Exception):
            stream.flush()


def _run_and_exit(argv: list[str]) -> None:
    """Run the child's program, then end the process as the interpreter would, less the
    teardown of the server's modules: freeing torch's objects one by one (each page
    copied from the server's on the way) took a forked pod entry point 0.7-1 s to exit,
    against 0.1 s started fresh without torch; on a loaded machine the pod's deletion
    overtook the entry point's own exit status."""
    code, interrupted = 0, False
    try:
        _run(argv)
    except SystemExit as err:
        code = _exit_code(err)
    except BaseException as err:
        sys.excepthook(type(err), err, err.__traceback__)
        code, interrupted = 1, isinstance(err, KeyboardInterrupt)
    # What the interpreter's exit does that a program can see: threading's own exit
    # hooks (they tell idle thread-pool workers to end) and the wait for its non-daemon
    # threads, its atexit handlers, the files it left open written out, its objects
    # freed (their finalizers run).
    threading._shutdown()  # type: ignore[attr-defined]
    atexit._run_exitfuncs()
    _flush_open_files()
    gc.collect()
    if interrupted:  # as the interpreter ends on an unhandled KeyboardInterrupt
        _end_by(signal.SIGINT)
    os._exit(code)


def _end_by(signum: int) -> None:
    """End this process as ``signum``'s default action does (its status says so)."""
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


def main(argv: list[str]) -> None:
    """The server: ``python -u -m ringwright.runtime.local.forkserver [--survive-signals]
    FD [MODULE...]``."""
    survive = argv[:1] == [SURVIVE_SIGNALS]
    if survive:
        argv = argv[1:]
    sock = socket.socket(fileno=int(argv[0]))
    for name in argv[1:]:
        __import__(name)
    # The children's collections then pass over their own objects only, not the server's
    # (a pass over those would copy every page of the server's heap into the child).
    gc.freeze()
    request = _serve(sock, survive)
    if request is None:
        # Nothing of the server needs tearing down, and an interpreter's teardown of the
        # preloaded modules is slow and noisy (triton's bindings report "leaks").
        os._exit(0)
    _run_and_exit(request["argv"])


if __name__ == "__main__":
    main(sys.argv[1:])
