"""kopf registration: one reconcile loop per job, woken by the events that matter.

Every job gets a thread that runs observe -> plan -> apply until the job is gone.
Job, pod and report events only start or wake that loop, so a job is never
reconciled twice at once and every round starts from fresh observations
(level-triggered). Only watching handlers are used: they add no finalizers, so
deleting a job (or its namespace) never waits for the operator to be up.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import kopf

from ringwright.kube import ApiError, KubeClient
from ringwright.operator.apibase import GROUP, VERSION
from ringwright.operator.apply import Applier
from ringwright.operator.manifests import JOB_LABEL
from ringwright.operator.metrics import OperatorMetrics
from ringwright.operator.observe import observe
from ringwright.operator.placer import place
from ringwright.operator.reconcile import plan
from ringwright.operator.settings import OperatorSettings

log = logging.getLogger("ringwright.operator")


@dataclass
class OperatorContext:
    """What the handlers share, passed in through kopf's memo (no module globals)."""

    kube: KubeClient
    settings: OperatorSettings
    clock: Callable[[], float] = time.time
    metrics: OperatorMetrics = field(default_factory=OperatorMetrics)
    stopping: threading.Event = field(default_factory=threading.Event)
    wakers: dict[tuple[str, str], threading.Event] = field(default_factory=dict)
    loops: dict[tuple[str, str], threading.Thread] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def wake(self, namespace: str, name: str) -> None:
        """Wake the job's loop, starting it when there is none."""
        key = (namespace, name)
        with self.lock:
            waker = self.wakers.setdefault(key, threading.Event())
            loop = self.loops.get(key)
            if loop is None or not loop.is_alive():
                loop = threading.Thread(target=self._loop, args=key, daemon=True,
                                        name=f"job {namespace}/{name}")
                self.loops[key] = loop
                loop.start()
        waker.set()

    def _loop(self, namespace: str, name: str) -> None:
        waker = self.wakers[(namespace, name)]
        while not self.stopping.is_set():
            waker.clear()
            try:
                with self.metrics.round():
                    delay = reconcile_once(self, namespace, name)
            except ApiError as err:
                self.metrics.api_error(err.verb, err.status)
                # Conflicts and transient API errors: observe again shortly.
                log.warning("reconcile %s/%s: %s", namespace, name, err)
                delay = 1.0
            except Exception:
                log.exception("reconcile %s/%s failed; retrying", namespace, name)
                delay = 5.0
            if delay is None:
                break
            waker.wait(timeout=delay)
        with self.lock:
            self.loops.pop((namespace, name), None)


def reconcile_once(ctx: OperatorContext, namespace: str, name: str) -> float | None:
    """One observe -> plan -> apply round; returns when to run again (None: job gone)."""
    observed = observe(ctx.kube, namespace, name)
    if observed is None:
        ctx.metrics.forget(namespace, name)
        return None
    applier = Applier(ctx.kube, ctx.clock)
    if observed.world is None:
        applier.ensure_scaffold(observed.job)
    with ctx.metrics.planning():
        decided = plan(observed, ctx.settings, ctx.clock(), place)
    applier.perform(observed.job, decided)
    ctx.metrics.applied(namespace, name, observed, decided)
    if decided.delete_job:
        return None
    resync: float = ctx.settings.resync_seconds
    if decided.requeue_after is None:
        return resync
    return min(decided.requeue_after, resync)


def register(registry: kopf.OperatorRegistry) -> None:
    """Register every handler on ``registry`` (kept explicit so tests can build their own)."""

    @kopf.on.startup(registry=registry)
    def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
        settings.posting.level = logging.WARNING
        settings.watching.server_timeout = 300

    @kopf.on.cleanup(registry=registry)
    def stop(memo: Any, **_: Any) -> None:
        memo["ctx"].stopping.set()

    @kopf.on.event(GROUP, VERSION, "trainingjobs", registry=registry)
    def job_changed(*, namespace: str | None, name: str, memo: Any, **_: Any) -> None:
        memo["ctx"].wake(namespace or "", name)

    @kopf.on.event("pods", labels={JOB_LABEL: kopf.PRESENT}, registry=registry)
    def pod_changed(*, namespace: str | None, labels: Mapping[str, str], memo: Any,
                    **_: Any) -> None:
        memo["ctx"].wake(namespace or "", labels[JOB_LABEL])

    @kopf.on.event("configmaps", labels={JOB_LABEL: kopf.PRESENT}, registry=registry)
    def reports_changed(*, namespace: str | None, name: str, labels: Mapping[str, str],
                        memo: Any, **_: Any) -> None:
        if name.endswith("-reports"):
            memo["ctx"].wake(namespace or "", labels[JOB_LABEL])
