"""``python -m ringwright.operator``: run the operator against the current kubeconfig."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import socket
import sys
import threading
import uuid
from typing import Any

import kopf

from ringwright.exposition import serve
from ringwright.kube import KubeClient, KubeConfig, default_config

from .handlers import OperatorContext, register
from .heap import HEAP_SETTLE_SECONDS, HEAP_SWEEP_EVERY, keep_heap
from .leader import LeaderElector
from .settings import OperatorSettings
from .standby import standby_health


def _connection(config: KubeConfig) -> kopf.ConnectionInfo:
    return kopf.ConnectionInfo(
        server=config.server,
        ca_path=config.ca_file or None,
        insecure=config.insecure,
        token=config.token or None,
        certificate_path=config.client_cert_file or None,
        private_key_path=config.client_key_file or None,
        default_namespace=config.namespace,
    )


def main(argv: list[str] | None = None) -> int:
    """Parse flags, build the context and run kopf until interrupted."""
    parser = argparse.ArgumentParser(prog="ringwright-operator", description=__doc__)
    parser.add_argument("--namespace", "-n", action="append", default=[],
                        help="watch only this namespace (repeatable); default: all")
    parser.add_argument("--liveness", default="",
                        help="serve kopf's liveness endpoint, e.g. http://0.0.0.0:8080/healthz")
    parser.add_argument("--metrics-port", type=int, default=0,
                        help="serve Prometheus metrics on this port at /metrics; 0: off")
    parser.add_argument("--metrics-address", default="0.0.0.0",
                        help="address the metrics server binds")
    parser.add_argument("--verbose", action="store_true")
    parser.add_argument("--lease-namespace", default=os.environ.get("POD_NAMESPACE", ""),
                        help="namespace of the leader-election Lease (default: $POD_NAMESPACE, "
                        "else the kubeconfig's namespace)")
    parser.add_argument("--lease-name", default="ringwright-operator",
                        help="name of the leader-election Lease")
    parser.add_argument("--lease-seconds", type=float, default=15.0,
                        help="a standby takes over after the leader missed renewing this long")
    parser.add_argument("--no-leader-election", action="store_true",
                        help="act at once, without a Lease (only ever one replica)")
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s %(message)s",
    )
    if not args.verbose:
        # One line per API request drowns the decisions; --verbose brings them back.
        logging.getLogger("urllib3").setLevel(logging.WARNING)
        logging.getLogger("kopf.objects").setLevel(logging.WARNING)
    config = default_config()
    kube = KubeClient(config)
    # Jobs' NetworkPolicies admit the operator's namespace: the Lease's, unless set.
    env = {"RINGWRIGHT_OPERATOR_NAMESPACE": args.lease_namespace, **os.environ}
    ctx = OperatorContext(kube=kube, settings=OperatorSettings.from_env(env))
    if args.metrics_port:
        serve(ctx.metrics.registry, args.metrics_port, args.metrics_address)
    elector: LeaderElector | None = None
    if not args.no_leader_election:
        elector = LeaderElector(kube, args.lease_namespace or config.namespace, args.lease_name,
                                f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}",
                                lease_seconds=args.lease_seconds,
                                renew_seconds=args.lease_seconds / 3)
        with standby_health(args.liveness):
            elector.acquire(threading.Event())
        elector.keep_in_background(_lost_lease)
    threading.Thread(target=keep_heap, args=(threading.Event(), HEAP_SETTLE_SECONDS,
                                             HEAP_SWEEP_EVERY), daemon=True, name="heap").start()
    registry = kopf.OperatorRegistry()
    register(registry, kueue=ctx.settings.kueue)

    @kopf.on.login(registry=registry)
    def login(**_: Any) -> kopf.ConnectionInfo:
        # kopf calls this again whenever the server answers 401: loading the config anew
        # re-runs an exec plugin and re-reads a rotated token file.
        return _connection(config.reloaded())

    asyncio.run(kopf.operator(
        registry=registry,
        memo=kopf.Memo(ctx=ctx),
        standalone=True,
        clusterwide=not args.namespace,
        namespaces=args.namespace,
        liveness_endpoint=args.liveness or None,
    ))
    # kopf returns on SIGTERM/SIGINT once its handlers are done: nothing acts after this.
    if elector is not None:
        elector.release()
    return 0


def _lost_lease() -> None:
    # Another replica may act from now on: stop this one at once, in the middle of
    # whatever it does, rather than finish a round on stale leadership.
    logging.getLogger("ringwright.operator").error("lost the leader lease; exiting")
    logging.shutdown()
    os._exit(1)


if __name__ == "__main__":
    sys.exit(main())
