"""A stored pod is read once per version: rounds that see it unchanged reuse its view,
and a new version (the same pod changed) is read again."""

from __future__ import annotations

import copy

from ringwright.objects import Obj
from ringwright.operator.plan.manifests import INDEX_LABEL, ROLE_LABEL
from ringwright.operator.plan.pods import PodState, view


def stored_pod(version: str, phase: str) -> Obj:
    return {"metadata": {"name": "j-worker-0", "uid": "u-1", "resourceVersion": version,
                         "labels": {ROLE_LABEL: "worker", INDEX_LABEL: "0"}},
            "spec": {"containers": [{"name": "main"}]},
            "status": {"phase": phase, "podIP": "10.0.0.1",
                       "conditions": [{"type": "Ready", "status": "True"}]}}


def test_an_unchanged_stored_pod_is_read_once_and_a_new_version_again() -> None:
    first = view(stored_pod("10", "Pending"))
    # The next round's copy of the same version: the same view, not read again.
    assert view(copy.deepcopy(stored_pod("10", "Pending"))) is first
    assert first is not None and first.state == PodState.PENDING
    later = view(stored_pod("11", "Running"))
    assert later is not None and later.state == PodState.READY


def test_a_pod_without_a_version_is_read_every_time() -> None:
    manifest = stored_pod("", "Pending")
    assert view(manifest) is not view(manifest)
    manifest["status"]["phase"] = "Running"
    seen = view(manifest)
    assert seen is not None and seen.state == PodState.READY
