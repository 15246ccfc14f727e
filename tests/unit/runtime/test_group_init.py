"""A failed process-group init leaves nothing that would keep the next from meeting its
peers: torch names groups by a process-wide count that the failure had advanced."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta

import pytest
import torch.distributed as dist
from torch._C._distributed_c10d import HashStore

from ringwright.runtime.collectives.torch_backend import init_default_group


@pytest.fixture()
def no_group() -> Iterator[None]:
    assert not dist.is_initialized()
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def test_after_an_init_that_timed_out_the_next_group_has_the_name_its_peers_use(
        no_group: None) -> None:
    with pytest.raises(Exception, match=r"(?i)timeout|timed out"):
        # A world of two whose peer never comes.
        init_default_group(backend="gloo", store=HashStore(), rank=0, world_size=2,
                           timeout=timedelta(seconds=1), device_id=None)
    assert not dist.is_initialized()

    init_default_group(backend="gloo", store=HashStore(), rank=0, world_size=1,
                       timeout=timedelta(seconds=5), device_id=None)
    # What a peer that never failed names its first group.
    assert dist.distributed_c10d._get_default_group().group_name == "0"
