"""Pinned Go components: the cluster needs only its own; Prometheus builds from our go.mod."""

from __future__ import annotations

import subprocess
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from ringwright.devcluster import build
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


def test_build_tags_reach_go_and_the_cache_key(monkeypatch: pytest.MonkeyPatch,
                                               tmp_path: Path) -> None:
    prometheus = next(c for c in COMPONENTS if c.name == "prometheus")
    assert prometheus.key() != replace(prometheus, tags=()).key(), "a tag change rebuilds"
    ran: list[list[str]] = []

    def go(cmd: list[str], **_: Any) -> subprocess.CompletedProcess[str]:
        ran.append(cmd)
        (Path(cmd[cmd.index("-o") + 1])).write_text("binary")
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(subprocess, "run", go)
    monkeypatch.setattr(build, "_go", lambda: "go")
    build._build(prometheus, tmp_path / "bin" / "prometheus")
    (cmd,) = ran
    assert cmd[cmd.index("-tags") + 1] == "remove_all_sd,enable_kubernetes_sd"
