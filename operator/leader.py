"""Leader election with a coordination.k8s.io Lease, so two operator replicas never both act.

The rules are client-go's: the holder renews the Lease every ``renew_seconds``; another
replica takes it over only after the record has stayed unchanged for
``lease_seconds`` by its *own* clock (so clock skew between machines does not matter);
every write carries the resourceVersion it read, so of two replicas racing for an
expired Lease exactly one wins. A leader that cannot renew within its lease stops at
once: by then another replica may already act. A leader that stops on purpose releases the
Lease (client-go's ``ReleaseOnCancel``), so a standby or the next rollout's replica takes
over at its next try instead of waiting out the lease.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from ringwright.kube import ApiError, KubeClient, api_path
from ringwright.objects import Obj

log = logging.getLogger("ringwright.operator.leader")

LEASE_API = "coordination.k8s.io/v1"


@dataclass(frozen=True)
class Seen:
    """The Lease record as last read, and when (by our clock) it last changed."""

    holder: str
    record: tuple[Any, ...]
    changed_at: float


def observe(previous: Seen | None, lease: Obj | None, now: float) -> Seen | None:
    """Fold a fresh read of the Lease into what we had seen (pure)."""
    if lease is None:
        return None
    spec = lease.get("spec") or {}
    record = (spec.get("holderIdentity"), spec.get("renewTime"), spec.get("leaseTransitions"),
              spec.get("leaseDurationSeconds"))
    if previous is not None and previous.record == record:
        return previous
    return Seen(str(spec.get("holderIdentity") or ""), record, now)


def may_take(seen: Seen | None, me: str, now: float, lease_seconds: float) -> bool:
    """Whether ``me`` may write itself into the Lease now (pure)."""
    if seen is None or not seen.holder or seen.holder == me:
        return True
    return now - seen.changed_at >= lease_seconds


def _micro_time(now: float) -> str:
    return datetime.fromtimestamp(now, UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class LeaderElector:
    """Acquires and keeps one Lease for ``identity``."""

    def __init__(self, kube: KubeClient, namespace: str, name: str, identity: str, *,
                 lease_seconds: float = 15.0, renew_seconds: float = 5.0,
                 retry_seconds: float = 2.0,
                 clock: Callable[[], float] = time.monotonic,
                 wall: Callable[[], float] = time.time) -> None:
        self.kube, self.identity = kube, identity
        self.lease_seconds, self.renew_seconds = lease_seconds, renew_seconds
        # A standby looks this often (client-go's RetryPeriod): it sees a released Lease soon.
        self.retry_seconds = min(retry_seconds, renew_seconds)
        self.clock, self.wall = clock, wall
        self._path = api_path(LEASE_API, "leases", namespace, name)
        self._collection = api_path(LEASE_API, "leases", namespace)
        self._name, self._namespace = name, namespace
        self._seen: Seen | None = None
        self._stop_keeping = threading.Event()
        self._keeper: threading.Thread | None = None

    def try_acquire(self) -> bool:
        """One attempt to hold (or keep holding) the Lease; True when we hold it."""
        lease = self.kube.get_or_none(self._path)
        now = self.clock()
        self._seen = observe(self._seen, lease, now)
        if not may_take(self._seen, self.identity, now, self.lease_seconds):
            return False
        spec = dict((lease or {}).get("spec") or {})
        stamp = _micro_time(self.wall())
        if spec.get("holderIdentity") != self.identity:
            spec["leaseTransitions"] = int(spec.get("leaseTransitions") or 0) + (
                1 if lease is not None else 0)
            spec["acquireTime"] = stamp
        spec.update(holderIdentity=self.identity, renewTime=stamp,
                    leaseDurationSeconds=int(self.lease_seconds))
        try:
            if lease is None:
                self.kube.create(self._collection, {
                    "apiVersion": LEASE_API, "kind": "Lease",
                    "metadata": {"name": self._name, "namespace": self._namespace},
                    "spec": spec})
            else:
                # The resourceVersion read above: a replica that wrote in between wins.
                self.kube.replace(self._path, {**lease, "spec": spec})
        except ApiError as err:
            if err.status == 409:
                return False
            raise
        return True

    def acquire(self, stop: threading.Event) -> bool:
        """Block until we hold the Lease (True) or ``stop`` is set (False)."""
        announced = False
        while not stop.is_set():
            try:
                if self.try_acquire():
                    log.info("leading as %s (lease %s/%s)", self.identity, self._namespace,
                             self._name)
                    return True
            except ApiError as err:
                log.warning("lease %s/%s: %s", self._namespace, self._name, err)
            if not announced:
                log.info("standing by: lease %s/%s is held by %s", self._namespace,
                         self._name, self._seen.holder if self._seen else "?")
                announced = True
            stop.wait(self.retry_seconds)
        return False

    def keep(self, stop: threading.Event, lost: Callable[[], None]) -> None:
        """Renew until ``stop``; call ``lost`` when the Lease could not be kept."""
        last_renewed = self.clock()
        while not stop.wait(self.renew_seconds):
            try:
                if self.try_acquire():
                    last_renewed = self.clock()
                    continue
                log.error("lease %s/%s was taken by %s", self._namespace, self._name,
                          self._seen.holder if self._seen else "?")
            except ApiError as err:
                log.warning("lease renewal failed: %s", err)
                if self.clock() - last_renewed < self.lease_seconds - self.renew_seconds:
                    continue
            lost()
            return

    def keep_in_background(self, lost: Callable[[], None]) -> None:
        """Renew from a daemon thread (:meth:`keep`) until :meth:`release`."""
        self._keeper = threading.Thread(target=self.keep, args=(self._stop_keeping, lost),
                                        daemon=True, name="lease")
        self._keeper.start()

    def release(self) -> None:
        """Stop renewing and give the Lease up, if we still hold it (on a graceful exit).

        Call only once this replica acts no more: the next holder may act at once.
        """
        self._stop_keeping.set()
        if self._keeper is not None:
            # A renewal in flight could otherwise take the Lease back after the release.
            self._keeper.join()
        try:
            lease = self.kube.get_or_none(self._path)
            spec = dict((lease or {}).get("spec") or {})
            if lease is None or spec.get("holderIdentity") != self.identity:
                return
            spec.update(holderIdentity="", leaseDurationSeconds=1,
                        renewTime=_micro_time(self.wall()))
            spec.pop("acquireTime", None)
            self.kube.replace(self._path, {**lease, "spec": spec})
            log.info("released lease %s/%s", self._namespace, self._name)
        except ApiError as err:
            # Not fatal: the next replica takes over once the lease runs out.
            log.warning("could not release lease %s/%s: %s", self._namespace, self._name, err)
