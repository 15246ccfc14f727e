"""Pinned versions of the control-plane binaries and where their builds are cached."""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

KUBERNETES = "v1.33.13"
ETCD = "v3.5.35"
KWOK = "v0.7.0"
HELM = "v3.19.0"
PROMETHEUS = "v0.315.1"
"""The Go module version of Prometheus 3.15.1 (Prometheus tags v3.x.y as v0.3xx.y)."""
MINIO = "v0.0.0-20260212201848-7aac2a2c5b7c"
"""MinIO's newest source on the module proxy (it tags releases as RELEASE.<date>, which Go
does not read as versions, so the module is known by this pseudo-version)."""

KUEUE = "v0.17.0"
"""Kueue, the Kubernetes job queue (the tests of the Kueue integration run it)."""

GO_DIR = Path(__file__).resolve().parent / "go"


def cache_root() -> Path:
    """``$RINGWRIGHT_CACHE`` or ``~/.cache/ringwright``: binaries, wheels, cluster state."""
    return Path(os.environ.get("RINGWRIGHT_CACHE") or Path.home() / ".cache" / "ringwright")


@dataclass(frozen=True)
class Component:
    """One binary: how to build it and the key its cache entry is stored under."""

    name: str
    version: str
    module_dir: str
    """Folder under ``GO_DIR`` holding our go.mod, or "" for `go install pkg@version`."""
    package: str
    ldflags: tuple[str, ...] = ()
    control_plane: bool = True
    """Needed to start the local cluster; False for what only some tests run (Prometheus,
    the kubelet of real nodes)."""
    tags: tuple[str, ...] = ()
    """Go build tags."""

    def key(self) -> str:
        """Version plus a digest of our build inputs, so editing them rebuilds."""
        digest = hashlib.sha256("\n".join((self.package, *self.ldflags, *self.tags)).encode())
        if self.module_dir:
            for f in sorted((GO_DIR / self.module_dir).rglob("*")):
                if f.is_file():
                    digest.update(f.name.encode())
                    digest.update(f.read_bytes())
        return f"{self.name}-{self.version}-{digest.hexdigest()[:12]}"


def _kube_ldflags() -> tuple[str, ...]:
    major, minor = KUBERNETES.lstrip("v").split(".")[:2]
    pkg = "k8s.io/component-base/version"
    return (
        f"-X {pkg}.gitVersion={KUBERNETES}",
        f"-X {pkg}.gitMajor={major}",
        f"-X {pkg}.gitMinor={minor}",
        f"-X {pkg}.gitTreeState=clean",
    )


COMPONENTS: tuple[Component, ...] = (
    Component("kube-apiserver", KUBERNETES, "kube", "./cmd/kube-apiserver", _kube_ldflags()),
    Component(
        "kube-controller-manager", KUBERNETES, "kube", "./cmd/kube-controller-manager",
        _kube_ldflags(),
    ),
    Component("kube-scheduler", KUBERNETES, "kube", "./cmd/kube-scheduler", _kube_ldflags()),
    Component("etcd", ETCD, "etcd", "."),
    Component("kwok", KWOK, "", f"sigs.k8s.io/kwok/cmd/kwok@{KWOK}"),
    Component(
        "helm", HELM, "", f"helm.sh/helm/v3/cmd/helm@{HELM}",
        (f"-X helm.sh/helm/v3/internal/version.version={HELM}",),
    ),
    # The node agent of the real nodes (devcluster/realnode.py) that run containers
    # beside the KWOK nodes; a cluster starts without it.
    Component("kubelet", KUBERNETES, "kube", "./cmd/kubelet", _kube_ldflags(),
              control_plane=False),
    # A real Prometheus for the metrics tests. Its module carries replace directives,
    # which `go install pkg@version` refuses, so it builds inside our own go.mod. Of its
    # service discoveries only Kubernetes' is used: the others (cloud SDKs, most of its
    # compile time) are left out by its own build tags.
    Component("prometheus", PROMETHEUS, "prometheus",
              "github.com/prometheus/prometheus/cmd/prometheus", control_plane=False,
              tags=("remove_all_sd", "enable_kubernetes_sd")),
    # A real S3-compatible server for the tests of checkpoints in object storage.
    Component("minio", MINIO, "", f"github.com/minio/minio@{MINIO}", control_plane=False),
    # Kueue's manager, for the tests of queueing TrainingJobs (devcluster/kueue.py).
    Component("kueue", KUEUE, "", f"sigs.k8s.io/kueue/cmd/kueue@{KUEUE}",
              control_plane=False),
)

CONTROL_PLANE = tuple(c.name for c in COMPONENTS if c.control_plane)
"""The binaries a local cluster runs."""
