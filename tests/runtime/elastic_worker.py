"""A real training worker for the local multi-process tests and the recovery benchmark.

It trains a small regression model with the elastic runtime, following the world file
given by the launcher, and appends one JSON line per event to
``$TRACE_DIR/<pod>.jsonl``: every step (with the sample indices this rank trained on,
and again once the step completed), every commit, the start of every world (with a
hash of the parameters and the process id) and every interruption of training (the
world ended under it: a failed collective or a new world), so the tests can audit
sample accounting and parameter equality afterwards, tell which world generation trained
each step, and the benchmark can time recoveries and count rollbacks.

Tuning (environment): EPOCHS, SAMPLES, BATCH, COMMIT_EVERY, STEP_SLEEP, and
CHECKPOINT_DIR for checkpoints (a final one on SIGTERM, restored on a fresh start),
BUCKET_BYTES to all-reduce gradients in buckets of that size during backward.
With GATE_FILE and GATE_STEP set, a worker that completes step GATE_STEP waits while
GATE_FILE exists, so a test can make a change happen at a known point of training
without racing it; a gate file that holds a number moves the hold to that step (a test
that kills a member mid-training holds a later step, so the job cannot end first).
PAUSE_RANK, PAUSE_STEP and PAUSE_SECONDS make the member of that rank that completes
that step first sleep once per job (a slow evaluation, a straggler: late, not dead);
PAUSE_FILE (default: in TRACE_DIR) records that it happened.
SIGUSR1 writes every thread's stack to ``$TRACE_DIR/<pod>.stacks`` (a stalled test's report).
SLOW_POD=<pod> and SLOW_FACTOR make that pod's STEP_SLEEP (its stand-in for compute)
SLOW_FACTOR times longer, for good: a throttled GPU.
STEP_SLEEP_FILE: while it exists, the seconds it holds replace STEP_SLEEP, read at every
step (a test that needs a long run until it has seen a fault and a rejoin speeds up the
rest, which only has to be trained once).
USER_ALLREDUCE=1 also sums the loss with the library's own all-reduce inside the
training function, as user code may.
LOADER_WORKERS=N draws each step's samples through a torch ``DataLoader`` with N worker
processes (persistent, prefetching) driven by the elastic sampler; the step's indices
are then the ones the loader delivered. SHARD_SIZES=n0,n1,... (summing to SAMPLES) reads
the samples as leased shards instead (:class:`ElasticShards` and its loader, with
LOADER_WORKERS worker processes, 0 for none).
CUDA=1 trains on GPU ``<pod index> % device count`` (NCCL with the torch backend).
BALLAST_MB adds a buffer of that size to the model: it is not trained, but every state
broadcast carries it, so a test can act while one is under way.
FREEZE_IN_HVD_INIT=<pod>: that pod stops itself (SIGSTOP) on entering ``hvd.init()``
for the first time, after the runtime's join barrier: a peer frozen inside Horovod's
own rendezvous, at a point no test could otherwise hit on purpose.
A slow start (a newcomer pulling its image, importing, starting CUDA): START_DELAY_S
makes every process sleep that long before it sets up its training; a process that
starts while START_GATE_FILE exists records ``launched`` and waits until the file is
gone, so a test can hold a newcomer in its start-up for as long as it needs.
"""

from __future__ import annotations

import faulthandler
import hashlib
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset

from ringwright.runtime.checkpoint.checkpointer import Checkpointer
from ringwright.runtime.checkpoint.storage import LocalStorage
from ringwright.runtime.collectives.buckets import BucketSettings
from ringwright.runtime.data import ElasticShards
from ringwright.runtime.elastic import ElasticRuntime
from ringwright.runtime.sampler import ElasticSampler
from ringwright.runtime.state import State, Terminated
from ringwright.world import Env

FEATURES = 8


def param_hash(model: torch.nn.Module) -> str:
    """Digest of every parameter's bytes: equal on two ranks only if bit-identical."""
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().cpu().numpy().tobytes())
    return h.hexdigest()[:16]


class Trace:
    """Append-only JSON lines; one write per line so a SIGKILL never tears a line."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def write(self, **record: Any) -> None:
        record["t"] = time.time()
        os.write(self._fd, (json.dumps(record) + "\n").encode())


class SampleIndices(Dataset[int]):
    """Sample ``i`` is its index: the trace records what the loader delivered."""

    def __init__(self, samples: int) -> None:
        self.samples = samples

    def __len__(self) -> int:
        return self.samples

    def __getitem__(self, i: int) -> int:
        return i


def pause_once(path: Path, seconds: float) -> bool:
    """Sleep ``seconds`` unless some process of this job already did (``path`` says so)."""
    try:
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
    except FileExistsError:
        return False
    time.sleep(seconds)
    return True


def library_view() -> dict[str, int | str]:
    """Rank, size and name of the collective library as it reports them (user code's view)."""
    if os.environ.get(Env.BACKEND) == "horovod":
        import horovod.torch as hvd  # type: ignore[import-untyped]

        return {"lib_rank": int(hvd.rank()), "lib_size": int(hvd.size()),
                "lib_backend": "horovod"}
    import torch.distributed as dist

    return {"lib_rank": dist.get_rank(), "lib_size": dist.get_world_size(),
            "lib_backend": str(dist.get_backend())}


def user_level_sum(value: torch.Tensor) -> None:
    """A collective the training function makes itself, outside the runtime."""
    if os.environ.get(Env.BACKEND) == "horovod":
        import horovod.torch as hvd

        hvd.allreduce(value, op=hvd.Sum, name="user.loss")
        return
    import torch.distributed as dist

    dist.all_reduce(value)


def freeze_in_horovod_init() -> None:
    """Make ``hvd.init()`` stop this process before it rendezvouses (see the module)."""
    import horovod.torch as hvd

    init = hvd.init

    def frozen_init(*args: Any, **kwargs: Any) -> Any:
        os.kill(os.getpid(), signal.SIGSTOP)
        return init(*args, **kwargs)

    hvd.init = frozen_init


def held_step(gate: Path, default: int) -> int | None:
    """The step the gate holds workers at: none without the file, else the step the
    file names, or ``default`` when it is empty."""
    try:
        text = gate.read_text().strip()
    except FileNotFoundError:
        return None
    return int(text) if text else default


def paced(step_sleep: float, pace: Path) -> float:
    """STEP_SLEEP, or the seconds written in STEP_SLEEP_FILE while it exists."""
    try:
        return float(pace.read_text())
    except (OSError, ValueError):  # none, or caught while being written
        return step_sleep


def slow_start(trace: Trace) -> None:
    """The start-up delays of the module's docstring (START_DELAY_S, START_GATE_FILE)."""
    time.sleep(float(os.environ.get("START_DELAY_S", "0")))
    gate = Path(os.environ.get("START_GATE_FILE", "/nonexistent"))
    if gate.exists():
        trace.write(ev="launched", pid=os.getpid())
        while gate.exists():
            time.sleep(0.02)


def main() -> int:
    pod = os.environ[Env.POD_NAME]
    if os.environ.get("FREEZE_IN_HVD_INIT") == pod:
        freeze_in_horovod_init()
    epochs = int(os.environ.get("EPOCHS", "3"))
    samples = int(os.environ.get("SAMPLES", "192"))
    batch = int(os.environ.get("BATCH", "4"))
    commit_every = int(os.environ.get("COMMIT_EVERY", "4"))
    step_sleep = float(os.environ.get("STEP_SLEEP", "0.03"))
    pace = Path(os.environ.get("STEP_SLEEP_FILE", "/nonexistent"))
    slow = float(os.environ.get("SLOW_FACTOR", "1")) if os.environ.get("SLOW_POD") == pod else 1
    gate = Path(os.environ.get("GATE_FILE", "/nonexistent"))
    gate_step = int(os.environ.get("GATE_STEP", "-1"))
    pause_rank = int(os.environ.get("PAUSE_RANK", "-1"))
    pause_step = int(os.environ.get("PAUSE_STEP", "-1"))
    pause_s = float(os.environ.get("PAUSE_SECONDS", "0"))
    pause_file = Path(os.environ.get("PAUSE_FILE")
                      or Path(os.environ["TRACE_DIR"]) / "paused")
    user_allreduce = os.environ.get("USER_ALLREDUCE") == "1"
    # One trace per process: a pod of several local ranks writes one per rank.
    local = os.environ.get(Env.LOCAL_RANK)
    trace = Trace(Path(os.environ["TRACE_DIR"]) / f"{pod}{'.' + local if local else ''}.jsonl")
    logging.basicConfig(level=logging.INFO, stream=sys.stdout,
                        format=f"%(asctime)s {pod} %(name)s %(message)s")
    # A test that finds the job stalled asks for every thread's stack (SIGUSR1).
    stacks = trace.path.with_suffix(".stacks").open("w")
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
    slow_start(trace)

    data = torch.Generator().manual_seed(1234)
    xs = torch.randn(samples, FEATURES, generator=data)
    ys = xs @ torch.randn(FEATURES, 1, generator=data) + 0.1

    # Different initial weights on every pod: only the state broadcast makes them agree.
    torch.manual_seed(int(hashlib.sha256(pod.encode()).hexdigest()[:8], 16))
    model = torch.nn.Sequential(torch.nn.Linear(FEATURES, 16), torch.nn.Tanh(),
                                torch.nn.Linear(16, 1))
    ballast_mb = int(os.environ.get("BALLAST_MB", "0"))
    if ballast_mb:
        model.register_buffer("ballast", torch.zeros(ballast_mb * 2**20 // 4))
    if os.environ.get("CUDA") == "1":
        device = torch.device("cuda", int(pod.rsplit("-", 1)[1]) % torch.cuda.device_count())
        model, xs, ys = model.to(device), xs.to(device), ys.to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    checkpoint_dir = os.environ.get("CHECKPOINT_DIR", "")
    checkpointer = Checkpointer(LocalStorage(checkpoint_dir)) if checkpoint_dir else None
    bucket_bytes = os.environ.get("BUCKET_BYTES", "")
    buckets = BucketSettings(bucket_bytes=int(bucket_bytes)) if bucket_bytes else None
    loader_workers = int(os.environ.get("LOADER_WORKERS", "0"))
    shard_sizes = [int(n) for n in os.environ.get("SHARD_SIZES", "").split(",") if n]
    sampler = (ElasticShards(shard_sizes, batch, seed=7) if shard_sizes
               else ElasticSampler(samples, batch, seed=7))
    state = State(model, optimizer, sampler, checkpointer=checkpointer, buckets=buckets)
    if checkpointer is not None:
        # Which process wrote which checkpoint: one writer per job is the rule.
        checkpointer.add_listener(lambda written: trace.write(ev="checkpoint_written",
                                                              step=written.step))
    loader: Iterable[Any] | None = None
    if isinstance(sampler, ElasticShards):
        starts = sampler.starts

        def read(shard: int, start: int, stop: int) -> range:
            return range(starts[shard] + start, starts[shard] + stop)

        loader = sampler.loader(read, num_workers=loader_workers,
                                persistent_workers=loader_workers > 0)
    elif loader_workers:
        loader = DataLoader(SampleIndices(samples), batch_sampler=state.sampler,
                            num_workers=loader_workers, persistent_workers=True)

    def steps(state: State) -> Iterator[tuple[int, int, list[int]]]:
        """(data epoch, global batch, this rank's indices) of each step to train."""
        while state.sampler.epoch < epochs:
            if loader is None:
                yield (state.sampler.epoch, len(state.sampler.global_positions()),
                       state.sampler.batch())
                continue
            # A new iteration per epoch and per call of train(): it starts at the
            # committed cursor, whatever the loader's workers had prefetched.
            for loaded in loader:
                # A rank left without samples at an epoch's end gets an empty list.
                yield (state.sampler.epoch, len(state.sampler.global_positions()),
                       loaded.tolist() if isinstance(loaded, torch.Tensor) else [])

    def train(state: State) -> None:
        world = state.binding.world
        trace.write(ev="start", generation=world.generation, size=world.size,
                    rank=state.binding.rank, step=state.step, hash=param_hash(model),
                    lr=state.lr.scaled_lrs()[0], pid=os.getpid(), **library_view())
        try:
            train_in_world(state)
        except BaseException as err:
            trace.write(ev="interrupted", generation=world.generation, rank=state.binding.rank,
                        step=state.step, why=type(err).__name__)
            raise

    def train_in_world(state: State) -> None:
        world = state.binding.world
        for data_epoch, global_batch, indices in steps(state):
            optimizer.zero_grad()
            loss = torch.zeros((), device=xs.device)
            if indices:
                pred = model(xs[indices])
                # Normalised by the global batch, so summed gradients are the global mean.
                loss = ((pred - ys[indices]) ** 2).sum() / global_batch
                loss.backward()
            if user_allreduce:
                user_level_sum(loss.detach().clone())
            # Written before the allreduce: if any rank finished this step, every rank
            # of the world has recorded it.
            trace.write(ev="step", generation=world.generation, rank=state.binding.rank,
                        size=world.size, step=state.step + 1, data_epoch=data_epoch,
                        indices=indices)
            state.allreduce_gradients(average=False)
            optimizer.step()
            state.advance()
            trace.write(ev="stepped", generation=world.generation, rank=state.binding.rank,
                        size=world.size, step=state.step)
            time.sleep(paced(step_sleep, pace) * slow)
            if (state.step == pause_step and state.binding.rank == pause_rank
                    and pause_once(pause_file, pause_s)):
                trace.write(ev="pause", step=state.step, seconds=pause_s)
            while state.step == held_step(gate, gate_step):
                time.sleep(0.02)
            if state.step % commit_every == 0 or state.sampler.epoch != data_epoch:
                try:
                    state.commit()
                finally:
                    trace.write(ev="commit", generation=world.generation, rank=state.binding.rank,
                                step=state.step, hash=param_hash(model))

    with ElasticRuntime.from_env() as runtime:
        try:
            runtime.run(train, state)
        except Terminated as term:
            trace.write(ev="terminated", step=term.step, flushed=term.flushed,
                        rank=state.binding.rank, hash=param_hash(model))
            raise
    trace.write(ev="done", step=state.step, hash=param_hash(model))
    return 0


if __name__ == "__main__":
    sys.exit(main())
