"""What one CUDA device can prove of the NCCL path (marked ``gpu``; skipped without CUDA).

NCCL needs one GPU per rank, so a single device holds worlds of one: enough for the
group's whole life (created, used, aborted through torch's abort path, created again),
the state of CUDA tensors and generators across commits, rollbacks, world changes and
checkpoints, a GradScaler through all of these, and the gradient buckets on CUDA
tensors. Multi-rank NCCL runs are in ``test_faults_gpu.py`` (two or more devices).
"""

from __future__ import annotations

import gc
import resource
import signal
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from ringwright.runtime.checkpoint.checkpointer import Checkpointer
from ringwright.runtime.checkpoint.policy import CheckpointPolicy
from ringwright.runtime.checkpoint.storage import LocalStorage
from ringwright.runtime.collectives.backend import CollectiveError
from ringwright.runtime.collectives.buckets import BucketSettings, Compression
from ringwright.runtime.collectives.torch_backend import TorchDistributedBackend
from ringwright.runtime.elastic import ElasticRuntime
from ringwright.runtime.local.launcher import LocalJob, free_port
from ringwright.runtime.sampler import ElasticSampler
from ringwright.runtime.settings import RuntimeSettings
from ringwright.runtime.state import State
from ringwright.world import JobRef, Member, ReportKind, StoreAddress, World
from tests.runtime.elastic_traces import Traces
from tests.runtime.test_elastic_checkpoint import (
    DEADLINE_S,
    WORKER,
    saved_model_hash,
    wait_until,
)
from tests.runtime.test_elastic_checkpoint import env as checkpoint_env
from tests.unit.runtime.runtime_fakes import FakeReporter, FakeSource

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(240)]

ME = "w-0"
SAMPLES, BATCH, EPOCHS = 64, 4, 2
CYCLES = 20
MiB = 2**20


@pytest.fixture()
def cuda() -> torch.device:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device (NCCL, CUDA generators, pinned-memory snapshots)")
    return torch.device("cuda", 0)


def alone(generation: int, port: int) -> World:
    return World(job=JobRef(namespace="gpu", name="j"), generation=generation,
                 members=(Member(rank=0, pod=ME, ip="127.0.0.1"),),
                 store=StoreAddress(address="127.0.0.1", port=port))


def never() -> bool:
    return False


def device_free_bytes() -> int:
    torch.cuda.synchronize()
    free, _ = torch.cuda.mem_get_info()
    return free


def test_nccl_group_created_used_aborted_and_created_again_without_leaks(
        cuda: torch.device) -> None:
    backend = TorchDistributedBackend(cuda, RuntimeSettings(collective_timeout_s=60,
                                                            group_init_timeout_s=60))
    assert backend.name == "nccl"
    port = free_port()
    model = torch.nn.Linear(256, 256).to(cuda)
    free_after: dict[int, int] = {}
    rss_after: dict[int, int] = {}
    try:
        for cycle in range(CYCLES):
            backend.init(alone(cycle, port), 0, never, print)
            flat = torch.full((1 << 20,), float(cycle), device=cuda)
            backend.allreduce_(flat, "cycle")
            assert torch.equal(flat, torch.full_like(flat, float(cycle)))
            for p in model.parameters():
                p.grad = torch.ones_like(p)
            backend.allreduce_gradients(model.parameters(), average=True)
            assert all(p.grad is not None and bool((p.grad == 1).all())
                       for p in model.parameters())
            assert backend.allreduce_max(cycle) == cycle
            # What the heartbeat thread does when a peer dies: ncclCommAbort through
            # the process group; the next collective must fail, not hang.
            backend.abort(f"cycle {cycle}")
            with pytest.raises(RuntimeError) as failed:
                backend.allreduce_(flat, "after abort")
                torch.cuda.synchronize()
            assert isinstance(backend.failure_of(failed.value), CollectiveError)
            backend.shutdown()
            del flat, failed
            gc.collect()
            free_after[cycle] = device_free_bytes()
            rss_after[cycle] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    finally:
        backend.close()
    # The first cycles warm NCCL and the caching allocator up; after that every
    # cycle must give back what it took (a leaked communicator holds its buffers).
    lost = free_after[4] - free_after[CYCLES - 1]
    grown = rss_after[CYCLES - 1] - rss_after[4]
    print(f"device memory lost over cycles 5..{CYCLES}: {lost / MiB:.1f} MiB; "
          f"peak RSS grew {grown / MiB:.1f} MiB")
    assert lost <= 64 * MiB, f"{lost / MiB:.0f} MiB of device memory not given back"
    assert grown <= 256 * MiB, f"host memory grew {grown / MiB:.0f} MiB"


def cuda_state(cuda: torch.device, *, buckets: BucketSettings | None = None,
               checkpointer: Checkpointer | None = None) -> State:
    torch.manual_seed(7)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Dropout(0.25),
                                torch.nn.Linear(32, 1)).to(cuda)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cuda", init_scale=2.0**12, growth_interval=3)
    # Checkpoints only when a test asks for one.
    return State(model, optimizer, ElasticSampler(SAMPLES, BATCH, seed=3), scaler=scaler,
                 buckets=buckets, checkpointer=checkpointer,
                 checkpoint_policy=CheckpointPolicy())


class Trainer:
    """fp16 autocast with a GradScaler and CUDA dropout; a hook may act after a step."""

    def __init__(self, cuda: torch.device) -> None:
        self.cuda = cuda
        self.hooks: dict[int, Callable[[State], None]] = {}
        self.starts: list[int] = []
        self.draws: dict[int, float] = {}
        self.scales: dict[int, float] = {}

    def __call__(self, state: State) -> int:
        self.starts.append(state.step)
        scaler = state.objects["scaler"]
        assert isinstance(scaler, torch.amp.GradScaler)
        data = torch.linspace(-1, 1, SAMPLES * 16, device=self.cuda).reshape(SAMPLES, 16)
        while state.sampler.epoch < EPOCHS:
            idx = state.sampler.batch()
            state.optimizer.zero_grad()
            with torch.autocast("cuda", dtype=torch.float16):
                loss = state.model(data[idx]).square().mean()
            # An overflow every 5th step: the scaler must skip it and halve its scale,
            # the same way in every replay.
            factor = float("inf") if state.step % 5 == 4 else 1.0
            scaler.scale(loss * factor).backward()
            state.allreduce_gradients()
            scaler.step(state.optimizer)
            scaler.update()
            state.advance()
            self.draws[state.step] = float(torch.rand((), device=self.cuda))
            self.scales[state.step] = scaler.get_scale()
            hook = self.hooks.pop(state.step, None)
            if hook is not None:
                hook(state)
            if state.step % 4 == 0:
                state.commit()
        return state.step


def train(cuda: torch.device, trainer: Trainer, state: State,
          on_report: Callable[[ReportKind, int], None] | None = None,
          source: FakeSource | None = None) -> tuple[ElasticRuntime, FakeReporter]:
    source = source or FakeSource()
    port = free_port()
    if source.latest() is None:
        source.publish(alone(0, port))
    reporter = FakeReporter(on_report=on_report)
    rt = ElasticRuntime(source, ME, reporter=reporter,
                        settings=RuntimeSettings(world_wait_timeout_s=30, fence_timeout_s=20,
                                                 collective_timeout_s=60))
    with rt:
        assert rt.run(trainer, state) == EPOCHS * SAMPLES // BATCH
    return rt, reporter


def weights(state: State) -> list[torch.Tensor]:
    return [p.detach().cpu() for p in state.model.parameters()]


@pytest.mark.parametrize("buckets", [None, BucketSettings(bucket_bytes=1024),
                                     BucketSettings(bucket_bytes=1024,
                                                    compression=Compression.BF16)],
                         ids=["flat", "buckets", "bf16-buckets"])
def test_gradscaler_cuda_rng_and_buckets_across_rollback_and_world_change(
        cuda: torch.device, buckets: BucketSettings | None) -> None:
    reference = cuda_state(cuda, buckets=buckets)
    plain = Trainer(cuda)
    train(cuda, plain, reference)

    state = cuda_state(cuda, buckets=buckets)
    faulty = Trainer(cuda)
    source = FakeSource()
    port = free_port()
    source.publish(alone(0, port))
    # Step 6: a planned world change, taken at the commit of step 8 (a new NCCL group,
    # no rollback). Step 10: the group is aborted as on a dead peer; the next
    # collective fails and the state rolls back to the commit of step 8.
    faulty.hooks[6] = lambda s: source.publish(alone(1, port))

    def abort(s: State) -> None:
        s.binding.backend.abort("a peer was found dead")

    faulty.hooks[10] = abort

    def operator(kind: ReportKind, generation: int) -> None:
        if kind is ReportKind.COLLECTIVE_FAILED:
            source.publish(alone(generation + 1, port))

    _, reporter = train(cuda, faulty, state, on_report=operator, source=source)
    assert faulty.starts == [0, 8, 8], "switched at step 8, then rolled back to it"
    assert [k for k, _, _ in reporter.reports] == [ReportKind.COLLECTIVE_FAILED]
    scaler, expected = state.objects["scaler"], reference.objects["scaler"]
    assert isinstance(scaler, torch.amp.GradScaler)
    assert isinstance(expected, torch.amp.GradScaler)
    assert scaler.state_dict() == expected.state_dict()
    assert faulty.scales == plain.scales
    assert any(plain.scales[s + 1] < plain.scales[s] for s in range(1, len(plain.scales))), \
        "an overflow step was skipped and the scale backed off"
    assert faulty.draws == plain.draws, "the CUDA generator replays from the commit"
    for got, want in zip(weights(state), weights(reference), strict=True):
        assert torch.equal(got, want)


def test_cuda_state_checkpointed_and_restored_into_a_new_process_state(
        cuda: torch.device, tmp_path: Path) -> None:
    first = cuda_state(cuda, checkpointer=Checkpointer(LocalStorage(tmp_path)))
    trainer = Trainer(cuda)

    def checkpoint(s: State) -> None:
        assert s.save_checkpoint(writer=True) and s.checkpoints is not None
        assert s.checkpoints.flush(timeout=60)

    trainer.hooks[9] = checkpoint  # writes the commit of step 8
    train(cuda, trainer, first)

    second = cuda_state(cuda, checkpointer=Checkpointer(LocalStorage(tmp_path)))
    with torch.no_grad():
        for p in second.model.parameters():
            p.zero_()
    assert second.restore_checkpoint()
    assert second.step == 8
    assert all(p.is_cuda for p in second.model.parameters())
    assert all(t.is_cuda for s in second.optimizer.state.values() for t in s.values()
               if isinstance(t, torch.Tensor) and t.dim() > 0)
    # Resuming from the checkpoint trains the same steps to the same weights.
    resumed = Trainer(cuda)
    train(cuda, resumed, second)
    assert resumed.starts == [8]
    for step in range(9, EPOCHS * SAMPLES // BATCH + 1):
        assert resumed.draws[step] == trainer.draws[step]
    for got, want in zip(weights(second), weights(first), strict=True):
        assert torch.equal(got, want)


def test_sigterm_flushes_a_gpu_state_and_a_fresh_job_resumes_it_identically(
        cuda: torch.device, tmp_path: Path) -> None:
    """Real worker processes: the one NCCL member gets SIGTERM, writes its CUDA state
    through pinned memory, exits 143; a new job resumes there with identical weights."""
    checkpoints = tmp_path / "checkpoints"
    first = tmp_path / "first"

    def job_env(trace: Path) -> dict[str, str]:
        return {**checkpoint_env(trace, checkpoints), "CUDA": "1"}

    with LocalJob([sys.executable, str(WORKER)], first, env=job_env(first / "trace")) as job:
        job.start(1)
        wait_until("training past step 9", lambda: max(
            (r["step"] for _, r in Traces.load(first / "trace").events("stepped")),
            default=0) >= 9)
        (pod,) = [m.pod for m in job.world.members]
        job.kill(pod, signal.SIGTERM)
        codes = job.wait(DEADLINE_S)
    assert codes[pod] == 128 + signal.SIGTERM, codes
    (final,) = [r for _, r in Traces.load(first / "trace").events("terminated")]
    assert final["flushed"]
    restored = Checkpointer(LocalStorage(checkpoints)).restore_latest()
    assert restored is not None and restored.payload["step"] == final["step"] >= 9
    assert saved_model_hash(restored.payload) == final["hash"]

    second = tmp_path / "second"
    with LocalJob([sys.executable, str(WORKER)], second,
                  env=job_env(second / "trace")) as job:
        job.start(1)
        codes = job.wait(DEADLINE_S)
    assert set(codes.values()) == {0}, codes
    starts = Traces.load(second / "trace").starts(0)
    assert {(r["step"], r["hash"]) for r in starts.values()} == {(final["step"], final["hash"])}
