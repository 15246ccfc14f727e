"""spec.ps's consistency settings travel from the manifest to the worker's job."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from ringwright.objects import Obj
from ringwright.operator.plan.manifests import PS, WORKER, pod
from ringwright.runtime.ps.api import with_spec
from ringwright.runtime.ps.serving.consistency import DEFAULT_STALENESS, Consistency, Mode
from ringwright.runtime.ps.worker import PSJob

CONTAINER = {"spec": {"containers": [{"name": "train", "image": "img"}]}}


def _job(ps: Obj) -> Obj:
    return {"apiVersion": "ringwright.dev/v1alpha1", "kind": "TrainingJob",
            "metadata": {"name": "rec", "namespace": "ns", "uid": "u"},
            "spec": {"mode": "ParameterServer",
                     "workers": {"replicas": 3, "template": CONTAINER},
                     "ps": {"replicas": 2, "template": CONTAINER, **ps}}}


def _env(body: Obj, role: str) -> dict[str, str]:
    container = pod(body, role, 0, {})["spec"]["containers"][0]
    return {e["name"]: e["value"] for e in container["env"] if "value" in e}


def _script() -> PSJob[Any]:
    # What a script declares; the spec must win over it.
    return PSJob(nn.Linear(2, 1), loss=lambda m, b: torch.zeros(()), fetch=lambda i: i,
                 samples=8, consistency=Consistency(Mode.SYNC, backup_workers=0))


@pytest.mark.parametrize(("ps", "expected", "requeue"), [
    ({"consistency": "Async", "staleness": 16, "requeueStale": True},
     Consistency(Mode.ASYNC, tau=16), True),
    ({"consistency": "Async"}, Consistency(Mode.ASYNC, tau=DEFAULT_STALENESS), False),
    ({"consistency": "Sync", "backupWorkers": 1}, Consistency(Mode.SYNC, backup_workers=1),
     False),
    ({}, Consistency(Mode.SYNC), False),
])
@pytest.mark.parametrize("role", [WORKER, PS])
def test_the_spec_decides_the_jobs_consistency(ps: Obj, expected: Consistency, requeue: bool,
                                               role: str) -> None:
    job = with_spec(_script(), _env(_job(ps), role))
    assert job.consistency == expected
    assert job.requeue_stale is requeue


def test_without_the_spec_the_script_keeps_its_settings() -> None:
    script = _script()
    script.requeue_stale = True
    assert with_spec(script, {}) is script


def test_an_allreduce_job_gets_no_ps_settings() -> None:
    body = _job({})
    body["spec"].pop("ps")
    body["spec"]["mode"] = "AllReduce"
    assert not [k for k in _env(body, WORKER) if k.startswith("RINGWRIGHT_PS_")]
