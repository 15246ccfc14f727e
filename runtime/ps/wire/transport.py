"""gRPC transport: each call carries one :mod:`.codec` message, tensors as raw bytes.

Generic handlers with identity (de)serializers: no protobuf schema to compile, and
tensor bytes are never re-encoded. Message size limits are lifted (a dense pull of a
large model is one message).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent import futures

import grpc

from ..progress import UNCOUNTED, ServingProgress
from ..serving.hosting import IncompletePush, NotServing
from ..serving.server import ParameterServer
from .codec import Header, Tensors, decode, encode

SERVICE = "ringwright.ps.ParameterServer"
METHODS = ("Init", "Status", "Pull", "Stage", "Push", "Lease", "Replicate", "Journal",
           "Promote", "Finish")
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


def _handlers(ps: ParameterServer) -> dict[str, Handler]:
    def only(header: Header) -> tuple[Header, Tensors]:
        return header, {}

    return {
        "Init": lambda h, t: only(ps.init(h, t)),
        "Status": lambda h, t: only(ps.status()),
        "Pull": ps.pull,
        "Stage": lambda h, t: only(ps.stage(h, t)),
        "Push": lambda h, t: only(ps.push(h, t)),
        "Lease": lambda h, t: only(ps.lease(h)),
        "Replicate": lambda h, t: only(ps.replicate(h, t)),
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


def serve(ps: ParameterServer, address: str, *, threads: int = 32,
          cpus: list[int] | None = None,
          progress: ServingProgress | None = None) -> tuple[grpc.Server, int]:
    """Start serving ``ps`` on ``address`` (host:port; port 0 lets the system pick a free
    one), threads pinned to ``cpus``, each request counted in ``progress``; the server
    and the port it listens on."""
    handlers = _handlers(ps)

    def wrap(name: str, fn: Handler) -> Callable[[bytes, grpc.ServicerContext], bytes]:
        counted = progress if name not in UNCOUNTED else None

        def call(request: bytes, context: grpc.ServicerContext) -> bytes:
            if counted is not None:
                counted.started()
            try:
                reply = fn(*decode(request))
            except NotServing as exc:
                context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
            except IncompletePush as exc:
                context.abort(grpc.StatusCode.ABORTED, str(exc))
            except (KeyError, ValueError) as exc:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{type(exc).__name__}: {exc}")
            finally:
                if counted is not None:
                    counted.finished()
            return reply if isinstance(reply, bytes) else encode(*reply)

        return call

    method_handlers: dict[str, grpc.RpcMethodHandler[bytes, bytes]] = {
        name: grpc.unary_unary_rpc_method_handler(wrap(name, fn)) for name, fn in handlers.items()}
    pool = futures.ThreadPoolExecutor(
        max_workers=threads, thread_name_prefix=f"ps{ps.index}",
        initializer=pin_thread(cpus) if cpus else None)
    server = grpc.server(pool, options=SERVER_OPTIONS)
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(SERVICE,
                                                                          method_handlers)])
    port = server.add_insecure_port(address)
    if port == 0:
        raise OSError(f"cannot listen on {address}")
    server.start()
    return server, port


class Stub:
    """Calls to one parameter server."""

    def __init__(self, address: str, detect_s: float = DETECT_S) -> None:
        self.address = address
        self.channel = grpc.insecure_channel(address, options=channel_options(detect_s))
        self._calls: dict[str, grpc.UnaryUnaryMultiCallable[bytes, bytes]] = {
            name: self.channel.unary_unary(f"/{SERVICE}/{name}") for name in METHODS}

    def call(self, method: str, header: Header, tensors: Tensors | None = None,
             timeout: float | None = None) -> tuple[Header, Tensors]:
        """One blocking call."""
        reply: bytes = self._calls[method](encode(header, tensors), timeout=timeout)
        return decode(reply)

    def start(self, method: str, header: Header, tensors: Tensors | None = None,
              timeout: float | None = None) -> grpc.Future[bytes]:
        """Start a call; :func:`result` of the returned future gives the reply."""
        return self._calls[method].future(encode(header, tensors), timeout=timeout)

    def close(self) -> None:
        self.channel.close()


def result(future: grpc.Future[bytes]) -> tuple[Header, Tensors]:
    """The decoded reply of a call started with :meth:`Stub.start`."""
    reply: bytes = future.result()
    return decode(reply)

