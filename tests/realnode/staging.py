"""The test worker staged on a hostPath for containers of the ``training`` image, which
carries no tests: the worker script and its trace folder in one folder of this host,
mounted at :data:`MOUNT`, and the SchedulingPolicy that lets a job mount it."""

from __future__ import annotations

import shutil
from collections.abc import Mapping
from pathlib import Path

from ringwright.kube import KubeClient, api_path
from ringwright.objects import Obj

WORKER = Path(__file__).resolve().parents[1] / "runtime" / "elastic_worker.py"
MOUNT = "/bench"
"""Where the staged folder appears in the container."""


def stage_worker(folder: Path) -> Path:
    """Copy the worker into ``folder`` (created) beside an empty trace folder, both
    writable by the image's uid 10001 (a hostPath gets no fsGroup); the trace folder."""
    traces = folder / "trace"
    traces.mkdir(parents=True)
    shutil.copy(WORKER, folder / WORKER.name)
    for path in (folder, traces):
        path.chmod(0o777)
    return traces


def run_staged_worker(pod_spec: Obj, image: str, folder: Path,
                      env: Mapping[str, str]) -> None:
    """Make ``pod_spec``'s container run the worker staged in ``folder`` in ``image``,
    with ``env`` added to its environment and its traces written to the staged folder."""
    container = pod_spec["containers"][0]
    container.update(image=image, command=["python", f"{MOUNT}/{WORKER.name}"],
                     volumeMounts=[{"name": "bench", "mountPath": MOUNT}])
    container["env"] = [*container.get("env", []),
                        *({"name": k, "value": v}
                          for k, v in {**env, "TRACE_DIR": f"{MOUNT}/trace"}.items())]
    pod_spec["volumes"] = [{"name": "bench",
                            "hostPath": {"path": str(folder), "type": "Directory"}}]


def hostpath_policy(kube: KubeClient, namespace: str, folder: Path) -> str:
    """A SchedulingPolicy that lets templates mount ``folder`` (hostPath volumes are
    refused by default); its name. The namespace's teardown does not remove it: the
    caller's finalizer does."""
    name = f"{namespace}-hostpath"
    kube.create(api_path("ringwright.dev/v1alpha1", "schedulingpolicies"), {
        "apiVersion": "ringwright.dev/v1alpha1", "kind": "SchedulingPolicy",
        "metadata": {"name": name},
        "spec": {"templates": {"allowedHostPaths": [str(folder)]}}})
    return name
