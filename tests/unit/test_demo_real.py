"""The pure parts of ``make demo-real`` (``devcluster/demo_real.py``): pod logs read
through the API and timed by the kubelet's stamps, the recovery figure read from them,
the real nodes' taint put on and off, the example's overlay (and the kustomization that
a user writes for it, rendered by ``kubectl kustomize``), and which objects the chart
may not adopt."""

from __future__ import annotations

import shutil
import subprocess
from datetime import UTC, datetime
from pathlib import Path

import pytest
import yaml

from ringwright.devcluster.demo import first_ready, recovery, stand_still
from ringwright.devcluster.demo_real import RELEASE, helm_owned
from ringwright.devcluster.example import (
    EXAMPLE,
    example,
    kustomization,
    training_container,
    with_epochs,
)
from ringwright.devcluster.podlogs import parse_api_log
from ringwright.devcluster.realnode_only import REAL_NODE_TAINT, taints
from ringwright.devcluster.timeline import LogLine
from tests.conftest import IN_CI

T0 = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC).timestamp()


def kubelet_stamp(seconds: float) -> str:
    """The kubelet's UTC stamp of ``?timestamps=true`` (nanoseconds)."""
    at = datetime.fromtimestamp(T0 + seconds, UTC)
    return f"{at.strftime('%Y-%m-%dT%H:%M:%S')}.{at.microsecond:06d}123Z"


def kubelet_line(seconds: float, text: str) -> str:
    """A line as ``GET pods/<pod>/log?timestamps=true`` returns it: the kubelet's stamp,
    then the process's own, in the container's time zone (an hour off UTC here)."""
    return f"{kubelet_stamp(seconds)} 2026-01-02 04:04:05,000 {text}"


def test_api_logs_are_timed_by_the_kubelets_stamp_whatever_the_containers_time_zone() -> None:
    text = "\n".join([
        kubelet_line(0.25, "ringwright.runtime world_ready generation=1 size=4"),
        f"{kubelet_stamp(1.5)} Traceback (most recent call last):",
        "no stamp at all",
        kubelet_line(2.0, "ringwright.example epoch_done epoch=0 step=32"),
    ])
    lines = parse_api_log(text, "resnet-worker-0")
    assert lines == [
        LogLine(T0 + 0.25, "resnet-worker-0", "ringwright.runtime world_ready generation=1 size=4"),
        LogLine(T0 + 2.0, "resnet-worker-0", "ringwright.example epoch_done epoch=0 step=32"),
    ]


def ready(at: float, generation: int, size: int, pod: str = "w") -> LogLine:
    return LogLine(T0 + at, pod, f"ringwright.runtime world_ready generation={generation} "
                                 f"size={size} rank=0")


def test_the_recovery_runs_from_the_delete_to_each_worlds_first_ready_member() -> None:
    lines = sorted([
        ready(0.0, 1, 4), ready(0.1, 1, 4, "x"),
        ready(13.0, 2, 3, "x"), ready(12.5, 2, 3),     # the first member of 3 counts
        ready(40.0, 3, 4, "new"), ready(39.0, 3, 4),
    ])
    got = recovery(lines, failure_at=T0 + 10.0, smaller=2, whole=3)
    assert got.smaller is not None and got.whole is not None
    assert round(got.smaller, 3) == 2.5 and round(got.whole, 3) == 29.0
    assert got.show("measured on real nodes") == (
        "recovery (measured on real nodes): pod deleted -> training at the smaller size "
        "2.5 s, -> back at full size 29.0 s")


def test_a_world_never_seen_after_the_delete_is_said_so_not_guessed() -> None:
    # The world of 3 was skipped (4 -> 4): no figure for it, and the earlier world's
    # lines before the delete count for nothing.
    lines = [ready(0.0, 1, 4), ready(30.0, 3, 4)]
    got = recovery(lines, failure_at=T0 + 10.0, smaller=2, whole=3)
    assert got.smaller is None and got.whole == pytest.approx(20.0)
    assert "smaller size not seen" in got.show("here")
    assert first_ready(lines, 2) == T0 + 30.0  # a later generation also means "trained"
    assert first_ready(lines, 4) is None


def test_members_stand_still_from_agreeing_on_the_new_world_to_training_in_it() -> None:
    def agreed(at: float, pod: str, nxt: int) -> LogLine:
        return LogLine(T0 + at, pod, f"ringwright.runtime world_change_agreed generation=2 "
                                     f"next_generation={nxt}")

    lines = sorted([
        agreed(20.0, "a", 3), agreed(20.1, "b", 3), agreed(25.0, "b", 4),
        ready(20.4, 3, 4, "a"), ready(20.6, 3, 4, "b"),
        ready(20.5, 3, 4, "new"),  # the newcomer trained in no world before: not counted
        ready(25.5, 4, 4, "b"),
    ])
    got = stand_still(lines, 3)
    assert got.keys() == {"a", "b"}
    assert got["a"] == pytest.approx(0.4) and got["b"] == pytest.approx(0.5)


def test_the_real_node_taint_comes_off_and_goes_back_alone() -> None:
    other = {"key": "example.com/dedicated", "value": "gpu", "effect": "NoSchedule"}
    assert taints([other, REAL_NODE_TAINT], real=False) == [other]
    assert taints([other], real=True) == [other, REAL_NODE_TAINT]
    assert taints([REAL_NODE_TAINT], real=True) == [REAL_NODE_TAINT]


def test_the_overlay_sets_only_the_epochs_of_the_example_as_written() -> None:
    written = example()
    patched = with_epochs(example(), 7)
    assert "args" not in training_container(written)
    assert training_container(patched)["args"] == ["--epochs", "7"]
    training_container(patched).pop("args")
    assert patched == written


def test_the_documented_kustomization_renders_the_demos_overlay(tmp_path: Path) -> None:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        message = "no kubectl on PATH (the README's requirements list it)"
        if IN_CI:
            pytest.fail(message)
        pytest.skip(message)
    shutil.copy(EXAMPLE, tmp_path / EXAMPLE.name)
    (tmp_path / "kustomization.yaml").write_text(kustomization(100_000))
    out = subprocess.run([kubectl, "kustomize", str(tmp_path)], capture_output=True,
                         text=True, check=False, timeout=60)
    assert out.returncode == 0, out.stderr
    assert yaml.safe_load(out.stdout) == with_epochs(example(), 100_000)


@pytest.mark.parametrize(("labels", "annotations", "owned"), [
    ({"app.kubernetes.io/managed-by": "Helm"}, {"meta.helm.sh/release-name": RELEASE}, True),
    ({"app.kubernetes.io/managed-by": "Helm"}, {"meta.helm.sh/release-name": "other"}, False),
    ({}, {}, False),   # applied by make demo without helm
])
def test_only_objects_of_the_demos_release_are_left_for_helm(
    labels: dict[str, str], annotations: dict[str, str], owned: bool,
) -> None:
    obj = {"metadata": {"name": "default", "labels": labels, "annotations": annotations}}
    assert helm_owned(obj, RELEASE) is owned
