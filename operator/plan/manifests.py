"""Builders of whole manifests for the objects a job owns.

Pure functions: they take the job (and placement) and return complete objects,
so unit tests read them without a cluster and the apply layer only sends them.
"""

from __future__ import annotations

import copy
from typing import Any

from ringwright.objects import Obj
from ringwright.world import (
    DEFAULT_METRICS_PORT,
    Env,
    reports_configmap_name,
    world_configmap_name,
)

from .generations import GENERATION_ANNOTATION, LEGACY_GENERATION_ANNOTATION

RESERVED_PREFIX = "ringwright.dev/"
"""Label and annotation keys the operator alone sets (admission refuses them in templates)."""
JOB_LABEL = f"{RESERVED_PREFIX}job"
ROLE_LABEL = "ringwright.dev/role"
INDEX_LABEL = "ringwright.dev/index"
LEAVING_ANNOTATION = "ringwright.dev/leaving-since"
"""Set on a pod that a scale-down removed from the world; it is deleted once it exits."""
PUBLISHED_ANNOTATION = "ringwright.dev/published-at"
"""On the world ConfigMap: when the operator wrote its document (epoch seconds, the
operator's clock). A container that started after it holds no process of that world."""

PLANNED_NODE_ANNOTATION = "ringwright.dev/planned-node"
"""The node the placement plan chose for a pod: its room is counted there until it binds."""

WORKER = "worker"
PS = "ps"
HEALTH_FILE = "/tmp/ringwright/healthy"
"""The runtime keeps this file while its training loop makes progress."""
READINESS_PORT = 29401
"""The runtime serves ``/readyz`` here (on the pod IP): a frozen process cannot answer."""


LAUNCH_COMMAND = ("python", "-m", "ringwright.runtime.launch", "--")
"""The pod entry point that starts one training process per local rank; the training
container's own command and args follow it."""
SHM_VOLUME = "ringwright-shm"
SHM_PATH = "/dev/shm"
NCCL_HOSTID = "NCCL_HOSTID"
"""NCCL takes processes with the same host id for one host (P2P and SHM transports)."""


def procs_per_pod(job: Obj) -> int:
    """``spec.workers.numProcPerNode`` as a number: ``auto`` is one per GPU when a pod has
    several GPUs, else 1."""
    spec = job["spec"]
    wanted = spec["workers"].get("numProcPerNode", "auto")
    if wanted != "auto":
        return int(wanted)
    gpus = int(spec.get("gpusPerWorker", 1))
    return gpus if gpus > 1 else 1


def runtime_account_name(job: str) -> str:
    """ServiceAccount (and Role, RoleBinding) the job's pods run as."""
    return f"{job}-runtime"


def pod_name(job: str, role: str, index: int) -> str:
    return f"{job}-{role}-{index}"


def owner_reference(job: Obj) -> Obj:
    """Controller reference to the TrainingJob, so deleting it collects everything."""
    meta = job["metadata"]
    return {
        "apiVersion": job["apiVersion"],
        "kind": job["kind"],
        "name": meta["name"],
        "uid": meta["uid"],
        "controller": True,
        "blockOwnerDeletion": True,
    }


def _meta(job: Obj, name: str, labels: dict[str, str] | None = None) -> Obj:
    return {
        "name": name,
        "namespace": job["metadata"]["namespace"],
        # The job label last: it ties the object to this job, whatever else was passed.
        "labels": {**(labels or {}), JOB_LABEL: job["metadata"]["name"]},
        "ownerReferences": [owner_reference(job)],
    }


def scaffold(job: Obj) -> list[Obj]:
    """The per-job objects besides pods: identity, RBAC, DNS, world and reports."""
    name = job["metadata"]["name"]
    account = runtime_account_name(name)
    world_cm, reports_cm = world_configmap_name(name), reports_configmap_name(name)
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": _meta(job, account)},
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "Role",
            "metadata": _meta(job, account),
            # Pods may read their own job's world and write reports; nothing else (not
            # even read the reports back: each writes its own key by merge patch).
            "rules": [
                {"apiGroups": [""], "resources": ["configmaps"], "resourceNames": [world_cm],
                 "verbs": ["get", "list", "watch"]},
                {"apiGroups": [""], "resources": ["configmaps"], "resourceNames": [reports_cm],
                 "verbs": ["patch"]},
            ],
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "RoleBinding",
            "metadata": _meta(job, account),
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                        "name": account},
            "subjects": [{"kind": "ServiceAccount", "name": account,
                          "namespace": job["metadata"]["namespace"]}],
        },
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": _meta(job, name),
            "spec": {
                "clusterIP": "None",
                "selector": {JOB_LABEL: name},
                # Members must resolve each other before they report ready.
                "publishNotReadyAddresses": True,
            },
        },
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": _meta(job, reports_cm), "data": {}},
    ]


def world_configmap(job: Obj, world_json: str, generation: int, published_at: float) -> Obj:
    """The world ConfigMap with the given document, its generation also kept as an annotation
    (which a corrupted document leaves readable), under both its names, and when it was
    written (``published_at``, epoch seconds)."""
    name = job["metadata"]["name"]
    meta = _meta(job, world_configmap_name(name))
    meta["annotations"] = {GENERATION_ANNOTATION: str(generation),
                           LEGACY_GENERATION_ANNOTATION: str(generation),
                           PUBLISHED_ANNOTATION: f"{published_at:.3f}"}
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": meta,
        "data": {"world.json": world_json},
    }


def published_at(configmap: Obj | None) -> float | None:
    """The world ConfigMap's :data:`PUBLISHED_ANNOTATION`; None when absent or unreadable
    (a world written by an older operator)."""
    annotations = ((configmap or {}).get("metadata") or {}).get("annotations") or {}
    try:
        return float(annotations[PUBLISHED_ANNOTATION])
    except (KeyError, TypeError, ValueError):
        return None


METRICS_PORT_NAME = "metrics"
"""The training container's port that a PodMonitor scrapes."""

DEFAULT_GRACE_SECONDS = 30
"""Kubernetes' terminationGracePeriodSeconds when the template sets none."""


def _env(job: Obj, role: str, grace_seconds: int) -> list[Obj]:
    name = job["metadata"]["name"]

    def field(path: str) -> Obj:
        return {"valueFrom": {"fieldRef": {"fieldPath": path}}}

    return [
        {"name": Env.JOB_NAME, "value": name},
        {"name": Env.NAMESPACE, **field("metadata.namespace")},
        {"name": Env.POD_NAME, **field("metadata.name")},
        {"name": Env.POD_UID, **field("metadata.uid")},
        {"name": Env.POD_IP, **field("status.podIP")},
        {"name": Env.ROLE, "value": role},
        {"name": Env.WORLD_CONFIGMAP, "value": world_configmap_name(name)},
        {"name": Env.REPORTS_CONFIGMAP, "value": reports_configmap_name(name)},
        {"name": Env.BACKEND, "value": job["spec"].get("backend", "torch")},
        {"name": Env.HEALTH_FILE, "value": HEALTH_FILE},
        {"name": Env.READINESS_PORT, "value": str(READINESS_PORT)},
        {"name": Env.TERMINATION_GRACE, "value": str(grace_seconds)},
        *_fault_tolerance_env(job),
        *_ps_env(job),
        *_object_storage_env(job),
        {"name": Env.METRICS_PORT, "value": str(DEFAULT_METRICS_PORT)},
        # Pods of one node are one host to NCCL: its own host id (boot id, namespaces)
        # differs between containers on some runtimes.
        {"name": NCCL_HOSTID, **field("spec.nodeName")},
        *([{"name": Env.PROCS_PER_POD, "value": str(procs_per_pod(job))}]
          if role == WORKER else []),
    ]


def _fault_tolerance_env(job: Obj) -> list[Obj]:
    ft = job["spec"].get("faultTolerance") or {}
    values = [
        (Env.FAILURE_DETECT, ft.get("failureDetectSeconds")),
        (Env.COLLECTIVE_TIMEOUT, ft.get("collectiveTimeoutSeconds")),
        (Env.STALL_TIMEOUT, ft.get("stallTimeoutSeconds")),
    ]
    # Unset fields keep the runtime's defaults, which are the schema's defaults.
    return [{"name": name, "value": str(v)} for name, v in values if v is not None]


S3_SECRET_KEYS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN")
"""The keys of spec.checkpoint.credentialsSecret, each set as the variable of its name."""


def _object_storage_env(job: Obj) -> list[Obj]:
    """spec.checkpoint's object storage settings, as the standard variables an S3 client
    reads; the credentials stay in their Secret (the pod references them)."""
    ckpt = job["spec"].get("checkpoint") or {}
    env: list[Obj] = []
    if ckpt.get("endpoint"):
        env.append({"name": "AWS_ENDPOINT_URL_S3", "value": ckpt["endpoint"]})
    if ckpt.get("region"):
        env.append({"name": "AWS_REGION", "value": ckpt["region"]})
    if secret := ckpt.get("credentialsSecret"):
        env.extend(
            {"name": key, "valueFrom": {"secretKeyRef": {
                "name": secret, "key": key, "optional": key == "AWS_SESSION_TOKEN"}}}
            for key in S3_SECRET_KEYS
        )
    return env


def _unreserved(keys: dict[str, str] | None) -> dict[str, str]:
    """Template labels or annotations without the operator's own keys (admission refuses
    them; an object stored before that rule existed must not steer another job's pods)."""
    return {k: v for k, v in (keys or {}).items() if not k.startswith(RESERVED_PREFIX)}


def _readiness_probe(role: str) -> Obj:
    """Each role's own readiness: a worker's runtime serves ``/readyz`` (a stopped or
    stalled training loop fails it); a parameter server keeps the health file while it
    serves (removed when requests wait and none completes; its shard port would still
    accept connections), and is unready until it is up, so it does not flap while
    its process starts."""
    timing = {"periodSeconds": 5, "timeoutSeconds": 2, "failureThreshold": 2}
    if role == PS:
        return {"exec": {"command": ["test", "-f", HEALTH_FILE]}, **timing}
    return {"httpGet": {"path": "/readyz", "port": READINESS_PORT}, **timing}


def _ps_env(job: Obj) -> list[Obj]:
    """spec.ps's consistency settings, which the workers hand to the servers, and its
    shard count, with which the first worker creates the shards."""
    ps = job["spec"].get("ps")
    if ps is None:
        return []
    values = [
        (Env.PS_CONSISTENCY, ps.get("consistency", "Sync")),
        (Env.PS_STALENESS, ps.get("staleness")),
        (Env.PS_BACKUP_WORKERS, ps.get("backupWorkers")),
        (Env.PS_REQUEUE_STALE, str(bool(ps.get("requeueStale", False))).lower()),
        (Env.PS_SHARDS, ps.get("shards")),
    ]
    return [{"name": name, "value": str(v)} for name, v in values if v is not None]


def _shared_memory(spec: Obj, main: Obj) -> None:
    """A memory-backed /dev/shm for the training container (the container runtime's
    default is 64 MiB): NCCL's SHM transport and buffers between local ranks, and
    DataLoader workers, live there. Counted against the pod's memory limit. A template
    that mounts its own /dev/shm keeps it."""
    if any(m.get("mountPath") == SHM_PATH for m in main.get("volumeMounts") or ()):
        return
    volumes = [v for v in spec.get("volumes") or [] if v.get("name") != SHM_VOLUME]
    spec["volumes"] = [*volumes, {"name": SHM_VOLUME, "emptyDir": {"medium": "Memory"}}]
    main["volumeMounts"] = [*(main.get("volumeMounts") or []),
                            {"name": SHM_VOLUME, "mountPath": SHM_PATH}]


def pod(job: Obj, role: str, index: int, placement: Obj) -> Obj:
    """A worker or ps pod from the role's template, with the operator's additions.

    ``placement`` holds the fields the placement planner decided (``affinity``,
    ``priorityClassName``, ``resources`` for the training container); they replace
    whatever the template set for them.
    """
    name = job["metadata"]["name"]
    spec_key = "workers" if role == WORKER else "ps"
    template = copy.deepcopy(job["spec"][spec_key]["template"])
    tmeta: dict[str, Any] = template.get("metadata") or {}
    spec: Obj = template["spec"]
    labels = {**_unreserved(tmeta.get("labels")), ROLE_LABEL: role, INDEX_LABEL: str(index)}
    meta = _meta(job, pod_name(name, role, index), labels)
    meta["annotations"] = _unreserved(tmeta.get("annotations"))
    if placement.get("plannedNode"):
        meta["annotations"][PLANNED_NODE_ANNOTATION] = placement["plannedNode"]

    main = spec["containers"][0]
    env = _env(job, role, spec.get("terminationGracePeriodSeconds", DEFAULT_GRACE_SECONDS))
    known = {e["name"] for e in env}
    main["env"] = [e for e in main.get("env", []) if e.get("name") not in known] + env
    if "resources" in placement:
        main["resources"] = placement["resources"]
    pinned = placement.get("containerResources") or {}
    for key in ("initContainers", "containers"):
        for container in spec.get(key) or ():
            if container.get("name") in pinned:
                container["resources"] = copy.deepcopy(pinned[container["name"]])
    ports = [p for p in main.get("ports") or [] if p.get("name") != METRICS_PORT_NAME]
    main["ports"] = [*ports, {"name": METRICS_PORT_NAME, "containerPort": DEFAULT_METRICS_PORT,
                              "protocol": "TCP"}]
    main.setdefault("readinessProbe", _readiness_probe(role))
    if role == WORKER and procs_per_pod(job) > 1 and main.get("command"):
        # Without a command the image's entry point runs, which cannot be wrapped: the
        # runtime then says so in the log (ringwright.runtime.launch).
        main["args"] = [*main["command"], *main.get("args", [])]
        main["command"] = list(LAUNCH_COMMAND)
    _shared_memory(spec, main)
    spec.update({
        "serviceAccountName": runtime_account_name(name),
        "automountServiceAccountToken": True,
        # A crashed process restarts in the same pod (same IP, no state); a planned
        # leave exits 0 and the pod completes.
        "restartPolicy": "OnFailure",
        "hostname": pod_name(name, role, index),
        "subdomain": name,
    })
    for key in ("affinity", "priorityClassName", "tolerations"):
        if key in placement:
            spec[key] = placement[key]
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": spec}
