"""Pinned Go components: the cluster needs only its own; Prometheus builds from our go.mod."""

from __future__ import annotations

from ringwright.devcluster.versions import COMPONENTS, CONTROL_PLANE, GO_DIR, PROMETHEUS


def test_the_cluster_starts_without_test_tools() -> None:
    assert set(CONTROL_PLANE) == {"kube-apiserver", "kube-controller-manager", "kube-scheduler",
                                  "etcd", "kwok", "helm"}
    assert {c.name for c in COMPONENTS} == {*CONTROL_PLANE, "prometheus", "kubelet",
                                                "minio", "kueue"}


def test_prometheus_is_pinned_in_its_go_module() -> None:
    prometheus = next(c for c in COMPONENTS if c.name == "prometheus")
    go_mod = (GO_DIR / prometheus.module_dir / "go.mod").read_text()
    assert f"github.com/prometheus/prometheus {PROMETHEUS}" in go_mod
    assert (GO_DIR / prometheus.module_dir / "go.sum").is_file()
    assert prometheus.key().startswith(f"prometheus-{PROMETHEUS}-")
