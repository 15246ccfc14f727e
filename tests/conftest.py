"""Shared fixtures: one local cluster per test session, one namespace per test.

With ``CI=true`` nothing may skip except tests marked ``gpu``: a missing optional
dependency (celpy, horovod, helm, the cluster's binaries) fails the run instead.

Under pytest-xdist (``make test`` runs ``--dist loadgroup``) every test that uses the
``cluster`` fixture, directly or through ``kube``/``namespace``/``operator``, joins one
xdist group, so a single worker starts the one control plane and runs them all; see
tests/README.md.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from collections.abc import Generator, Iterator
from pathlib import Path
from typing import Any

import pytest

from ringwright.devcluster.build import OVERRIDE_VARS
from ringwright.devcluster.control_plane import Cluster
from ringwright.devcluster.install import install_api
from ringwright.kube import KubeClient
from tests.jobs import OperatorProcess, fresh_namespace
from tests.xdist_groups import assign_groups

IN_CI = os.environ.get("CI", "").lower() == "true"


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Cluster tests share one xdist worker (and so one control plane); see
    tests/xdist_groups.py. ``loadgroup`` is set on xdist's workers only."""
    assign_groups(items, loadgroup=bool(getattr(config.option, "loadgroup", False)))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]
                              ) -> Generator[None, Any, None]:
    """In CI a skip (importorskip, skipif, pytest.skip in a fixture) is a failure,
    unless the test is marked ``gpu``: CI machines have no GPU, and say so."""
    outcome = yield
    report: pytest.TestReport = outcome.get_result()
    if not IN_CI or not report.skipped or hasattr(report, "wasxfail") \
            or item.get_closest_marker("gpu") is not None:
        return
    _fail_skip(report)


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector: pytest.Collector) -> Generator[None, Any, None]:
    """A module that skips itself at import (a top-level importorskip) fails in CI too."""
    outcome = yield
    report: pytest.CollectReport = outcome.get_result()
    if IN_CI and report.skipped:
        _fail_skip(report)


def _fail_skip(report: pytest.TestReport | pytest.CollectReport) -> None:
    report.outcome = "failed"
    report.longrepr = (f"skipped with CI=true (only `gpu`-marked tests may skip): "
                       f"{report.longrepr}")


def _cannot_build_reason() -> str | None:
    if shutil.which("go") or any(os.environ.get(v) for v in OVERRIDE_VARS):
        return None
    return ("the local cluster needs the Go toolchain to build its binaries once "
            "(install Go 1.24+), or RINGWRIGHT_BIN_DIR pointing at prebuilt binaries")


@pytest.fixture(autouse=True)
def _horovod_present(request: pytest.FixtureRequest) -> None:
    """Tests marked ``horovod`` need it installed: a skip locally, a failure in CI."""
    if request.node.get_closest_marker("horovod") is None:
        return
    if importlib.util.find_spec("horovod") is None:
        msg = "horovod is not installed here: `make env` builds it (scripts/build_horovod.sh)"
        if IN_CI:
            pytest.fail(msg)
        pytest.skip(msg)


@pytest.fixture(scope="session")
def cluster() -> Iterator[Cluster]:
    """A real control plane (etcd, apiserver, controller-manager, scheduler, KWOK)."""
    reason = _cannot_build_reason()
    if reason and not IN_CI:
        pytest.skip(reason)
    root = Path(tempfile.mkdtemp(prefix="ringwright-test-cluster-"))
    handle = Cluster(name="ringwright-test", root=root)
    try:
        handle.up("default")
        yield handle
    finally:
        handle.down()
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture()
def kube(cluster: Cluster) -> Iterator[KubeClient]:
    with cluster.client() as client:
        yield client


@pytest.fixture()
def namespace(kube: KubeClient) -> Iterator[str]:
    """A fresh namespace, deleted after the test."""
    with fresh_namespace(kube) as name:
        yield name


@pytest.fixture(scope="session")
def api(cluster: Cluster) -> None:
    """CRDs, PriorityClasses and the default SchedulingPolicy, installed once."""
    with cluster.client() as kube:
        install_api(kube)


@pytest.fixture(scope="session")
def operator(cluster: Cluster, api: None, tmp_path_factory: pytest.TempPathFactory
             ) -> Iterator[OperatorProcess]:
    """The operator as a real process (shared; a test may kill and restart it)."""
    proc = OperatorProcess(cluster, tmp_path_factory.mktemp("operator") / "operator.log")
    proc.start()
    yield proc
    proc.stop()
