"""PS metrics: the server core's pushes, pulls and staleness in a real registry, and
serving them on the pod's metrics port."""

from __future__ import annotations

import urllib.request

import torch
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from ringwright.runtime.local.launcher import free_port
from ringwright.runtime.ps.metrics import PSMetrics, serve_from_env
from ringwright.runtime.ps.partition import TensorSpec
from ringwright.runtime.ps.serving.consistency import Consistency, Mode
from ringwright.runtime.ps.serving.hosting import JobConfig
from ringwright.runtime.ps.serving.optim import ServerOptimizer
from ringwright.runtime.ps.serving.server import ParameterServer
from ringwright.runtime.ps.serving.shard import initial_values
from ringwright.world import Env

SPECS = (TensorSpec("w", (4, 3)),)


def _server(registry: CollectorRegistry, tau: int) -> ParameterServer:
    config = JobConfig(SPECS, 1, ServerOptimizer(lr=0.1), Consistency(Mode.ASYNC, tau=tau),
                       {"samples": 100, "pieceSize": 10, "epochs": 1})
    ps = ParameterServer(0, metrics=PSMetrics(registry))
    ps.init({"shard": 0, "config": config.to_json()},
            initial_values(config.partition(), 0, {"w": torch.zeros(4, 3)}))
    ps.set_workers(frozenset({"a"}))
    return ps


def _push(ps: ParameterServer, version: int, *, skip: bool = False) -> object:
    header = {"shard": 0, "worker": "a", "version": version, **({"skip": True} if skip else {})}
    return ps.push(header, {} if skip else {"g/w@0": torch.ones(12)})["verdict"]


def test_the_server_core_counts_pushes_pulls_staleness_and_drops() -> None:
    registry = CollectorRegistry()
    ps = _server(registry, tau=1)
    # Every push computed from version 0: staleness 0 and 1 apply, then 2 > tau drops.
    assert [_push(ps, 0) for _ in range(4)] == ["apply", "apply", "stale", "stale"]
    assert _push(ps, 0, skip=True) == "stale"
    ps.pull({"shard": 0, "dense": True}, {})

    def value(name: str, **labels: str) -> float | None:
        return registry.get_sample_value(name, labels)

    assert value("ringwright_ps_pushes_total", shard="0", verdict="apply") == 2
    assert value("ringwright_ps_pushes_total", shard="0", verdict="stale") == 3
    assert value("ringwright_ps_stale_gradients_dropped_total", shard="0") == 2, \
        "a skip push carries no gradient to drop"
    assert value("ringwright_ps_pulls_total", shard="0") == 1
    assert value("ringwright_ps_push_staleness_count") == 2
    assert value("ringwright_ps_push_staleness_sum") == 1
    assert value("ringwright_ps_push_staleness_bucket", le="0.0") == 1


def test_worker_steps_and_their_dropped_pushes() -> None:
    metrics = PSMetrics(CollectorRegistry())
    metrics.worker_step(dropped=False)
    metrics.worker_step(dropped=True)
    assert metrics.registry.get_sample_value("ringwright_ps_worker_steps_total") == 2
    assert metrics.registry.get_sample_value("ringwright_ps_worker_steps_dropped_total") == 1


def test_served_on_the_metrics_port_only_when_one_is_set() -> None:
    metrics = PSMetrics(CollectorRegistry())
    metrics.pulled(3)
    assert serve_from_env(metrics, {}) is None
    port = free_port()
    endpoint = serve_from_env(metrics, {Env.METRICS_PORT: str(port), Env.POD_IP: "127.0.0.1"})
    assert endpoint is not None
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics") as resp:
            text = resp.read().decode()
    finally:
        endpoint.stop()
    got = {(s.name, tuple(sorted(s.labels.items()))): s.value
           for family in text_string_to_metric_families(text) for s in family.samples}
    assert got[("ringwright_ps_pulls_total", (("shard", "3"),))] == 1
