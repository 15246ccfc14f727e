"""The transport of a parameter server: gRPC for control, ZeroMQ for data.

Control calls (routing, leases, journal, replication, health) are gRPC calls with
generic handlers and identity (de)serializers: no protobuf schema to compile, each
message one :mod:`.codec` buffer. Pulls and pushes, which carry the tensors, travel on
the data plane (:mod:`.dataplane`) as frames that are the tensors' own memory. A
:class:`Stub` sends each call on its plane; both fail alike (``grpc.RpcError``).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterable
from concurrent import futures
from typing import TypeAlias

import grpc

from ..progress import UNCOUNTED, ServingProgress
from ..serving.server import ParameterServer
from .codec import Header, Tensors, decode, encode
from .dataplane import DATA_METHODS, DataCall, DataChannel, DataServer, error_text, status_of

SERVICE = "ringwright.ps.ParameterServer"
METHODS = ("Init", "Status", "Data", "Lease", "Journal", "Promote", "Finish")
"""The control plane's calls (``Data``: the port of the server's data plane)."""
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", -1),
    ("grpc.max_receive_message_length", -1),
    # Fail fast on a dead server: a PS failover must not wait out long reconnect backoffs.
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 500),
    ("grpc.enable_retries", 0),
]
DETECT_S = 3.0
"""Default of how long a peer may leave the transport's pings unanswered (the runtime's
``failureDetectSeconds`` default)."""
SERVER_OPTIONS = [
    *CHANNEL_OPTIONS,
    # Clients ping as often as their detection needs, also while a call waits without
    # data (a sync pull waiting for a straggler): allow it, never answer with GOAWAY.
    ("grpc.http2.min_recv_ping_interval_without_data_ms", 100),
    ("grpc.http2.max_ping_strikes", 0),
    # A second server on this port fails to bind instead of silently taking half of the
    # new connections (gRPC shares ports by default): a PS's clients must reach it alone.
    ("grpc.so_reuseport", 0),
]


def channel_options(detect_s: float) -> list[tuple[str, int]]:
    """A client channel's options: calls to a server that leaves the transport's pings
    unanswered for about ``detect_s`` fail (UNAVAILABLE) rather than wait out their
    deadline. A frozen process is found this way: its kernel still acknowledges TCP,
    but nothing answers a ping; a busy one still does (the transport's own threads)."""
    ping_ms = max(100, int(detect_s * 1000 / 3))
    answer_ms = max(100, int(detect_s * 1000) - ping_ms)
    return [*CHANNEL_OPTIONS,
            ("grpc.keepalive_time_ms", ping_ms),
            # Both: the keepalive setting alone leaves the transport's own ping
            # timeout (a minute) in charge.
            ("grpc.keepalive_timeout_ms", answer_ms),
            ("grpc.http2.ping_timeout_ms", answer_ms),
            ("grpc.http2.max_pings_without_data", 0)]


Handler = Callable[[Header, Tensors], tuple[Header, Tensors] | bytes]
"""A call's reply: header and tensors, or a message already encoded."""


def _data_handlers(ps: ParameterServer) -> dict[str, Callable[[Header, Tensors],
                                                               tuple[Header, Tensors]]]:
    return {"Pull": ps.pull,
            "Stage": lambda h, t: (ps.stage(h, t), {}),
            "Push": lambda h, t: (ps.push(h, t), {}),
            "Replicate": lambda h, t: (ps.replicate(h, t), {}),
            # A shard handed over by its old home after a resize.
            "Adopt": lambda h, t: (ps.adopt(h, t), {})}


def _handlers(ps: ParameterServer, data_port: int) -> dict[str, Handler]:
    def only(header: Header) -> tuple[Header, Tensors]:
        return header, {}

    return {
        "Init": lambda h, t: only(ps.init(h, t)),
        "Status": lambda h, t: only(ps.status()),
        "Data": lambda h, t: only({"port": data_port}),
        "Lease": lambda h, t: only(ps.lease(h)),
        "Journal": lambda h, t: only(ps.journal(h)),
        "Promote": lambda h, t: only(ps.promote(int(h["shard"]))),
        "Finish": lambda h, t: only(_finish(ps)),
    }


def _finish(ps: ParameterServer) -> Header:
    ps.finish()
    return {}


def pin_thread(cpus: list[int]) -> Callable[[], None]:
    """A thread initializer that pins each new thread to the next CPU of ``cpus``."""
    counter = iter(range(1 << 30))

    def init() -> None:
        cpu = cpus[next(counter) % len(cpus)]
        os.sched_setaffinity(0, {cpu})  # 0: the calling thread on Linux

    return init


class PSServer(grpc.Server):
    """A parameter server's two planes, started and stopped together: the gRPC server
    (whose interface this is) and the data plane."""

    def __init__(self, control: grpc.Server, data: DataServer) -> None:
        self.control, self.data = control, data

    def add_generic_rpc_handlers(
            self, generic_rpc_handlers: Iterable[grpc.GenericRpcHandler]) -> None:
        self.control.add_generic_rpc_handlers(generic_rpc_handlers)

    def add_insecure_port(self, address: str) -> int:
        return self.control.add_insecure_port(address)

    def add_secure_port(self, address: str, server_credentials: grpc.ServerCredentials) -> int:
        return self.control.add_secure_port(address, server_credentials)

    def start(self) -> None:
        self.data.start()
        self.control.start()

    def stop(self, grace: float | None) -> threading.Event:
        self.data.stop()
        return self.control.stop(grace)


def serve(ps: ParameterServer, address: str, *, threads: int = 32,
          cpus: list[int] | None = None,
          progress: ServingProgress | None = None) -> tuple[PSServer, int]:
    """Start serving ``ps`` on ``address`` (host:port; port 0 lets the system pick a free
    one; the data plane takes a port of its own on the same host), threads pinned to
    ``cpus``, each request counted in ``progress``; the server and the control port."""
    initializer = pin_thread(cpus) if cpus else None
    data = DataServer(_data_handlers(ps), address, at_once={"Pull": ps.pull_at_once},
                      threads=threads, initializer=initializer, progress=progress)
    handlers = _handlers(ps, data.port)

    def wrap(name: str, fn: Handler) -> Callable[[bytes, grpc.ServicerContext], bytes]:
        counted = progress if name not in UNCOUNTED else None

        def call(request: bytes, context: grpc.ServicerContext) -> bytes:
            if counted is not None:
                counted.started()
            try:
                reply = fn(*decode(request))
            except Exception as exc:
                code = status_of(exc)
                if code is None:
                    raise
                context.abort(code, error_text(exc))
            finally:
                if counted is not None:
                    counted.finished()
            return reply if isinstance(reply, bytes) else encode(*reply)

        return call

    method_handlers: dict[str, grpc.RpcMethodHandler[bytes, bytes]] = {
        name: grpc.unary_unary_rpc_method_handler(wrap(name, fn)) for name, fn in handlers.items()}
    pool = futures.ThreadPoolExecutor(
        max_workers=threads, thread_name_prefix=f"ps{ps.index}", initializer=initializer)
    control = grpc.server(pool, options=SERVER_OPTIONS)
    control.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(SERVICE,
                                                                           method_handlers)])
    try:
        port = control.add_insecure_port(address)
    except RuntimeError as exc:  # gRPC's way of saying the bind failed
        data.stop()
        raise OSError(f"cannot listen on {address} ({exc}): is another process on this "
                      "port? Stop it or give this server another port") from exc
    server = PSServer(control, data)
    server.start()
    return server, port


Call: TypeAlias = "grpc.Future[bytes] | DataCall"
"""A call in flight on either plane; :func:`result` gives its reply."""


class Stub:
    """Calls to one parameter server, each on its plane."""

    def __init__(self, address: str, detect_s: float = DETECT_S) -> None:
        self.address = address
        self.channel = grpc.insecure_channel(address, options=channel_options(detect_s))
        self._calls: dict[str, grpc.UnaryUnaryMultiCallable[bytes, bytes]] = {
            name: self.channel.unary_unary(f"/{SERVICE}/{name}") for name in METHODS}
        self.data = DataChannel(address, self._data_port, detect_s)

    def _data_port(self, timeout: float) -> int:
        reply, _ = self.call("Data", {}, timeout=timeout)
        return int(reply["port"])

    def call(self, method: str, header: Header, tensors: Tensors | None = None,
             timeout: float | None = None) -> tuple[Header, Tensors]:
        """One blocking call."""
        if method in DATA_METHODS:
            return self.data.start(method, header, tensors, timeout).result()
        reply: bytes = self._calls[method](encode(header, tensors), timeout=timeout)
        return decode(reply)

    def start(self, method: str, header: Header, tensors: Tensors | None = None,
              timeout: float | None = None) -> Call:
        """Start a call; :func:`result` of the returned call gives the reply."""
        if method in DATA_METHODS:
            return self.data.start(method, header, tensors, timeout)
        return self._calls[method].future(encode(header, tensors), timeout=timeout)

    def close(self) -> None:
        self.data.close()
        self.channel.close()


def result(call: Call) -> tuple[Header, Tensors]:
    """The decoded reply of a call started with :meth:`Stub.start`."""
    if isinstance(call, DataCall):
        return call.result()
    reply: bytes = call.result()
    return decode(reply)
