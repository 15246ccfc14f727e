"""Reading a running parameter-server job's model beside its workers.

An evaluator (TensorFlow's parameter-server jobs have such a task) pulls the current
parameters that a held-out batch reads and scores them. It pushes nothing, holds no data
lease and counts in no sync round, so training goes on as it would without it; its
pulls cost the servers what a worker's pull costs.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Generic, TypeVar

from .model import PSModel
from .serving.hosting import Role
from .wire.client import PSClient
from .wire.routing import RecoverySettings, ShardView
from .worker import PSJob, batch_ids

B = TypeVar("B")


class Evaluator(Generic[B]):
    """Loads the servers' current parameters into ``job.model`` for a batch."""

    def __init__(self, job: PSJob[B], addresses: Sequence[str], *, name: str = "evaluator",
                 recovery: RecoverySettings | None = None) -> None:
        """``addresses``: the servers', in shard order (:func:`.env.ps_addresses`);
        ``name``: how the servers log this client (not a worker of the world)."""
        self.job = job
        self.binding = PSModel(job.model, job.table_init_std)
        self.client = PSClient(addresses, name, recovery=recovery)

    def connect(self, timeout: float, poll: float = 0.2) -> None:
        """Wait until the job's shards exist (its first worker creates them) and learn
        where each is served. The evaluator creates nothing: the shards take their
        consistency and data plan from the workers, never from it."""
        deadline = time.monotonic() + timeout
        self.client.wait_ready(timeout)
        while not ((shards := self.client.shard_count())
                   and _every_shard_served(self.client.views(5.0), shards)):
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"the job's shards were not all served within {timeout:.0f} s: a "
                    f"worker creates them when it starts; is one running?")
            time.sleep(poll)
        self.client.attach(self.job.config(shards, self.binding.specs()))
        self.binding.release_tables()

    def load(self, batch: B) -> dict[int, int]:
        """Pull the parameters ``batch`` reads into ``job.model`` (dense parameters and
        the batch's embedding rows). Returns the version of every shard read: updates
        applied so far."""
        pulled = self.client.pull(batch_ids(self.job, self.binding, batch),
                                  self.binding.dense_targets())
        self.binding.load(pulled.dense, pulled.rows)
        return dict(pulled.versions)

    def close(self) -> None:
        """Close the connections to the servers."""
        self.client.close()


def _every_shard_served(views: Sequence[ShardView | None], shards: int) -> bool:
    return all(any(v is not None and v.get(s, ("", 0))[0] == Role.PRIMARY for v in views)
               for s in range(shards))
