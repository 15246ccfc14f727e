"""Run the real Kueue (built from its Go module) against the local cluster, on loopback.

Its CRDs and webhook configurations are read from the pinned module in the Go module
cache (data, applied as they are, never copied into this repository), with two changes
a loopback cluster needs:

* the webhooks' Service is an ExternalName Service pointing at 127.0.0.1, so the API
  server dials Kueue's webhook server on loopback while verifying the certificate for the
  Service's DNS name;
* only the webhooks for Kueue's own objects (``kueue.x-k8s.io``) are registered: the
  module also ships webhooks for Jobs, Pods, Deployments and other frameworks, which
  this Kueue does not manage (and a Pod webhook nobody serves would refuse every pod).

Certificates: Kueue's internal certificate management makes them (a CA and a serving
certificate for the Service's DNS name, injected into the webhook configurations and
CRD conversion webhooks). Kueue keeps them in a Secret and reads them from files, which a
kubelet would mount; here :func:`running_kueue` writes the Secret's keys into the
certificate folder itself. The cluster's own PKI cannot be used: with internal
management off, Kueue v0.17 reads its metrics certificate from the fixed path
/etc/kueue/metrics/certs, which a test must not write.
"""

from __future__ import annotations

import base64
import copy
import json
import logging
import os
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import yaml

from ringwright.kube import ApiError, KubeClient, api_path

from .build import BuildError, ensure_binaries
from .control_plane import Cluster, free_port
from .local_server import LocalServer
from .versions import KUEUE

log = logging.getLogger("ringwright.devcluster.kueue")

MODULE = "sigs.k8s.io/kueue"
NAMESPACE = "kueue-system"
SERVICE = "kueue-webhook-service"
SECRET = "kueue-webhook-server-cert"
WEBHOOK_CONFIGS = {"MutatingWebhookConfiguration": "kueue-mutating-webhook-configuration",
                   "ValidatingWebhookConfiguration": "kueue-validating-webhook-configuration"}
"""Names Kueue's certificate manager derives from the Service name (it injects CA bundles
into exactly these)."""
KUEUE_GROUP = "kueue.x-k8s.io"
API_VERSION = f"{KUEUE_GROUP}/v1beta2"
FRAMEWORKS = ("batch/job",)
"""Kueue refuses to start with no integration; Jobs are built in (ringwright publishes
Workloads itself, see docs/kueue.md)."""


def module_dir() -> Path:
    """The pinned Kueue module's folder in the Go module cache (downloaded when missing)."""
    go = shutil.which("go")
    if go is None:
        raise BuildError("the Go toolchain is not on PATH: Kueue's CRDs come from its Go "
                         "module; install Go 1.24+")
    proc = subprocess.run([go, "mod", "download", "-json", f"{MODULE}@{KUEUE}"],
                          capture_output=True, text=True, cwd=tempfile.gettempdir())
    if proc.returncode != 0:
        raise BuildError(f"go mod download {MODULE}@{KUEUE} failed: {proc.stdout[-2000:]}"
                         f"{proc.stderr[-2000:]}")
    return Path(json.loads(proc.stdout)["Dir"])


def _documents(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def _service_ref(port: int, path: str) -> dict[str, Any]:
    return {"namespace": NAMESPACE, "name": SERVICE, "port": port, "path": path}


def crds(module: Path, port: int) -> list[dict[str, Any]]:
    """Kueue's CRDs as its kustomization lists them, with its conversion-webhook patches
    pointed at the loopback webhook Service."""
    folder = module / "config" / "components" / "crd"
    kustomization = yaml.safe_load((folder / "kustomization.yaml").read_text())
    patches = {}
    for entry in kustomization.get("patches") or ():
        patch = yaml.safe_load((folder / entry["path"]).read_text())
        patches[patch["metadata"]["name"]] = patch["spec"]["conversion"]
    out = []
    for resource in kustomization["resources"]:
        (crd,) = _documents(folder / resource)
        conversion = patches.get(crd["metadata"]["name"])
        if conversion is not None:
            conversion = copy.deepcopy(conversion)
            conversion["webhook"]["clientConfig"]["service"] = _service_ref(
                port, conversion["webhook"]["clientConfig"]["service"]["path"])
            crd["spec"]["conversion"] = conversion
        out.append(crd)
    return out


def webhook_configurations(module: Path, port: int) -> list[dict[str, Any]]:
    """The module's webhook configurations, kept to Kueue's own objects, each webhook
    pointed at the loopback Service."""
    path = module / "config" / "components" / "webhook" / "manifests.yaml"
    out = []
    for config in _documents(path):
        kept = []
        for hook in config.get("webhooks") or ():
            groups = {g for rule in hook.get("rules") or () for g in rule.get("apiGroups") or ()}
            if groups != {KUEUE_GROUP}:
                continue
            hook = copy.deepcopy(hook)
            hook["clientConfig"] = {"service": _service_ref(
                port, hook["clientConfig"]["service"]["path"])}
            kept.append(hook)
        out.append({"apiVersion": config["apiVersion"], "kind": config["kind"],
                    "metadata": {"name": WEBHOOK_CONFIGS[config["kind"]]},
                    "webhooks": kept})
    return out


def configuration(webhook_port: int, health_port: int, cert_dir: Path) -> dict[str, Any]:
    """Kueue's Configuration: loopback only, no leader election, no metrics listener."""
    return {
        "apiVersion": "config.kueue.x-k8s.io/v1beta2", "kind": "Configuration",
        "namespace": NAMESPACE,
        "health": {"healthProbeBindAddress": f"127.0.0.1:{health_port}"},
        "metrics": {"bindAddress": "0"},
        "webhook": {"host": "127.0.0.1", "port": webhook_port, "certDir": str(cert_dir)},
        "leaderElection": {"leaderElect": False},
        "internalCertManagement": {"enable": True, "webhookServiceName": SERVICE,
                                   "webhookSecretName": SECRET},
        "integrations": {"frameworks": list(FRAMEWORKS)},
    }


def _apply(kube: KubeClient, obj: dict[str, Any], plural: str) -> None:
    group_version = obj["apiVersion"]
    meta = obj["metadata"]
    kube.apply(api_path(group_version, plural, meta.get("namespace"), meta["name"]), obj)


def install(kube: KubeClient, module: Path, webhook_port: int) -> None:
    """Namespace, the loopback Service, CRDs (established) and webhook configurations."""
    _apply(kube, {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}},
           "namespaces")
    _apply(kube, {"apiVersion": "v1", "kind": "Service",
                  "metadata": {"name": SERVICE, "namespace": NAMESPACE},
                  "spec": {"type": "ExternalName", "externalName": "127.0.0.1",
                           "ports": [{"name": "https", "port": webhook_port}]}}, "services")
    # Kueue's certificate manager fills this Secret; it must exist beforehand.
    _apply(kube, {"apiVersion": "v1", "kind": "Secret",
                  "metadata": {"name": SECRET, "namespace": NAMESPACE}}, "secrets")
    for crd in crds(module, webhook_port):
        _apply(kube, crd, "customresourcedefinitions")
    for config in webhook_configurations(module, webhook_port):
        plural = ("mutatingwebhookconfigurations"
                  if config["kind"].startswith("Mutating") else "validatingwebhookconfigurations")
        _apply(kube, config, plural)
    deadline = time.monotonic() + 60
    for crd in crds(module, webhook_port):
        name = crd["metadata"]["name"]
        while not _established(kube, name):
            if time.monotonic() > deadline:
                raise RuntimeError(f"CRD {name} not Established within 60s")
            time.sleep(0.2)


def _established(kube: KubeClient, name: str) -> bool:
    crd = kube.get(api_path("apiextensions.k8s.io/v1", "customresourcedefinitions", name=name))
    return any(c.get("type") == "Established" and c.get("status") == "True"
               for c in (crd.get("status") or {}).get("conditions") or ())


def uninstall(kube: KubeClient, timeout: float = 120.0) -> None:
    """Remove the webhook configurations (nothing may call a stopped Kueue) and the
    namespace, and wait until the namespace is gone: a Kueue started while it is still
    terminating would see its certificate Secret deleted under it. The CRDs stay: the
    next start applies them again."""
    for kind, name in WEBHOOK_CONFIGS.items():
        plural = ("mutatingwebhookconfigurations" if kind.startswith("Mutating")
                  else "validatingwebhookconfigurations")
        kube.delete(api_path("admissionregistration.k8s.io/v1", plural, name=name))
    namespace = api_path("v1", "namespaces", name=NAMESPACE)
    kube.delete(namespace)
    deadline = time.monotonic() + timeout
    while kube.get_or_none(namespace) is not None:
        if time.monotonic() > deadline:
            raise RuntimeError(f"namespace {NAMESPACE} still terminating after {timeout:.0f}s")
        time.sleep(0.5)


def _webhooks_answer(kube: KubeClient) -> bool:
    """A ResourceFlavor create passes Kueue's webhooks (served and trusted); the probe
    object is deleted again."""
    probe = api_path(API_VERSION, "resourceflavors", name="ringwright-webhook-probe")
    try:
        kube.apply(probe, {"apiVersion": API_VERSION, "kind": "ResourceFlavor",
                           "metadata": {"name": "ringwright-webhook-probe"}})
    except ApiError as err:
        log.debug("Kueue webhooks not answering yet: %s", err)
        return False
    kube.delete(probe)
    return True


def _mount_secret(kube: KubeClient, cert_dir: Path, stop: threading.Event) -> None:
    """Write the certificate Secret's keys into ``cert_dir`` whenever they change, as a
    kubelet does for a Secret volume (Kueue waits for the files before it serves)."""
    written: dict[str, str] = {}
    while not stop.wait(0.5):
        try:
            secret = kube.get(api_path("v1", "secrets", NAMESPACE, SECRET))
        except ApiError:
            continue
        for key, value in (secret.get("data") or {}).items():
            if written.get(key) != value:
                (cert_dir / key).write_bytes(base64.b64decode(value))
                written[key] = value


def feature_gates(elastic_topology: bool = False) -> str:
    """Kueue's ``--feature-gates``: its on-demand visibility API server off (it would
    listen on every interface), workload slices on (a queued job grows and shrinks,
    alpha in v0.17), and with ``elastic_topology`` also slices of jobs with a topology
    assignment (``ElasticJobsViaWorkloadSlicesWithTAS``, alpha in v0.17). That gate is a
    choice, not a default: under it Kueue v0.17 admits no pod set with a required or
    preferred topology request, elastic or not (docs/kueue.md)."""
    gates = {"VisibilityOnDemand": False, "ElasticJobsViaWorkloadSlices": True}
    if elastic_topology:
        gates["ElasticJobsViaWorkloadSlicesWithTAS"] = True
    return ",".join(f"{name}={str(on).lower()}" for name, on in gates.items())


@contextmanager
def running_kueue(cluster: Cluster, folder: Path, timeout: float = 180.0,
                  elastic_topology: bool = False) -> Iterator[None]:
    """Kueue installed and running against ``cluster`` until the block ends, with
    :func:`feature_gates` (``elastic_topology``); its log is ``folder/kueue.log``."""
    binary = ensure_binaries(("kueue",))["kueue"]
    module = module_dir()
    webhook_port, health_port = free_port(), free_port()
    cert_dir = folder / "certs"
    cert_dir.mkdir(parents=True, exist_ok=True)
    config = folder / "kueue-config.yaml"
    config.write_text(yaml.safe_dump(configuration(webhook_port, health_port, cert_dir)))
    server = LocalServer("kueue", folder / "kueue.log")
    stop = threading.Event()
    with cluster.client() as kube, cluster.client() as mounter:
        install(kube, module, webhook_port)
        volume = threading.Thread(target=_mount_secret, args=(mounter, cert_dir, stop),
                                  name="kueue-cert-volume", daemon=True)
        volume.start()
        try:
            server.start(
                [str(binary), f"--config={config}", "--zap-log-level=info",
                 f"--feature-gates={feature_gates(elastic_topology)}"],
                f"http://127.0.0.1:{health_port}/readyz", timeout,
                env={**os.environ, "KUBECONFIG": str(cluster.kubeconfig)})
            deadline = time.monotonic() + timeout
            while not _webhooks_answer(kube):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"Kueue's webhooks did not answer within {timeout:.0f}s;"
                                       f" see {server.log_path}")
                time.sleep(0.5)
            yield
        finally:
            server.stop()
            stop.set()
            volume.join()
            uninstall(kube)
