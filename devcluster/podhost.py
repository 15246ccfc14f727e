"""Real processes standing in for a job's pods on the local cluster.

KWOK makes pods Running without a kubelet, so no container ever starts. The pod host
plays the rest of the kubelet for one job: it starts the training command for every
Running pod with that pod's environment (its 127.x pod IP included), the Secret
volumes its training container mounts (written to a folder of its own, with
environment values naming the mount path pointed there), and a token of
the pod's own ServiceAccount, so the runtime talks to the API exactly as in a real
pod. It kills the process when the pod is deleted, restarts it in place after a
non-zero exit (restartPolicy OnFailure), marks the pod Succeeded after exit 0, and
flips the pod's Ready condition as the kubelet does: by the container's readinessProbe
(``httpGet`` on the pod IP, every ``periodSeconds``, NotReady after
``failureThreshold`` failures in a row, Ready after ``successThreshold`` successes),
or, for a pod without an HTTP probe, from the runtime's health file.
"""

from __future__ import annotations

import base64
import http.client
import logging
import os
import signal
import sys
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, ClassVar

import yaml

from ringwright.kube import ApiError, KubeClient, api_path
from ringwright.objects import Obj
from ringwright.operator.api.conditions import rfc3339
from ringwright.runtime.local import forkserver
from ringwright.runtime.local.forkserver import Process
from ringwright.world import Env

log = logging.getLogger("ringwright.devcluster.podhost")


def _exit_status(returncode: int) -> int:
    """A process's exit as a container runtime reports it: 128 + the signal that ended it."""
    return 128 - returncode if returncode < 0 else returncode


JOB_LABEL = "ringwright.dev/job"


@dataclass(frozen=True)
class HttpProbe:
    """A container's ``readinessProbe.httpGet``, with the kubelet's defaults."""

    path: str
    port: int
    period_s: float = 10.0
    timeout_s: float = 1.0
    failure_threshold: int = 3
    success_threshold: int = 1

    @classmethod
    def of(cls, pod: Obj) -> HttpProbe | None:
        """The probe of ``pod``'s first container; None without an ``httpGet`` probe."""
        probe = pod["spec"]["containers"][0].get("readinessProbe") or {}
        get = probe.get("httpGet")
        if not get or not isinstance(get.get("port"), int):
            return None
        return cls(path=get.get("path", "/"), port=get["port"],
                   period_s=float(probe.get("periodSeconds", 10)),
                   timeout_s=float(probe.get("timeoutSeconds", 1)),
                   failure_threshold=int(probe.get("failureThreshold", 3)),
                   success_threshold=int(probe.get("successThreshold", 1)))

    def passes(self, ip: str) -> bool:
        """One probe: a 2xx or 3xx answer within the timeout."""
        conn = http.client.HTTPConnection(ip, self.port, timeout=self.timeout_s)
        try:
            conn.request("GET", self.path)
            return 200 <= conn.getresponse().status < 400
        except OSError:
            return False
        finally:
            conn.close()


@dataclass
class ProbeRun:
    """Consecutive results of one pod's probe; decides its readiness like the kubelet."""

    ready: bool
    streak: int = 0
    """Results in a row that disagree with ``ready``."""
    last: float | None = None

    def due(self, probe: HttpProbe, now: float) -> bool:
        """Whether a probe period has passed since the last probe."""
        return self.last is None or now - self.last >= probe.period_s

    def record(self, probe: HttpProbe, passed: bool, now: float) -> bool:
        """Count one result; the readiness after it."""
        self.last = now
        if passed == self.ready:
            self.streak = 0
            return self.ready
        self.streak += 1
        if self.streak >= (probe.success_threshold if passed else probe.failure_threshold):
            self.ready, self.streak = passed, 0
        return self.ready


@dataclass
class HostedPod:
    """One pod and the process standing in for its training container."""

    name: str
    uid: str
    ip: str
    proc: Process
    log: IO[bytes]
    health_file: Path
    started: float
    grace_s: float = 30.0
    """The pod's terminationGracePeriodSeconds (its object may be gone when it is used)."""
    restarts: int = 0
    ready: bool = True
    exit_codes: list[int] = field(default_factory=list)
    probe: ProbeRun = field(default_factory=lambda: ProbeRun(ready=True))


class PodHost:
    """Keeps one process per Running pod of ``job``; call :meth:`sync` repeatedly."""

    _serving: ClassVar[set[tuple[str, str]]] = set()
    """(namespace, job) of every pod host not closed yet, in this process."""

    @classmethod
    def serves(cls, namespace: str, job: str) -> bool:
        """Whether a pod host of this process runs the pods of ``job``."""
        return (namespace, job) in cls._serving

    def __init__(self, kube: KubeClient, namespace: str, job: str, command: Sequence[str],
                 workdir: Path, *, extra_env: dict[str, str] | None = None,
                 readiness_grace: float = 30.0, graceful: bool = False,
                 fork_workers: bool | None = None) -> None:
        self.kube, self.namespace, self.job = kube, namespace, job
        self.fork_workers = forkserver.wanted() if fork_workers is None else fork_workers
        """Fork the pods' processes from a fork server that imported torch once (None: as
        ``RINGWRIGHT_FORK_WORKERS`` says). Off, a pod's process starts from nothing, as a
        kubelet's container does: the demo and the benchmarks keep it off."""
        self.graceful = graceful
        """Stop a deleted pod's process as a kubelet does: SIGTERM, and SIGKILL only after
        the pod's grace period. Off: SIGKILL at once, as most tests want (KWOK removes a
        deleted pod's object at once, so its process would otherwise outlive it)."""
        self._terminating: list[tuple[HostedPod, float]] = []
        self.command = list(command)
        self.workdir = workdir
        self.extra_env = extra_env or {}
        self.readiness_grace = readiness_grace
        self.pods: dict[str, HostedPod] = {}
        self.finished: dict[str, list[int]] = {}
        self.starts: Counter[str] = Counter()
        """Processes started per pod name: 1 while a pod's first process lives."""
        self._completed: set[str] = set()
        """Uids of pods whose process exited 0: never started again, even when the pod
        still reads Running in a listing taken before its Succeeded patch."""
        workdir.mkdir(parents=True, exist_ok=True)
        PodHost._serving.add((namespace, job))

    # -- the loop --------------------------------------------------------------------

    def sync(self) -> None:
        """One pass: start, stop, restart and report, from the pods as they are now."""
        pods = {p["metadata"]["name"]: p for p in self.kube.list(
            api_path("v1", "pods", self.namespace), labelSelector=f"{JOB_LABEL}={self.job}")}
        for name, hosted in list(self.pods.items()):
            pod = pods.get(name)
            if pod is None or pod["metadata"]["uid"] != hosted.uid \
                    or pod["metadata"].get("deletionTimestamp"):
                if self.graceful:
                    self._terminate(hosted)
                else:
                    log.info("pod %s deleted: killing its process", name)
                    self._stop(hosted, signal.SIGKILL)
                continue
            self._check(pod, hosted)
        self._reap()
        for name, pod in pods.items():
            status = pod.get("status") or {}
            if name in self.pods or pod["metadata"].get("deletionTimestamp") \
                    or pod["metadata"]["uid"] in self._completed:
                continue
            if status.get("phase") == "Running" and status.get("podIP"):
                self.pods[name] = self._start(pod)

    def kill(self, pod: str, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` to the process of ``pod`` (a crash, as the test or demo wants it)."""
        self.pods[pod].proc.send_signal(sig)

    def close(self) -> None:
        PodHost._serving.discard((self.namespace, self.job))
        for hosted in list(self.pods.values()):
            self._stop(hosted, signal.SIGKILL)
        for hosted, _ in self._terminating:
            forkserver.signal_group(hosted.proc.pid, signal.SIGKILL)
            self._finish(hosted)
        self._terminating = []

    # -- one pod ---------------------------------------------------------------------

    def _start(self, pod: Obj, restarts: int = 0) -> HostedPod:
        name = pod["metadata"]["name"]
        health = self.workdir / name / "healthy"
        health.parent.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, **self._mounted(pod, self._pod_env(pod)), **self.extra_env,
               Env.HEALTH_FILE: str(health), "PYTHONUNBUFFERED": "1",
               "KUBECONFIG": str(self._token_kubeconfig(pod))}
        env.pop(Env.WORLD_FILE, None)
        command = self.command
        if int(env.get(Env.PROCS_PER_POD) or 1) > 1:
            # What the operator's wrapped command runs: the pod entry point.
            command = [sys.executable, "-m", "ringwright.runtime.launch", "--", *command]
        out = (self.workdir / f"{name}.log").open("ab")
        proc = forkserver.start_process(command, env, output=out, fork=self.fork_workers,
                                        new_session=True)
        self.starts[name] += 1
        log.info("pod %s: started pid %d at %s", name, proc.pid, pod["status"]["podIP"])
        return HostedPod(name=name, uid=pod["metadata"]["uid"], ip=pod["status"]["podIP"],
                         proc=proc, log=out, health_file=health, started=time.monotonic(),
                         grace_s=float(pod["spec"].get("terminationGracePeriodSeconds", 30)),
                         restarts=restarts)

    def _stop(self, hosted: HostedPod, sig: int) -> None:
        forkserver.signal_group(hosted.proc.pid, sig)
        del self.pods[hosted.name]
        self._finish(hosted)

    def _terminate(self, hosted: HostedPod) -> None:
        """SIGTERM now; :meth:`_reap` sends SIGKILL once the grace period is over."""
        log.info("pod %s deleted: SIGTERM, %.0f s of grace", hosted.name, hosted.grace_s)
        forkserver.signal_group(hosted.proc.pid, signal.SIGTERM)
        del self.pods[hosted.name]
        self._terminating.append((hosted, time.monotonic() + hosted.grace_s))

    def _reap(self) -> None:
        """Record the terminating processes that exited; kill those past their grace."""
        waiting = []
        for hosted, deadline in self._terminating:
            if hosted.proc.poll() is None:
                if time.monotonic() < deadline:
                    waiting.append((hosted, deadline))
                    continue
                log.info("pod %s: grace period over: SIGKILL", hosted.name)
                forkserver.signal_group(hosted.proc.pid, signal.SIGKILL)
            self._finish(hosted)
        self._terminating = waiting

    def _finish(self, hosted: HostedPod) -> None:
        code = hosted.proc.wait()
        hosted.log.close()
        self.finished.setdefault(hosted.name, []).append(code)

    def _check(self, pod: Obj, hosted: HostedPod) -> None:
        code = hosted.proc.poll()
        path = api_path("v1", "pods", self.namespace, hosted.name, "status")
        if code == 0:
            log.info("pod %s: process exited 0; pod Succeeded", hosted.name)
            self._completed.add(hosted.uid)
            self._stop(hosted, signal.SIGKILL)
            self._patch_status(path, {"phase": "Succeeded", "conditions": [
                {"type": "Ready", "status": "False", "reason": "PodCompleted"}]})
        elif code is not None:
            # restartPolicy OnFailure: same pod, same IP, a fresh process without state.
            log.info("pod %s: process exited %d; restarting it in place", hosted.name, code)
            self._stop(hosted, signal.SIGKILL)
            self.pods[hosted.name] = self._start(pod, hosted.restarts + 1)
            # As a kubelet reports it: the new container's start, the last one's end.
            now = rfc3339(time.time())
            self._patch_status(path, {"containerStatuses": [{
                **(pod["status"].get("containerStatuses") or [{}])[0],
                "restartCount": hosted.restarts + 1,
                "state": {"running": {"startedAt": now}},
                "lastState": {"terminated": {"exitCode": _exit_status(code),
                                             "finishedAt": now}}}]})
        else:
            self._probe(pod, hosted, path)

    def _probe(self, pod: Obj, hosted: HostedPod, path: str) -> None:
        now = time.monotonic()
        if now - hosted.started < self.readiness_grace:
            return
        probe = HttpProbe.of(pod)
        if probe is None:
            ready = hosted.health_file.exists()
        elif hosted.probe.due(probe, now):
            ready = hosted.probe.record(probe, probe.passes(hosted.ip), now)
        else:
            return
        if ready != hosted.ready:
            log.info("pod %s: readiness %s", hosted.name, "passes" if ready else "fails")
            hosted.ready = ready
            conditions = [c for c in pod["status"].get("conditions") or []
                          if c.get("type") != "Ready"]
            conditions.append({"type": "Ready", "status": "True" if ready else "False"})
            self._patch_status(path, {"conditions": conditions})

    def _patch_status(self, path: str, status: Obj) -> None:
        try:
            self.kube.merge_patch(path, {"status": status})
        except ApiError as err:
            log.warning("could not update %s: %s", path, err)

    # -- what a kubelet would provide ----------------------------------------------

    def _pod_env(self, pod: Obj) -> dict[str, str]:
        fields = {"metadata.name": pod["metadata"]["name"],
                  "metadata.uid": pod["metadata"].get("uid", ""),
                  "metadata.namespace": pod["metadata"]["namespace"],
                  "status.podIP": pod["status"]["podIP"],
                  "spec.nodeName": pod["spec"].get("nodeName", "")}
        env: dict[str, str] = {}
        for var in pod["spec"]["containers"][0].get("env") or []:
            source = var.get("valueFrom") or {}
            if "value" in var:
                env[var["name"]] = var["value"]
            elif "secretKeyRef" in source:
                value = self._secret_key(source["secretKeyRef"])
                if value is not None:
                    env[var["name"]] = value
            else:
                ref = (source.get("fieldRef") or {}).get("fieldPath", "")
                if ref in fields:
                    env[var["name"]] = fields[ref]
        return env

    def _secret_key(self, ref: Obj) -> str | None:
        """One key of a Secret in the pod's namespace, as a kubelet sets it in the
        environment; None for an optional key or Secret that is absent."""
        secret = self.kube.get_or_none(api_path("v1", "secrets", self.namespace, ref["name"]))
        data = (secret or {}).get("data") or {}
        if ref["key"] in data:
            return base64.b64decode(data[ref["key"]]).decode()
        if not ref.get("optional"):
            # A kubelet would not start the container (CreateContainerConfigError).
            log.warning("secret %s has no key %s, which the pod needs", ref["name"], ref["key"])
        return None

    def _mounted(self, pod: Obj, env: dict[str, str]) -> dict[str, str]:
        """Write the Secret volumes the training container mounts under the pod's folder;
        ``env`` with values under a mount path pointed at the written copy."""
        spec = pod["spec"]
        secrets = {v["name"]: v["secret"] for v in spec.get("volumes") or [] if "secret" in v}
        for mount in spec["containers"][0].get("volumeMounts") or []:
            source = secrets.get(mount["name"])
            if source is None:
                continue
            data = self.kube.get(api_path("v1", "secrets", self.namespace,
                                          source["secretName"])).get("data") or {}
            items = source.get("items") or [{"key": k, "path": k} for k in data]
            target = self.workdir / str(pod["metadata"]["name"]) / "mounts" / mount["name"]
            target.mkdir(parents=True, exist_ok=True)
            for item in items:
                path = target / item["path"]
                path.unlink(missing_ok=True)  # read-only from an earlier start
                path.write_bytes(base64.b64decode(data[item["key"]]))
                path.chmod(source.get("defaultMode", 0o644) & 0o777)
            at = mount["mountPath"].rstrip("/")
            env = {k: str(target) + v[len(at):] if v == at or v.startswith(at + "/") else v
                   for k, v in env.items()}
        return env

    def _token_kubeconfig(self, pod: Obj) -> Path:
        """A kubeconfig carrying a token of the pod's ServiceAccount (TokenRequest API)."""
        account = pod["spec"].get("serviceAccountName", "default")
        request: dict[str, Any] = {"apiVersion": "authentication.k8s.io/v1",
                                   "kind": "TokenRequest",
                                   "spec": {"expirationSeconds": 3600}}
        token = self.kube.create(
            api_path("v1", "serviceaccounts", self.namespace, account, "token"),
            request)["status"]["token"]
        config = self.kube.config
        doc = {
            "apiVersion": "v1", "kind": "Config", "current-context": "pod",
            "clusters": [{"name": "local", "cluster": {
                "server": config.server, "certificate-authority": config.ca_file}}],
            "users": [{"name": account, "user": {"token": token}}],
            "contexts": [{"name": "pod", "context": {
                "cluster": "local", "user": account, "namespace": self.namespace}}],
        }
        path: Path = self.workdir / str(pod["metadata"]["name"]) / "kubeconfig"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(yaml.safe_dump(doc))
        path.chmod(0o600)
        return path
