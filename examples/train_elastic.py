"""Elastic training with ringwright: a small regression model that survives failures.

On this machine, with a local launcher playing the operator::

    python -m ringwright.runtime.local.launcher --workers 3 --base-world-size 3 \\
        -- python examples/train_elastic.py --epochs 30

then ``kill -9`` one worker: the others roll back to their last commit, rebuild the
ring at size 2, rescale the learning rate (``--base-world-size 3``: linear scaling for
3 workers; without it the rate is never changed) and carry on. ``kill -USR1 <launcher pid>``
adds a worker, which receives the state by broadcast; ``kill -USR2`` removes one.

In a Kubernetes pod the operator sets the ``RINGWRIGHT_*`` environment and the
script needs no arguments. Without any of it (``python examples/train_elastic.py``,
under a debugger) the script trains alone, as a world of one. Checkpoints follow the
job's ``spec.checkpoint`` (path, interval, keep; locally the launcher's
``--checkpoint-path``): the runtime writes them and a restarted job resumes from the
newest, with no checkpoint code here.
"""

from __future__ import annotations

import argparse
import logging
import sys

import torch

from ringwright.runtime import ElasticRuntime, ElasticSampler, State
from ringwright.runtime.kvlog import log_event, runtime_logger

log = runtime_logger("example")


def synthetic_dataset(samples: int, features: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and targets of a noisy linear function, identical on every worker."""
    gen = torch.Generator().manual_seed(0)
    xs = torch.randn(samples, features, generator=gen)
    ys = xs @ torch.randn(features, 1, generator=gen) + 0.05 * torch.randn(samples, 1,
                                                                            generator=gen)
    return xs, ys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--samples", type=int, default=4096)
    parser.add_argument("--batch-size", type=int, default=32, help="per worker")
    parser.add_argument("--lr", type=float, default=0.01,
                        help="as tuned; rescaled with the world only when the job's "
                        "lrScaling asks for it")
    parser.add_argument("--commit-every", type=int, default=10, help="steps")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stdout,
                        format="%(asctime)s %(name)s %(message)s")

    device = torch.device(args.device)
    xs, ys = synthetic_dataset(args.samples, 16)
    xs, ys = xs.to(device), ys.to(device)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(),
                                torch.nn.Linear(64, 1)).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    state = State(model, optimizer, ElasticSampler(args.samples, args.batch_size, seed=1),
                  extra={"best_loss": float("inf")})

    def train(state: State) -> None:
        while state.sampler.epoch < args.epochs:
            epoch = state.sampler.epoch
            global_batch = len(state.sampler.global_positions())
            indices = state.sampler.batch()
            optimizer.zero_grad()
            if indices:
                # Divide by the global batch: summed over workers this is the mean loss,
                # however the batch was split.
                loss = torch.nn.functional.mse_loss(
                    model(xs[indices]), ys[indices], reduction="sum") / global_batch
                torch.autograd.backward(loss)
            state.allreduce_gradients(average=False)
            optimizer.step()
            state.advance()
            if state.sampler.epoch != epoch:
                # Every worker holds the same model, so each can evaluate it alike. An
                # evaluation that outlasts stallTimeoutSeconds is no stall inside busy().
                with state.busy(), torch.no_grad():
                    full_loss = float(torch.nn.functional.mse_loss(model(xs), ys))
                state.extra["best_loss"] = min(state.extra["best_loss"], full_loss)
                if state.rank == 0:
                    log_event(log, logging.INFO, "epoch_done", epoch=epoch, step=state.step,
                              world_size=state.world_size,
                              lr=state.lr.scaled_lrs()[0], loss=full_loss,
                              best_loss=state.extra["best_loss"])
                state.commit()
            elif state.step % args.commit_every == 0:
                state.commit()

    with ElasticRuntime.from_env() as runtime:
        runtime.run(train, state)
        state.save_checkpoint()  # the last commit; written before the runtime closes
    return 0


if __name__ == "__main__":
    sys.exit(main())
