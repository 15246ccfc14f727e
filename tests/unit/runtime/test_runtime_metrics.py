"""Runtime metrics: steps timed within a world, a failure plus the next world is a
recovery, collectives and checkpoint writes counted; fed through the elastic loop."""

from __future__ import annotations

import urllib.request

import pytest
import torch
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from ringwright.runtime.checkpoint.checkpointer import CheckpointWritten
from ringwright.runtime.elastic import ElasticRuntime
from ringwright.runtime.local.launcher import free_port
from ringwright.runtime.metrics import RuntimeMetrics
from ringwright.runtime.sampler import ElasticSampler
from ringwright.runtime.settings import RuntimeSettings
from ringwright.runtime.state import State
from ringwright.world import Env, ReportKind
from tests.unit.runtime.runtime_fakes import FakeBackend, FakeReporter, FakeSource, make_world

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def samples(metrics: RuntimeMetrics) -> Samples:
    text = generate_latest(metrics.registry).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_steps_are_timed_within_a_world_and_a_commit_is_not_a_step() -> None:
    clock = Clock()
    m = RuntimeMetrics(clock=clock)
    m.world_ready(make_world(1, ["a", "b"]), 0, 1.0)
    m.step_done(1, 8, 1.0)  # the first step of a world only sets the baseline
    clock.now += 0.5
    m.step_done(2, 16, 1.0)
    clock.now += 0.2
    m.step_done(2, 16, 1.0)  # the commit after step 2
    clock.now += 0.3
    m.step_done(3, 24, 0.5)
    got = samples(m)
    assert got[("ringwright_runtime_step_seconds_count", ())] == 2
    assert got[("ringwright_runtime_step_seconds_sum", ())] == pytest.approx(1.0)
    assert got[("ringwright_runtime_samples_total", ())] == 16
    assert got[("ringwright_runtime_samples_per_second", ())] == pytest.approx(16.0)
    assert got[("ringwright_runtime_lr_factor", ())] == 0.5
    assert got[("ringwright_runtime_world_size", ())] == 2


def test_a_rollback_then_the_next_world_is_one_recovery() -> None:
    clock = Clock()
    m = RuntimeMetrics(clock=clock)
    m.world_ready(make_world(1, ["a", "b"]), 1, 1.0)
    m.step_done(5, 40, 1.0)
    clock.now += 1.0
    m.rolled_back("collective_failed", 3)
    clock.now += 2.5
    m.world_ready(make_world(2, ["a"]), 0, 0.5)
    clock.now += 1.0
    m.step_done(3, 24, 0.5)  # after the rollback: a new baseline, not a negative step
    m.world_ready(make_world(3, ["a", "b"]), 0, 1.0)  # a planned change: no recovery
    got = samples(m)
    cause = (("cause", "collective_failed"),)
    assert got[("ringwright_runtime_recoveries_total", cause)] == 1
    assert got[("ringwright_runtime_recovery_seconds_sum", cause)] == pytest.approx(2.5)
    assert got[("ringwright_runtime_rollbacks_total", ())] == 1
    assert got[("ringwright_runtime_steps_lost_total", ())] == 3
    assert got[("ringwright_runtime_world_generation", ())] == 3
    assert got[("ringwright_runtime_step_seconds_count", ())] == 0


def test_checkpoint_writes_are_counted() -> None:
    m = RuntimeMetrics()
    m.checkpoint_written(CheckpointWritten(step=10, nbytes=4096, stall_s=0.01, write_s=0.2))
    got = samples(m)
    assert got[("ringwright_runtime_checkpoint_bytes_total", ())] == 4096
    assert got[("ringwright_runtime_checkpoint_write_seconds_sum", ())] == pytest.approx(0.2)
    assert got[("ringwright_runtime_checkpoint_stall_seconds_count", ())] == 1


def test_the_elastic_loop_feeds_steps_collectives_and_a_recovery() -> None:
    source, backend = FakeSource(), FakeBackend()
    backend.fail_gradients_at = {7}
    source.publish(make_world(0, ["w-0"]))

    def operator(kind: ReportKind, generation: int) -> None:
        if kind is ReportKind.COLLECTIVE_FAILED:
            source.publish(make_world(generation + 1, ["w-0"]))

    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1)
    state = State(model, torch.optim.SGD(model.parameters(), lr=0.1), ElasticSampler(24, 4))

    def train(state: State) -> None:
        while state.sampler.epoch < 2:
            state.optimizer.zero_grad()
            state.model(torch.ones(len(state.sampler.batch()), 2)).sum().backward()
            state.allreduce_gradients()
            state.optimizer.step()
            state.advance()
            if state.step % 4 == 0:
                state.commit()

    port = free_port()
    settings = RuntimeSettings(world_wait_timeout_s=5, metrics_port=port,
                               metrics_address="127.0.0.1")
    with ElasticRuntime(source, "w-0", settings=settings, reporter=FakeReporter(operator),
                        backend_factory=lambda kind, dev, s: backend) as rt:
        rt.run(train, state)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics") as resp:
            text = resp.read().decode()
    got = {(s.name, tuple(sorted(s.labels.items()))): s.value
           for family in text_string_to_metric_families(text) for s in family.samples}
    assert got[("ringwright_runtime_recoveries_total", (("cause", "collective-failed"),))] == 1
    assert got[("ringwright_runtime_steps_lost_total", ())] == 2  # step 6 back to 4
    assert got[("ringwright_runtime_world_generation", ())] == 1
    assert got[("ringwright_runtime_step", ())] == 12
    grads = (("op", "allreduce_gradients"),)
    assert got[("ringwright_runtime_collective_seconds_count", grads)] == backend.gradient_calls
    assert got[("ringwright_runtime_step_seconds_count", ())] > 0



def test_the_pod_environment_puts_metrics_on_the_pod_ip() -> None:
    settings = RuntimeSettings.from_env({Env.METRICS_PORT: "9401", Env.POD_IP: "10.1.2.3"})
    assert (settings.metrics_port, settings.metrics_address) == (9401, "10.1.2.3")
    assert RuntimeSettings.from_env({}).metrics_port == 0
