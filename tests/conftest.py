"""Shared fixtures: one local cluster per test session, one namespace per test.

With ``CI=true`` nothing may skip except tests marked ``gpu``: a missing optional
dependency (celpy, horovod, helm, the cluster's binaries) fails the run instead.
Without it every skip is listed, with its reason, in a banner at the end of the run.

Randomness replays: every test starts with ``random`` (and numpy's and torch's global
generators) seeded from the run's seed, printed as ``seed=N`` (tests/seeds.py); the
Hypothesis profile is chosen here too (tests/README.md).

Reruns are opt-in: a test may be rerun only under ``@pytest.mark.flaky(reruns=N,
reason="...")``, and the reason is required.

Under pytest-xdist (``make test`` runs ``--dist loadgroup``) every test that uses the
``cluster`` fixture, directly or through ``kube``/``namespace``/``operator``, joins one
xdist group, so a single worker starts the one control plane and runs them all; see
tests/README.md.
"""

from __future__ import annotations

import collections
import importlib.util
import os
import shutil
import tempfile
from collections.abc import Generator, Iterator
from pathlib import Path
from typing import Any

import hypothesis
import pytest
from _pytest.terminal import TerminalReporter

from ringwright.devcluster.build import OVERRIDE_VARS, BuildError, cached_path, ensure_binaries
from ringwright.devcluster.control_plane import Cluster
from ringwright.devcluster.install import install_api
from ringwright.devcluster.s3server import S3Server
from ringwright.devcluster.versions import COMPONENTS
from ringwright.kube import KubeClient
from ringwright.runtime.local import forkserver
from tests.jobs import OperatorProcess, fresh_namespace
from tests.s3 import S3Bucket, new_bucket
from tests.seeds import SEED_VAR, run_seed, seed_generators, seed_of_test
from tests.standin import JoiningStandIn
from tests.xdist_groups import assign_groups, lane_seconds, plain_nodeid

IN_CI = os.environ.get("CI", "").lower() == "true"

# The launchers and harnesses fork their Python workers from a server that imported torch
# once (runtime/local/forkserver.py): about two CPU-seconds saved per worker on a machine
# the run keeps busy. A test of start-up itself passes fork_workers=False.
os.environ.setdefault(forkserver.SETTING, "1")

pytest_plugins = ("tests.queueing",)
"""Kueue's fixtures, for the modules that queue jobs through it."""

# No deadline: a per-example time limit is a wall-clock assertion, and fails on a loaded
# machine. In CI the examples are derived from each test (derandomize), so a failure
# there fails again on every rerun; elsewhere they are random, and a failure prints the
# blob that replays it (@reproduce_failure) and is kept in .hypothesis/ for the next run.
hypothesis.settings.register_profile("ci", derandomize=True, deadline=None, print_blob=True)
hypothesis.settings.register_profile("dev", deadline=None, print_blob=True)
hypothesis.settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE")
                                 or ("ci" if IN_CI else "dev"))

RUN_SEED = run_seed()
"""Drawn at import, in the controller before any xdist worker starts (they inherit it)."""


def pytest_report_header(config: pytest.Config) -> str:
    """The run's seed, and how to replay it."""
    return f"seed={RUN_SEED} (replay: {SEED_VAR}={RUN_SEED})"


@pytest.fixture(autouse=True)
def seed(request: pytest.FixtureRequest) -> int:
    """This test's seed (from the run's and the test's id); the global generators start
    from it. A test that draws random numbers itself takes ``random.Random(seed)``."""
    value = seed_of_test(RUN_SEED, plain_nodeid(request.node))
    seed_generators(value)
    return value


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Cluster tests share one xdist worker (and so one control plane); see
    tests/xdist_groups.py. ``loadgroup`` is set on xdist's workers only. A ``flaky``
    mark without a reason is refused."""
    unexplained = [item.nodeid for item in items
                   if any(not str(m.kwargs.get("reason", "")).strip()
                          for m in item.iter_markers("flaky"))]
    if unexplained:
        raise pytest.UsageError(
            "@pytest.mark.flaky needs reason=\"why it fails now and then\": "
            + ", ".join(unexplained))
    assign_groups(items, loadgroup=bool(getattr(config.option, "loadgroup", False)))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]
                              ) -> Generator[None, Any, None]:
    """In CI a skip (importorskip, skipif, pytest.skip in a fixture) is a failure,
    unless the test is marked ``gpu``: CI machines have no GPU, and say so."""
    outcome = yield
    report: pytest.TestReport = outcome.get_result()
    if report.failed:
        report.sections.append(("seed", f"seed={RUN_SEED}: {SEED_VAR}={RUN_SEED} replays "
                                        "this test's random draws"))
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


def pytest_terminal_summary(terminalreporter: TerminalReporter) -> None:
    """The run's seed (``-q`` hides the header), the seconds spent per xdist lane, and
    every skip, by reason, in a banner:
    a run that skipped tests did not test everything, and a line in the short summary
    is easy to miss."""
    terminalreporter.write_line(pytest_report_header(terminalreporter.config))
    lanes = lane_seconds(r for reports in terminalreporter.stats.values() for r in reports)
    if len(lanes) > 1:
        by_time = sorted(lanes.items(), key=lambda kv: -kv[1])
        terminalreporter.write_line("test seconds by lane (a group runs on one worker): "
                                    + ", ".join(f"{name} {s:.0f}" for name, s in by_time))
    reasons: dict[str, list[str]] = collections.defaultdict(list)
    for report in terminalreporter.stats.get("skipped", []):
        longrepr = report.longrepr
        reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
        reasons[reason.removeprefix("Skipped: ")].append(report.nodeid)
    if not reasons:
        return
    total = sum(len(ids) for ids in reasons.values())
    terminalreporter.section(f"{total} SKIPPED: this run did not test everything", sep="!",
                             red=True, bold=True)
    for reason, ids in sorted(reasons.items(), key=lambda kv: -len(kv[1])):
        terminalreporter.write_line(f"{len(ids)} skipped: {reason}", yellow=True, bold=True)
        for nodeid in ids[:5]:
            terminalreporter.write_line(f"    {nodeid}")
        if len(ids) > 5:
            terminalreporter.write_line(f"    ... and {len(ids) - 5} more")


def _cannot_build_reason() -> str | None:
    """Why the cluster's binaries can be neither found nor built here, or None."""
    missing = [c.name for c in COMPONENTS if c.control_plane and not cached_path(c).is_file()]
    if not missing or shutil.which("go") or any(os.environ.get(v) for v in OVERRIDE_VARS):
        return None
    return (f"the local cluster's binaries are missing ({', '.join(missing)}) and Go is not "
            "installed to build them: install Go 1.24+ and run `make binaries`, or point "
            "RINGWRIGHT_BIN_DIR at prebuilt binaries")


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
    """A real control plane (etcd, apiserver, controller-manager, scheduler, KWOK), with a
    stand-in for the one report a KWOK pod's runtime would write (:mod:`tests.standin`)."""
    reason = _cannot_build_reason()
    if reason and not IN_CI:
        pytest.skip(reason)
    root = Path(tempfile.mkdtemp(prefix="ringwright-test-cluster-"))
    handle = Cluster(name="ringwright-test", root=root)
    stand_in = JoiningStandIn(handle.client)
    try:
        handle.up("default")
        stand_in.start()
        yield handle
    finally:
        stand_in.stop()
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
    """The operator as a real process (shared; a test may kill and restart it), started
    again whenever it exits on its own, as its Deployment would."""
    proc = OperatorProcess(cluster, tmp_path_factory.mktemp("operator") / "operator.log",
                           supervised=True)
    proc.start()
    yield proc
    proc.stop()


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    """A real S3 server (MinIO, built from its Go module on first use) on a free port."""
    try:
        binary = ensure_binaries(("minio",))["minio"]
    except BuildError as err:
        if IN_CI:
            raise
        pytest.skip(f"the S3 test server cannot be built here (`make binaries`): {err}")
    server = S3Server(binary, tmp_path_factory.mktemp("s3"))
    server.start()
    yield server
    server.stop()


@pytest.fixture()
def s3_bucket(s3_server: S3Server, monkeypatch: pytest.MonkeyPatch) -> S3Bucket:
    """A fresh bucket on the test S3 server; the AWS_* variables point at it (processes
    the test starts inherit them)."""
    for name, value in s3_server.env().items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("AWS_ENDPOINT_URL", raising=False)
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    return new_bucket(s3_server)
