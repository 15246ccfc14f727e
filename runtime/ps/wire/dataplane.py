"""The data plane: pulls and pushes as ZeroMQ messages whose frames are the tensors' own
memory, apart from the gRPC control plane (routing, leases, journal, health).

gRPC hands every message to Python as one ``bytes``, so each byte of a large tensor is
copied many times on its way. Here a message is a small JSON frame and one frame per
tensor (:func:`.codec.to_frames`): sent without a copy (``copy=False``), received as a
buffer that the tensor views. A server binds its data socket on the address of its
gRPC port, on a port the system picks, and names it through the control plane
(``Data``); a client asks on its first data call and again after the connection
broke (a restarted server has a new port).

Failures read as gRPC's (:class:`DataCallError` is a ``grpc.RpcError`` with a status
code), so the client's recovery treats both planes alike: UNAVAILABLE when no
connection could be made, when it broke, or when the server left ZeroMQ's heartbeats
unanswered for about ``detect_s`` (a frozen process: its kernel still acknowledges
TCP, but its I/O thread answers nothing; a busy server's I/O thread still does);
DEADLINE_EXCEEDED past the call's timeout; a server's refusals with the codes of the
gRPC handlers.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable, Mapping
from concurrent import futures
from typing import Any

import grpc
import zmq
import zmq.utils.monitor

from ...kvlog import log_event, runtime_logger
from ..progress import ServingProgress
from ..serving.hosting import IncompletePush, NotServing
from ..serving.shard import Lent
from .codec import CodecError, Header, Tensors, from_frames, to_frames

_log = runtime_logger("ps.data")

DATA_METHODS = frozenset({"Pull", "Stage", "Push", "Replicate", "Adopt"})
"""Calls that carry tensors: they travel on the data plane (a server's whole shard
copied to its replica or its new home too: over gRPC, 168 MB cost the two servers about
0.5 s of CPU, which the workers' steps waited for)."""

Handler = Callable[[Header, Tensors], tuple[Header, Tensors]]
AtOnce = Callable[[Header, Tensors], tuple[Header, Tensors] | None]
"""A handler that answers only when it can without waiting, else returns None."""

_POLL_MS = 100
"""How often the server's loop looks at its stop flag."""
_WAIT_CAP_S = 1.0
"""Longest single wait of a client for replies or connection events (its callers look
at their deadlines in between)."""
_CONNECT_POLL_S = 0.05
"""Longest wait between two looks at a connection being made (the handshake's event
ends the wait sooner)."""
_EVENTS_LOST = (zmq.EVENT_DISCONNECTED, zmq.EVENT_CLOSED, zmq.EVENT_MONITOR_STOPPED,
                zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL, zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL,
                zmq.EVENT_HANDSHAKE_FAILED_AUTH, zmq.EVENT_CONNECT_RETRIED)
"""A client's monitor events that end its connection (CONNECT_RETRIED: refused, the
server is gone)."""


def status_of(exc: Exception) -> grpc.StatusCode | None:
    """The status code a handler's exception is answered with (None: a bug, raised)."""
    if isinstance(exc, NotServing):
        return grpc.StatusCode.FAILED_PRECONDITION
    if isinstance(exc, IncompletePush):
        return grpc.StatusCode.ABORTED
    if isinstance(exc, KeyError | ValueError):
        return grpc.StatusCode.INVALID_ARGUMENT
    return None


def error_text(exc: Exception) -> str:
    """How a refusal reads to the caller."""
    if isinstance(exc, NotServing | IncompletePush):
        return str(exc)
    return f"{type(exc).__name__}: {exc}"


def split_address(address: str) -> tuple[str, bool]:
    """The host of a ``host:port`` address, as ZeroMQ's ``tcp://`` wants it, and whether
    it is IPv6 (``[::1]:port``)."""
    host = address.rsplit(":", 1)[0]
    return host, host.startswith("[")


def _socket(context: zmq.Context[zmq.Socket[bytes]], kind: int, ipv6: bool
            ) -> zmq.Socket[bytes]:
    sock = context.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    if ipv6:
        sock.setsockopt(zmq.IPV6, 1)
    return sock


class DataServer:
    """Serves the data-plane calls of one parameter server. A loop thread owns the
    socket and answers there each call that needs no wait (a pull of a shard already at
    the asked version); the others go to a pool, where a sync pull may wait for its
    round. A small pull spent most of its time in the hand-offs to a pool thread and
    back, and a pull that can be answered should not queue behind pulls that wait."""

    def __init__(self, handlers: Mapping[str, Handler], address: str, *,
                 at_once: Mapping[str, AtOnce] | None = None, threads: int = 32,
                 initializer: Callable[[], None] | None = None,
                 progress: ServingProgress | None = None) -> None:
        """``address``: the gRPC address (host:port); the data socket binds its host.
        ``at_once``: by method, a handler that answers only when it need not wait (None:
        the call goes to ``handlers``, in the pool)."""
        host, ipv6 = split_address(address)
        self.handlers = dict(handlers)
        self.at_once = dict(at_once or {})
        self.progress = progress
        self._context: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._router = _socket(self._context, zmq.ROUTER, ipv6)
        self.port = self._router.bind_to_random_port(f"tcp://{host}")
        # Replies come back from the pool's threads through one inproc socket (ZeroMQ
        # sockets are not shared between threads): passed on, not copied.
        inproc = f"inproc://ps-data-{id(self)}"
        self._replies = _socket(self._context, zmq.PULL, False)
        self._replies.bind(inproc)
        self._reply = _socket(self._context, zmq.PUSH, False)
        self._reply.connect(inproc)
        self._reply_lock = threading.Lock()
        self._pool = futures.ThreadPoolExecutor(max_workers=threads,
                                                thread_name_prefix="ps-data",
                                                initializer=initializer)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="ps-data-loop", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Stop serving: calls in flight get no answer (their clients see the
        connection close)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        self._pool.shutdown(wait=False, cancel_futures=True)
        with self._reply_lock:
            self._reply.close()
        self._replies.close()
        self._router.close()

    def _loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self._router, zmq.POLLIN)
        poller.register(self._replies, zmq.POLLIN)
        while not self._stop.is_set():
            ready = dict(poller.poll(_POLL_MS))
            if self._router in ready:
                for request in _drain(self._router):
                    self._dispatch(request[0], request[1:])
            if self._replies in ready:
                for reply in _drain(self._replies):
                    self._router.send_multipart(reply, copy=False)

    def _dispatch(self, peer: zmq.Frame, frames: list[zmq.Frame]) -> None:
        """Answer a request here if it can be without a wait, else hand it to the pool."""
        try:
            doc, tensors = from_frames(frames)
        except CodecError as exc:
            self._answer(peer, _refusal(None, grpc.StatusCode.INVALID_ARGUMENT, str(exc)))
            return
        call, method, header = doc.get("id"), str(doc.get("m")), doc.get("h", {})
        handler = self.handlers.get(method)
        if handler is None:
            self._answer(peer, _refusal(call, grpc.StatusCode.UNIMPLEMENTED,
                                        f"no data call {method!r}"))
            return
        # Counted from here: a request queued behind wedged pool threads is waiting too.
        if self.progress is not None:
            self.progress.started()
        quick = self.at_once.get(method)
        reply = self._run(quick, call, header, tensors) if quick is not None else None
        if reply is None:
            self._pool.submit(self._handle, peer, handler, call, header, tensors)
        else:
            self._answer(peer, reply)

    def _answer(self, peer: zmq.Frame, reply: list[Any]) -> None:
        """Send a reply from the loop thread."""
        self._router.send_multipart([peer, *reply], copy=False)
        if self.progress is not None:
            self.progress.finished()

    def _handle(self, peer: zmq.Frame, handler: Handler, call: Any, header: Header,
                tensors: Tensors) -> None:
        """Run a request on a pool thread; its reply goes out through the loop."""
        try:
            reply = self._run(handler, call, header, tensors)
            assert reply is not None  # only an at-once handler declines
            with self._reply_lock:
                if not self._stop.is_set():
                    self._reply.send_multipart([peer, *reply], copy=False)
        finally:
            if self.progress is not None:
                self.progress.finished()

    def _run(self, handler: AtOnce, call: Any, header: Header, tensors: Tensors
             ) -> list[Any] | None:
        """The frames of a handler's reply or refusal; None if it declined."""
        try:
            answer = handler(header, tensors)
        except Exception as exc:  # answered like the gRPC handlers, or a bug: logged
            code = status_of(exc)
            if code is None:
                log_event(_log, logging.ERROR, "ps_data_call_failed",
                          error=f"{type(exc).__name__}: {exc}")
                code = grpc.StatusCode.INTERNAL
            return _refusal(call, code, error_text(exc),
                            exc.moved_to if isinstance(exc, NotServing) else None)
        if answer is None:
            return None
        out, values = answer
        frames = to_frames({"id": call, "h": out}, values)
        if isinstance(values, Lent) and values.loan.keys:
            # The shard's own memory goes out: it is lent until ZeroMQ is done
            # with it, and an update meanwhile writes a copy. (Rows are copies:
            # nothing to track.)
            lent = [zmq.Frame(f, copy=False, track=True) for f in frames[1:]]
            tracker = zmq.MessageTracker(*lent)
            values.loan.until(lambda: tracker.done)
            return [frames[0], *lent]
        return frames


def _refusal(call: Any, code: grpc.StatusCode, details: str,
             moved_to: int | None = None) -> list[Any]:
    """The frames of a refused call (``moved_to``: see :class:`NotServing`)."""
    return to_frames({"id": call, "err": [code.name, details, moved_to]})


def _drain(sock: zmq.Socket[bytes]) -> list[list[zmq.Frame]]:
    """Every message waiting on ``sock`` (frames not copied)."""
    out = []
    while True:
        try:
            out.append(sock.recv_multipart(zmq.NOBLOCK, copy=False))
        except zmq.Again:
            return out


def _events(monitor: zmq.Socket[bytes]) -> list[int]:
    """The events waiting on a monitor socket."""
    out: list[int] = []
    while True:
        try:
            message = monitor.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:
            return out
        out.append(int(zmq.utils.monitor.parse_monitor_message(message)["event"]))


class DataCallError(grpc.RpcError):
    """A data-plane call failed, with the status code gRPC would give; ``moved_to``: the
    server a shard not served there was just handed to, when the server said."""

    def __init__(self, code: grpc.StatusCode, details: str,
                 moved_to: int | None = None) -> None:
        super().__init__(f"{code.name}: {details}")
        self._code, self._details = code, details
        self.moved_to = moved_to

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


class DataCall:
    """A data-plane call in flight; :meth:`result` waits for its reply."""

    def __init__(self, channel: DataChannel, call: int, deadline: float,
                 failed: grpc.RpcError | None = None) -> None:
        self._channel, self._call, self._deadline = channel, call, deadline
        self._failed = failed

    def result(self, timeout: float | None = None) -> tuple[Header, Tensors]:
        """The reply's header and tensors (views of the received frames); raises a
        ``grpc.RpcError`` when the call failed."""
        if self._failed is not None:
            raise self._failed
        deadline = self._deadline
        if timeout is not None:
            deadline = min(deadline, time.monotonic() + timeout)
        return self._channel.wait(self._call, deadline)


class DataChannel:
    """A client's connection to one server's data plane. Used by one thread at a time
    (a worker's loop), like every ZeroMQ socket."""

    def __init__(self, address: str, locate: Callable[[float], int],
                 detect_s: float) -> None:
        """``address``: the server's gRPC address; ``locate(timeout)``: its data port,
        asked through the control plane."""
        self.host, self._ipv6 = split_address(address)
        self.locate = locate
        self.detect_s = detect_s
        self._context: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._sock: zmq.Socket[bytes] | None = None
        self._monitor: zmq.Socket[bytes] | None = None
        self._endpoint = ""
        self._ids = itertools.count(1)
        self._pending: set[int] = set()
        self._replies: dict[int, tuple[Header, Tensors]] = {}
        self._failed: dict[int, grpc.RpcError] = {}

    def start(self, method: str, header: Header, tensors: Tensors | None,
              timeout: float | None) -> DataCall:
        """Send a call; failures to send show in the call's :meth:`DataCall.result`."""
        deadline = time.monotonic() + (timeout if timeout is not None else 1e9)
        call = next(self._ids)
        try:
            sock = self._connected(deadline)
            sock.send_multipart(to_frames({"m": method, "id": call, "h": header}, tensors),
                                zmq.NOBLOCK, copy=False)
        except grpc.RpcError as exc:
            return DataCall(self, call, deadline, exc)
        except zmq.Again:
            self._lost("its send queue is full")
            return DataCall(self, call, deadline, self._unavailable("its send queue is full"))
        self._pending.add(call)
        return DataCall(self, call, deadline)

    def wait(self, call: int, deadline: float) -> tuple[Header, Tensors]:
        """The reply to ``call``, reading (and keeping) the replies to others meanwhile."""
        while True:
            if call in self._replies:
                doc, tensors = self._replies.pop(call)
                if "err" in doc:
                    code, details, moved_to = (*doc["err"], None)[:3]
                    raise DataCallError(grpc.StatusCode[str(code)], str(details),
                                        None if moved_to is None else int(moved_to))
                return doc["h"], tensors
            failed = self._failed.pop(call, None)
            if failed is not None:
                raise failed
            left = deadline - time.monotonic()
            if left <= 0 or call not in self._pending:
                self._pending.discard(call)
                raise DataCallError(grpc.StatusCode.DEADLINE_EXCEEDED,
                                    f"no reply from {self._endpoint or self.host} in time")
            self._poll(left)

    def _unavailable(self, why: str) -> DataCallError:
        return DataCallError(grpc.StatusCode.UNAVAILABLE,
                             f"data plane of {self._endpoint or self.host}: {why}")

    def _connected(self, deadline: float) -> zmq.Socket[bytes]:
        """The socket, connected (the server's data port asked first when new);
        raises UNAVAILABLE when no connection is made within the detection time."""
        if self._sock is None:
            port = self.locate(max(0.1, min(self.detect_s, deadline - time.monotonic())))
            sock = _socket(self._context, zmq.DEALER, self._ipv6)
            ping_ms = max(100, int(self.detect_s * 1000 / 3))
            # A message is queued only once the connection is up: a send with none
            # fails here instead of waiting for a server that may never come.
            sock.setsockopt(zmq.IMMEDIATE, 1)
            sock.setsockopt(zmq.HEARTBEAT_IVL, ping_ms)
            sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, max(100, int(self.detect_s * 1000) - ping_ms))
            sock.setsockopt(zmq.HANDSHAKE_IVL, max(100, int(self.detect_s * 1000)))
            # The handshake's success too: it wakes the wait below the moment the
            # socket can send (polling for that instead cost a first call up to a
            # whole poll interval, 50 ms, e.g. a shard handed over to a new server).
            self._monitor = sock.get_monitor_socket(
                zmq.EVENT_DISCONNECTED | zmq.EVENT_CLOSED | zmq.EVENT_CONNECT_RETRIED
                | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                | zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_SUCCEEDED)
            self._endpoint = f"tcp://{self.host}:{port}"
            sock.connect(self._endpoint)
            self._sock = sock
        sock = self._sock
        limit = min(deadline, time.monotonic() + self.detect_s)
        while not sock.poll(0, zmq.POLLOUT):
            left = limit - time.monotonic()
            if left <= 0:
                self._lost("no connection")
                raise self._unavailable(f"no connection within {self.detect_s:.1f}s")
            self._poll(min(left, _CONNECT_POLL_S))
            if self._sock is not sock:
                raise self._unavailable("the connection failed")
        return sock

    def _poll(self, timeout: float) -> None:
        """Wait up to ``timeout`` s for replies or connection events; take them in."""
        sock, monitor = self._sock, self._monitor
        if sock is None or monitor is None:
            return
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        ready = dict(poller.poll(max(1, int(min(timeout, _WAIT_CAP_S) * 1000))))
        if sock in ready:
            for frames in _drain(sock):
                doc, tensors = from_frames(frames)
                call = doc.get("id")
                if call in self._pending:  # else a call given up on: dropped
                    self._pending.discard(call)
                    self._replies[call] = (doc, tensors)
        if monitor in ready:
            lost = [event for event in _events(monitor) if event in _EVENTS_LOST]
            if lost:
                self._lost(str(zmq.Event(lost[0]).name).lower())

    def _lost(self, why: str) -> None:
        """The connection is gone: every call waiting on it fails UNAVAILABLE, and the
        next call asks for the server's data port again."""
        for call in self._pending:
            self._failed[call] = self._unavailable(why)
        if self._pending:
            log_event(_log, logging.DEBUG, "ps_data_connection_lost",
                      endpoint=self._endpoint, why=why, calls=len(self._pending))
        self._pending.clear()
        self.close()

    def close(self) -> None:
        if self._sock is not None:
            self._sock.disable_monitor()
            self._sock.close()
        if self._monitor is not None:
            self._monitor.close()
        self._sock = self._monitor = None
