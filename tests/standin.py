"""The one report a KWOK pod's runtime would write for the operator: ``joining``.

KWOK makes pods Ready without running a container, so such a pod never asks to join,
and the operator adds a newcomer to a running ring only once it has asked
(:mod:`ringwright.joining`). This thread stands in for that runtime: for every Ready
worker on a KWOK node that is outside its job's world and that no pod host of this
process runs, it writes the ``joining`` report for the world's generation, sealed with
the pod's key, as the runtime does once it has read a world without itself. Pods whose
process runs (under a pod host or a real kubelet) speak for themselves.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable

from ringwright.devcluster.demo import current_world
from ringwright.devcluster.inventory import KWOK_NODE_ANNOTATION
from ringwright.devcluster.podhost import PodHost
from ringwright.kube import ApiError, KubeClient, api_path
from ringwright.objects import Obj
from ringwright.operator.api.base import API_VERSION
from ringwright.operator.plan.isolation import report_key
from ringwright.operator.plan.manifests import JOB_LABEL, ROLE_LABEL, WORKER
from ringwright.report_seal import seal, written_by
from ringwright.world import (
    Mode,
    Report,
    ReportKind,
    World,
    parse_report,
    reports_configmap_name,
)

log = logging.getLogger("tests.standin")

PERIOD_S = 0.25
"""How often it looks; a runtime reports within its world-wait poll of this order."""


class JoiningStandIn:
    """Asks to join for every process-less worker outside its world, until stopped."""

    def __init__(self, client: Callable[[], KubeClient]) -> None:
        self._client = client
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="joining-stand-in",
                                        daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10)

    def _run(self) -> None:
        with self._client() as kube:
            while not self._stop.wait(PERIOD_S):
                try:
                    self.look(kube)
                except (ApiError, OSError) as err:
                    # The API may be restarting under a test; the next look tries again.
                    log.debug("joining stand-in: %s", err)
                except Exception:
                    # A look that breaks must not end the thread: tests would wait for
                    # joins that nobody asks for.
                    log.exception("joining stand-in")

    def look(self, kube: KubeClient) -> None:
        """One pass over every job: announce the workers that cannot announce themselves."""
        try:
            jobs = kube.list(api_path(API_VERSION, "trainingjobs"))
        except ApiError as err:
            if err.status == 404:  # the CRDs are not installed yet
                return
            raise
        kwok: set[str] | None = None  # listed once a job needs it
        for job in jobs:
            ns, name = job["metadata"]["namespace"], job["metadata"]["name"]
            if job["spec"].get("mode") == Mode.PARAMETER_SERVER or PodHost.serves(ns, name):
                continue
            world = current_world(kube, ns, name)
            if world is None:
                continue
            if kwok is None:
                kwok = {n["metadata"]["name"] for n in kube.list(api_path("v1", "nodes"))
                        if (n["metadata"].get("annotations") or {}).get(KWOK_NODE_ANNOTATION)}
            pods = kube.list(api_path("v1", "pods", ns),
                             labelSelector=f"{JOB_LABEL}={name},{ROLE_LABEL}={WORKER}")
            # A pod created again under a member's name is outside too (its uid is new).
            members = {(m.pod, m.pod_uid) for m in world.members}
            outside = [p for p in pods if p["spec"].get("nodeName") in kwok and _ready(p)
                       and not p["metadata"].get("deletionTimestamp")
                       and (p["metadata"]["name"], p["metadata"]["uid"]) not in members]
            if outside:
                _announce(kube, ns, name, world, outside)


def _ready(pod: Obj) -> bool:
    return any(c.get("type") == "Ready" and c.get("status") == "True"
               for c in (pod.get("status") or {}).get("conditions") or [])


def _announce(kube: KubeClient, ns: str, name: str, world: World, pods: list[Obj]) -> None:
    path = api_path("v1", "configmaps", ns, reports_configmap_name(name))
    written = (kube.get_or_none(path) or {}).get("data") or {}
    data: dict[str, str] = {}
    for pod in pods:
        pod_name, key = pod["metadata"]["name"], report_key(pod) or ""
        if pod_name in written:
            # Under the same name there may be a report of an earlier pod (its key).
            old = parse_report(written[pod_name])
            if old.kind is ReportKind.JOINING and old.generation == world.generation \
                    and (not key or written_by(pod_name, old, key)):
                continue
        report = Report(kind=ReportKind.JOINING, generation=world.generation, at=time.time(),
                        detail="started and waiting for a world that includes it")
        data[pod_name] = seal(pod_name, report, key).to_json()
    if data:
        with contextlib.suppress(ApiError):  # the job may be going: nothing to ask for
            kube.merge_patch(path, {"data": data})
