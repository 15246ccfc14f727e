"""Helpers for tests that run jobs on the local cluster: an operator process and manifests."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from ringwright.devcluster.control_plane import Cluster, free_port
from ringwright.kube import ApiError, KubeClient, api_path
from ringwright.operator.api.base import API_VERSION
from ringwright.operator.api.models import MAX_WORKERS
from tests.waiting import wait_for

# Short windows keep the tests quick; the logic under test is the same.
FAST = {
    "RINGWRIGHT_SETTLE_SECONDS": "0.5",
    "RINGWRIGHT_DRAIN_SECONDS": "3",
    "RINGWRIGHT_BACKOFF_BASE_SECONDS": "0.2",
    "RINGWRIGHT_BACKOFF_CAP_SECONDS": "1",
    "RINGWRIGHT_BELOW_MIN_GRACE_SECONDS": "20",
    "RINGWRIGHT_RESYNC_SECONDS": "2",
    "RINGWRIGHT_RANK_EXIT_GRACE_SECONDS": "5",
}


LEASE_SECONDS = 3.0
SUPERVISE_EVERY_S = 0.5
"""How soon a supervised operator that exited is started again."""


class OperatorProcess:
    """``python -m ringwright.operator`` as a child process, as a user would run it."""

    def __init__(self, cluster: Cluster, log: Path, *, kubeconfig: Path | None = None,
                 args: Sequence[str] = (), env: Mapping[str, str] | None = None,
                 settings: Mapping[str, str] = FAST, supervised: bool = False) -> None:
        self.cluster, self.log = cluster, log
        self.settings = dict(settings)
        """The operator's ``RINGWRIGHT_*`` settings (the tests' short windows by default)."""
        self.env = dict(env or {})
        """Set last: e.g. ``KUBECONFIG=""`` with an in-cluster environment."""
        self.kubeconfig = kubeconfig or cluster.kubeconfig
        self.args = list(args)
        self.proc: subprocess.Popen[bytes] | None = None
        self.metrics_port = 0
        self.supervised = supervised
        """Started again whenever it exits on its own, as its Deployment's pod would be: the
        operator exits when it cannot renew its Lease (an API server stalled for seconds),
        and one such stall must not leave every later test without an operator."""
        self.restarts = 0
        """How often supervision started it again."""
        self._lock = threading.RLock()
        self._wanted = False
        self._watcher: threading.Thread | None = None

    @property
    def metrics_url(self) -> str:
        """Where the running operator serves its Prometheus metrics."""
        return f"http://127.0.0.1:{self.metrics_port}/metrics"

    def start(self) -> None:
        """Start the operator (and, if supervised, keep it running until kill or stop)."""
        with self._lock:
            self._spawn()
            self._wanted = True
            if self.supervised and self._watcher is None:
                self._watcher = threading.Thread(target=self._supervise, daemon=True,
                                                 name="operator-supervisor")
                self._watcher.start()

    def _spawn(self) -> None:
        env = {**os.environ, **self.settings, "KUBECONFIG": str(self.kubeconfig), **self.env}
        self.metrics_port = free_port()
        # A short lease: a restarted operator takes over from a killed one in seconds.
        args = ["--lease-seconds", str(LEASE_SECONDS), "--metrics-address", "127.0.0.1",
                "--metrics-port", str(self.metrics_port), *self.args]
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen([sys.executable, "-m", "ringwright.operator", *args],
                                         env=env, stdout=out, stderr=subprocess.STDOUT)

    def _supervise(self) -> None:
        while True:
            time.sleep(SUPERVISE_EVERY_S)
            with self._lock:
                if self._wanted and self.proc is not None and self.proc.poll() is not None:
                    with self.log.open("a") as out:
                        out.write(f"--- the tests' supervisor: the operator exited "
                                  f"{self.proc.returncode}; starting it again\n")
                    self.restarts += 1
                    self._spawn()

    def kill(self) -> None:
        """SIGKILL the operator; it stays down until :meth:`start`."""
        with self._lock:
            self._wanted = False
            if self.proc is not None and self.proc.poll() is None:
                self.proc.send_signal(signal.SIGKILL)
                self.proc.wait()
            self.proc = None

    def stop(self) -> None:
        """SIGTERM the operator (SIGKILL after 15 s); it stays down until :meth:`start`."""
        with self._lock:
            self._wanted = False
            if self.proc is not None and self.proc.poll() is None:
                self.proc.terminate()
                try:
                    self.proc.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    self.kill()
            self.proc = None

    def tail(self, lines: int = 40) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])

    def log_offset(self) -> int:
        """Where the log ends now: :meth:`log_since` it reads what was written after."""
        return self.log.stat().st_size if self.log.exists() else 0

    def log_since(self, offset: int) -> list[str]:
        """The log's lines written after ``offset`` (from :meth:`log_offset`)."""
        with self.log.open("rb") as f:
            f.seek(offset)
            return f.read().decode(errors="replace").splitlines()


@contextlib.contextmanager
def instead_of(shared: OperatorProcess, own: OperatorProcess) -> Iterator[OperatorProcess]:
    """Run ``own`` in place of the session's operator ``shared`` (both would take the same
    Lease), and put ``shared`` back after."""
    shared.stop()
    own.start()
    try:
        yield own
    finally:
        own.stop()
        shared.start()


def training_job(name: str, replicas: int = 4, minimum: int = 2, **spec: Any) -> dict[str, Any]:
    """A small TrainingJob manifest (the container never runs: KWOK plays the kubelet)."""
    return {
        "apiVersion": API_VERSION, "kind": "TrainingJob", "metadata": {"name": name},
        "spec": {
            "workers": {"min": minimum, "replicas": replicas, "max": 16, "template": {"spec": {
                "containers": [{"name": "train", "image": "ringwright/training:dev"}]}}},
            **spec,
        },
    }


def tj_path(namespace: str, name: str | None = None, sub: str | None = None) -> str:
    return api_path(API_VERSION, "trainingjobs", namespace, name, sub)


def get_status(kube: KubeClient, namespace: str, name: str) -> dict[str, Any]:
    try:
        status: dict[str, Any] = kube.get(tj_path(namespace, name)).get("status") or {}
    except ApiError:
        return {}
    return status


def reconciled(kube: KubeClient, namespace: str, name: str, timeout: float = 60.0,
               meanwhile: Callable[[], object] | None = None) -> dict[str, Any]:
    """Wait until the operator has finished a round of job ``name`` that began after this
    call, and return the status that round wrote.

    The evidence is ``status.observedGeneration``: a harmless spec change (one more
    allowed worker, or one fewer at the limit) bumps ``metadata.generation``, and the
    operator writes the generation it read into the status last in its round, after its
    creates, deletes, world and events. So what had reached the operator's watches
    before this call (a pod, a report, a deleted member) it has acted on, or decided not
    to, once this returns: a "nothing changed" check after it is not a bet on how long
    the operator takes. (Each kind has its own watch: wait for the change itself to be
    visible, e.g. a pod Ready, before calling this.) ``meanwhile`` is called on every
    poll (e.g. to restart an operator that exited).
    """
    def nudged() -> int | None:
        try:
            workers = kube.get(tj_path(namespace, name))["spec"]["workers"]
            allowed = int(workers.get("max") or MAX_WORKERS)
            bumped = allowed + 1 if allowed < MAX_WORKERS else allowed - 1
            job = kube.merge_patch(tj_path(namespace, name),
                                   {"spec": {"workers": {"max": bumped}}})
        except ApiError:
            return None  # e.g. the API server is restarting: try again
        return int(job["metadata"]["generation"])

    def observed() -> dict[str, Any] | None:
        if meanwhile is not None:
            meanwhile()
        status = get_status(kube, namespace, name)
        return status if int(status.get("observedGeneration", 0)) >= generation else None

    generation = wait_for(nudged, f"{name}: a spec change to observe", timeout=timeout)
    return wait_for(observed, f"{name}: the operator to observe generation {generation}",
                    timeout=timeout)


@contextlib.contextmanager
def fresh_namespace(kube: KubeClient) -> Iterator[str]:
    """A new namespace with a random name, deleted afterwards."""
    name = f"t-{uuid.uuid4().hex[:10]}"
    kube.create(api_path("v1", "namespaces"), {"metadata": {"name": name}})
    yield name
    kube.delete(api_path("v1", "namespaces", name=name))
