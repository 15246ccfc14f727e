"""Leader election: a graceful stop hands the Lease on; a renewal never takes it back."""

from __future__ import annotations

import copy
import threading
from typing import Any, cast

from ringwright.kube import ApiError, KubeClient
from ringwright.objects import Obj
from ringwright.operator.leader import LeaderElector


class LeaseStore:
    """One Lease behind get/create/replace, with resourceVersion conflicts as the API server."""

    def __init__(self) -> None:
        self.lease: Obj | None = None
        self.version = 0

    def get_or_none(self, path: str) -> Obj | None:
        return copy.deepcopy(self.lease)

    def create(self, path: str, body: Obj) -> Obj:
        if self.lease is not None:
            raise ApiError(409, "AlreadyExists", "exists", "POST lease")
        return self._store(body)

    def replace(self, path: str, body: Obj) -> Obj:
        assert self.lease is not None
        if body["metadata"].get("resourceVersion") != self.lease["metadata"]["resourceVersion"]:
            raise ApiError(409, "Conflict", "the object has been modified", "PUT lease")
        return self._store(body)

    def _store(self, body: Obj) -> Obj:
        self.version += 1
        self.lease = copy.deepcopy(body)
        self.lease["metadata"]["resourceVersion"] = str(self.version)
        return copy.deepcopy(self.lease)

    @property
    def holder(self) -> Any:
        return (self.lease or {}).get("spec", {}).get("holderIdentity")


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _elector(store: LeaseStore, identity: str, clock: Clock) -> LeaderElector:
    return LeaderElector(cast(KubeClient, store), "ops", "ringwright-operator", identity,
                         lease_seconds=600.0, renew_seconds=200.0, clock=clock, wall=clock)


def test_a_released_lease_is_taken_by_a_standby_at_once() -> None:
    store, clock = LeaseStore(), Clock()
    first, second = _elector(store, "first", clock), _elector(store, "second", clock)
    assert first.try_acquire() and store.holder == "first"
    assert not second.try_acquire()  # held, and far from expired
    first.keep_in_background(lambda: None)
    first.release()
    assert store.holder == "" and store.lease is not None
    assert store.lease["spec"]["leaseDurationSeconds"] == 1
    assert second.try_acquire() and store.holder == "second"  # no 600 s wait
    assert store.lease["spec"]["leaseTransitions"] == 1


def test_release_leaves_a_lease_someone_else_holds() -> None:
    store, clock = LeaseStore(), Clock()
    first, second = _elector(store, "first", clock), _elector(store, "second", clock)
    assert first.try_acquire() and not second.try_acquire()
    clock.now += 601  # first stalled past its lease (by second's clock); second took over
    assert second.try_acquire() and store.holder == "second"
    first.release()
    assert store.holder == "second"


def test_no_renewal_runs_after_release() -> None:
    store, clock = LeaseStore(), Clock()
    elector = _elector(store, "first", clock)
    elector.renew_seconds = 0.01
    assert elector.try_acquire()
    renewing = threading.Event()
    real = store.replace

    def replace(path: str, body: Obj) -> Obj:
        renewing.set()
        return real(path, body)

    store.replace = replace  # type: ignore[method-assign]
    elector.keep_in_background(lambda: None)
    assert renewing.wait(5)
    elector.release()
    released = store.version
    assert store.holder == ""
    assert elector._keeper is not None and not elector._keeper.is_alive()
    assert store.version == released
