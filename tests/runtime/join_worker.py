"""One process that tries to join a world as ``$RANK`` through the runtime's backend.

Reads its join token the way a pod does (``RINGWRIGHT_JOIN_TOKEN_FILE``), forms the
group of ``$WORLD_FILE`` with :class:`TorchDistributedBackend`, all-reduces ``rank + 1``
and writes the sum to ``$OUT``. Exits 3 with the reason when it cannot join.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from ringwright.runtime.collectives.backend import CollectiveError, RankTaken
from ringwright.runtime.collectives.torch_backend import TorchDistributedBackend
from ringwright.runtime.settings import RuntimeSettings
from ringwright.world import parse_world


def main() -> int:
    world = parse_world(Path(os.environ["WORLD_FILE"]).read_text())
    rank = int(os.environ["RANK"])
    settings = RuntimeSettings.from_env(os.environ, collective_timeout_s=60,
                                        rendezvous_timeout_s=float(os.environ["DEADLINE_S"]))
    backend = TorchDistributedBackend(torch.device("cpu"), settings)
    try:
        backend.init(world, rank, lambda: False, lambda failure: None)
        value = torch.tensor([float(rank + 1)])
        dist.all_reduce(value)
        Path(os.environ["OUT"]).write_text(str(float(value)))
    except (CollectiveError, RankTaken) as err:
        print(f"refused: {err}", flush=True)
        return 3
    finally:
        backend.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
