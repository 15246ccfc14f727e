"""The job's status is written by server-side apply, which cannot empty a map it owns:
the API server keeps the emptied map as null and the schema refuses it (and then every
later status write). A map that loses its last entry is removed by a merge patch first."""

from __future__ import annotations

import copy
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from ringwright.kube import ApiError
from ringwright.objects import Obj
from ringwright.operator.apply.executor import Applier, emptied_maps
from ringwright.operator.observe.cache import Written
from ringwright.operator.observe.ledger import CapacityLedger
from tests.jobs import training_job


class StatusServer:
    """One job's stored status, written as the API server does: an apply that leaves a
    map with entries empty or out is refused (the map would be stored as null)."""

    def __init__(self, status: Obj) -> None:
        self.status = copy.deepcopy(status)
        self.calls: list[str] = []

    def merge_patch(self, path: str, body: Obj) -> Obj:
        self.calls.append("merge")
        for key, value in body["status"].items():
            if value is None:
                self.status.pop(key, None)
        return {"status": self.status}

    def apply(self, path: str, body: Obj, **_: Any) -> Obj:
        self.calls.append("apply")
        for key, old in self.status.items():
            if isinstance(old, dict) and old and not body["status"].get(key):
                raise ApiError(422, "Invalid", f'status.{key}: Invalid value: "null"', path)
        self.status = copy.deepcopy(body["status"])
        return {**body, "status": self.status}


def applier(server: StatusServer) -> Applier:
    return Applier(server, lambda: 0.0, pool=ThreadPoolExecutor(1),  # type: ignore[arg-type]
                   events=None, ledger=CapacityLedger(),  # type: ignore[arg-type]
                   written=Written())


def job(status: Obj) -> Obj:
    body = training_job("j")
    body["metadata"].update(namespace="a", uid="u1", generation=1)
    return {**body, "status": status}


def test_a_map_that_loses_its_last_entry_is_removed_before_the_apply() -> None:
    before = {"phase": "Running", "restarts": 1, "containerRestarts": {"w-0/u": 1}}
    server = StatusServer(before)
    applier(server).apply_status(job(before), {**before, "containerRestarts": {}})
    assert server.calls == ["merge", "apply"]
    assert server.status["restarts"] == 1 and not server.status.get("containerRestarts")


def test_a_map_that_keeps_entries_or_was_empty_needs_no_merge_patch() -> None:
    before = {"phase": "Running", "containerRestarts": {"w-0/u": 1, "w-1/v": 2}}
    server = StatusServer(before)
    applier(server).apply_status(job(before),
                                 {**before, "containerRestarts": {"w-1/v": 2}, "restarts": 2})
    assert server.calls == ["apply"]


@pytest.mark.parametrize(("before", "after", "patch"), [
    ({"m": {"a": 1}}, {"m": {}}, {"m": None}),
    ({"m": {"a": 1}}, {}, {"m": None}),
    ({"m": {"a": 1}}, {"m": {"b": 1}}, {}),
    ({"m": {}}, {}, {}),
    ({"g": {"members": {"p": {"since": 1.0}}, "training": 0.5}},
     {"g": {"members": {}, "training": 0.6}}, {"g": {"members": None}}),
    ({"phase": "Running", "list": [1]}, {"phase": "Failed", "list": []}, {}),
])
def test_emptied_maps(before: Obj, after: Obj, patch: Obj) -> None:
    assert emptied_maps(before, after) == patch
