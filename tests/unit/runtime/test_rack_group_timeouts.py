"""The rack groups of a hierarchical world form within the group-init timeout, as the
default group does, and only then get the long collective timeout: a peer that left
after the join barrier must not hold the others in the subgroups' connection mesh for
the collective timeout (minutes), nor gloo hold them for five times the init timeout."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch._C._distributed_c10d import HashStore

from ringwright.runtime.collectives import hierarchical, torch_backend
from ringwright.runtime.settings import RuntimeSettings
from tests.unit.runtime.test_topology_plans import ON, world


class Group:
    """A process group that remembers the timeouts it was given."""

    def __init__(self, timeout: timedelta) -> None:
        self.timeouts = [timeout]

    def set_timeout(self, timeout: timedelta) -> None:
        self.timeouts.append(timeout)


@pytest.fixture()
def groups(monkeypatch: pytest.MonkeyPatch) -> list[Group]:
    made: list[Group] = []

    def new_group(ranks: list[int], timeout: timedelta) -> Group:
        made.append(Group(timeout))
        return made[-1]

    monkeypatch.setattr(dist, "new_group", new_group)
    monkeypatch.setattr(dist, "ProcessGroup", Group)
    return made


def test_rack_groups_take_a_later_timeout_for_their_collectives(groups: list[Group]) -> None:
    plan = hierarchical.rack_plan(world("aabb", ON))
    assert plan is not None
    racks = hierarchical.RackGroups(plan, 0, timedelta(seconds=7), lanes=2)
    assert groups and all(g.timeouts == [timedelta(seconds=7)] for g in groups)
    racks.set_timeout(timedelta(seconds=900))
    assert all(g.timeouts[-1] == timedelta(seconds=900) for g in groups)


class Stores:
    def meet(self, *args: Any, **kwargs: Any) -> HashStore:
        return HashStore()

    def release(self, **kwargs: Any) -> None:
        pass


def test_the_backend_forms_rack_groups_within_the_init_timeout(
        groups: list[Group], monkeypatch: pytest.MonkeyPatch) -> None:
    default = Group(timedelta(seconds=7))
    given: list[timedelta] = []
    monkeypatch.setattr(torch_backend, "init_default_group",
                        lambda **kwargs: given.append(kwargs["timeout"]))
    monkeypatch.setattr(torch_backend, "_default_group", lambda: default)
    settings = RuntimeSettings(group_init_timeout_s=7, collective_timeout_s=900)
    backend = torch_backend.TorchDistributedBackend(torch.device("cpu"), settings)
    backend._stores = Stores()  # type: ignore[assignment]
    backend.init(world("aabb", ON), 0, lambda: False, lambda failure: None)
    assert groups, "no rack groups formed"
    # gloo (CPU) waits five times its timeout for a first connection.
    forming = timedelta(seconds=7 / 5)
    assert given == [forming]
    assert all(g.timeouts == [forming, timedelta(seconds=900)] for g in groups)
    assert default.timeouts[-1] == timedelta(seconds=900)


def test_gloo_groups_form_within_the_init_timeout_nccl_groups_with_it() -> None:
    # Gloo's passive side of a pair waits 5 x the group's timeout for its peer.
    gloo = torch_backend.forming_timeout("gloo", 60)
    assert gloo * torch_backend.GLOO_CONNECT_WAIT_FACTOR == timedelta(seconds=60)
    assert torch_backend.forming_timeout("nccl", 60) == timedelta(seconds=60)
