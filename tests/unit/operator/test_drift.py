"""Scaffold drift: each round applies only the scaffold objects the watch cache shows
missing or changed, whatever their kind, and never loops on a difference apply cannot fix."""

from __future__ import annotations

import copy
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from ringwright.objects import Obj
from ringwright.operator.apply.executor import Applier
from ringwright.operator.observe.cache import INDICES, JOB_CONFIGMAPS, Written, newer
from ringwright.operator.observe.drift import SCAFFOLD_KINDS, covers, drifted, record, watched
from ringwright.operator.observe.ledger import CapacityLedger
from ringwright.operator.plan.isolation import network_policy
from ringwright.operator.plan.manifests import scaffold
from tests.jobs import training_job


def job() -> Obj:
    body = training_job("j")
    body["metadata"].update(namespace="a", uid="u1", generation=1)
    return body


def served(obj: Obj, version: int) -> Obj:
    """``obj`` as the API server answers: defaults filled in, bookkeeping added."""
    out = copy.deepcopy(obj)
    out["metadata"].update(resourceVersion=str(version), uid="x", managedFields=[{}])
    if out["kind"] == "Service":
        out["spec"].update(type="ClusterIP", clusterIPs=["None"], sessionAffinity="None")
    if out["kind"] == "ConfigMap":
        out.pop("data", None)  # the server leaves empty data out
    return out


class Server:
    """Scaffold objects by (kind, name), answering applies like the API server."""

    def __init__(self) -> None:
        self.objects: dict[tuple[str, str], Obj] = {}
        self.applies: list[str] = []
        self.created: list[str] = []
        self.version = 0
        self.foreign: dict[str, Any] = {}
        """Extra top-level fields another manager keeps on every object (apply keeps them)."""

    def create(self, path: str, body: Obj) -> Obj:
        """The join-token Secret: created once, never applied (so never drift-checked)."""
        self.created.append(body["kind"])
        return body

    def apply(self, path: str, body: Obj, **_: Any) -> Obj:
        self.version += 1
        self.applies.append(body["kind"])
        answer = {**served(body, self.version), **self.foreign}
        self.objects[(body["kind"], body["metadata"]["name"])] = answer
        return answer


class WatchCache:
    """What kopf's scaffold indices hold: the server's objects, as records."""

    def __init__(self, server: Server, written: Written) -> None:
        self.server, self.written = server, written

    def scaffold_object(self, kind: str, namespace: str, name: str) -> Obj | None:
        seen = self.server.objects.get((kind, name))
        return newer(record(seen) if seen else None, self.written.get(kind, namespace, name))


def applier(server: Server) -> tuple[Applier, WatchCache]:
    written = Written()
    applier = Applier(server, lambda: 0.0, pool=ThreadPoolExecutor(1),  # type: ignore[arg-type]
                      events=None, ledger=CapacityLedger(), written=written)  # type: ignore[arg-type]
    return applier, WatchCache(server, written)


def test_every_scaffold_kind_is_watched() -> None:
    for obj in [*scaffold(job()), network_policy(job(), "ops")]:
        assert watched(obj["kind"]) is SCAFFOLD_KINDS[obj["kind"]]
    with pytest.raises(KeyError, match="SCAFFOLD_KINDS"):
        watched("NetworkPolicy-not-yet")
    # One index holds the world and reports maps, for rounds and drift alike.
    assert watched("ConfigMap").index == JOB_CONFIGMAPS
    assert len(INDICES) == len(set(INDICES))


def test_fields_the_server_fills_in_are_not_drift_but_a_changed_field_of_ours_is() -> None:
    for obj in scaffold(job()):
        seen = record(served(obj, 1))
        assert not drifted(obj, seen), obj["kind"]
        assert drifted(obj, None)
    service = next(o for o in scaffold(job()) if o["kind"] == "Service")
    edited = record(served(service, 2))
    edited["spec"]["publishNotReadyAddresses"] = False
    assert drifted(service, edited)
    role = next(o for o in scaffold(job()) if o["kind"] == "Role")
    widened = record(served(role, 3))
    widened["rules"].append({"apiGroups": [""], "resources": ["secrets"], "verbs": ["get"]})
    assert drifted(role, widened)  # an extra rule is drift, not a default


@pytest.mark.parametrize(("seen", "desired", "expected"), [
    ({"a": 1, "b": 2}, {"a": 1}, True),
    ({"a": 1}, {"a": 2}, False),
    ({}, {"a": {}}, True),
    ({}, {"a": {"b": 1}}, False),
    ({"l": [{"x": 1, "y": 2}]}, {"l": [{"x": 1}]}, True),
    ({"l": [{"x": 1}, {"x": 2}]}, {"l": [{"x": 1}]}, False),
])
def test_covers(seen: Obj, desired: Obj, expected: bool) -> None:
    assert covers(seen, desired) is expected


def applied(server: Server, apply: Applier, cache: Any, force: bool = False) -> int:
    """How many objects one ensure_scaffold round sent (it returns refusals: none here)."""
    before = len(server.applies)
    assert apply.ensure_scaffold(job(), cache.scaffold_object, force) == []
    return len(server.applies) - before


def test_a_round_applies_nothing_until_an_object_is_deleted_or_edited() -> None:
    server = Server()
    apply, cache = applier(server)
    kinds = [o["kind"] for o in scaffold(job())] + ["NetworkPolicy"]
    assert applied(server, apply, cache) == len(kinds)  # nothing there yet
    assert applied(server, apply, cache) == 0
    gone = server.objects.pop(("Service", "j"))
    server.version += 1
    gone["metadata"]["resourceVersion"] = str(server.version)
    assert apply.written.outdated_by("Service", gone, deleted=True)  # the watch's DELETED
    assert applied(server, apply, cache) == 1
    assert server.applies[-1] == "Service"
    edited = copy.deepcopy(server.objects[("ConfigMap", "j-reports")])
    edited["metadata"]["labels"] = {}
    edited["metadata"]["resourceVersion"] = "99"
    server.objects[("ConfigMap", "j-reports")] = edited
    assert applied(server, apply, cache) == 1
    assert server.applies[-1] == "ConfigMap"
    assert applied(server, apply, cache) == 0
    assert applied(server, apply, cache, force=True) == len(kinds)


def test_a_difference_our_apply_cannot_remove_is_applied_once_not_every_round() -> None:
    server = Server()
    server.foreign = {"rules": []}  # say another manager keeps a Role's rules empty
    apply, cache = applier(server)
    apply.ensure_scaffold(job(), cache.scaffold_object)
    before = len(server.applies)
    assert applied(server, apply, cache) == 0
    assert len(server.applies) == before
