"""The rack groups of a hierarchical world form within the group-init timeout, as the
default group does, and only then get the long collective timeout: a peer that left
after the join barrier must not hold the others in the subgroups' connection mesh for
the collective timeout (minutes)."""

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
    def meet(self, *args: Any) -> HashStore:
        return HashStore()

    def release(self, **kwargs: Any) -> None:
        pass


def test_the_backend_forms_rack_groups_within_the_init_timeout(
        groups: list[Group], monkeypatch: pytest.MonkeyPatch) -> None:
    default = Group(timedelta(seconds=7))
    monkeypatch.setattr(torch_backend, "init_default_group", lambda **kwargs: None)
    monkeypatch.setattr(torch_backend, "_default_group", lambda: default)
    settings = RuntimeSettings(group_init_timeout_s=7, collective_timeout_s=900)
    backend = torch_backend.TorchDistributedBackend(torch.device("cpu"), settings)
    backend._stores = Stores()  # type: ignore[assignment]
    backend.init(world("aabb", ON), 0, lambda: False, lambda failure: None)
    assert groups, "no rack groups formed"
    assert all(g.timeouts == [timedelta(seconds=7), timedelta(seconds=900)] for g in groups)
    assert default.timeouts[-1] == timedelta(seconds=900)
