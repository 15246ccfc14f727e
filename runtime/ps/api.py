"""The user API of parameter-server mode: one script for every pod of the job.

::

    from ringwright.runtime import ps

    job = ps.PSJob(model, loss=loss_fn, fetch=lambda idx: data[idx], samples=len(data),
                   ids=lambda batch: {"emb.weight": batch["ids"]},
                   optimizer=ps.ServerOptimizer(ps.OptimizerKind.ADAGRAD, lr=0.05))
    ps.run(job)

The job spec's ``spec.ps`` (consistency, staleness, backupWorkers, requeueStale)
decides the consistency: the operator passes it as ``RINGWRIGHT_PS_*`` environment
variables, which replace the script's ``consistency`` and ``requeue_stale``. In a PS
pod (``RINGWRIGHT_ROLE=ps``) ``run`` serves shards and returns when the job's data is
done; in a worker pod it trains the pieces of data the job hands it. The
operator sets the role and the world; locally, a world file does (see tests/ps).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

from ringwright.world import Env

from ..exiting import freeze_objects_at_exit
from ..launch import local_rank_from_env
from ..membership.health import HealthFile
from .env import membership_source, ps_port, ps_shards, recovery_settings, spec_consistency
from .memory import retain_freed_memory
from .metrics import PSMetrics, serve_from_env
from .process import PSSettings, run_server
from .progress import PSReadiness
from .worker import PSJob, Worker, WorkerReport

PS_ROLE = "ps"

B = TypeVar("B")


def with_spec(job: PSJob[B], environ: Mapping[str, str]) -> PSJob[B]:
    """``job`` with the job spec's consistency settings when the environment has them:
    spec.ps decides, not the script."""
    spec = spec_consistency(environ)
    if spec is None:
        return job
    return dataclasses.replace(job, consistency=spec.consistency,
                               requeue_stale=spec.requeue_stale)


def run(job: PSJob[Any], environ: Mapping[str, str] | None = None) -> WorkerReport | None:
    """Serve (role ps) or train (role worker) ``job``; a worker's report, None on a PS."""
    env = os.environ if environ is None else environ
    pod = env.get(Env.POD_NAME, "")
    if not pod:
        raise ValueError(f"{Env.POD_NAME} is not set: the runtime needs its pod's name")
    job = with_spec(job, env)
    source = membership_source(env)
    # Ready from the start: the operator lists only ready pods in the world, and a PS
    # or worker waits for a world that lists it.
    health = HealthFile(Path(env[Env.HEALTH_FILE])) if env.get(Env.HEALTH_FILE) else None
    if health is not None:
        health(True, 0.0)
    retain_freed_memory()
    freeze_objects_at_exit()
    metrics = PSMetrics()
    endpoint = serve_from_env(metrics, env)
    readiness = PSReadiness.from_env(env)
    try:
        if env.get(Env.ROLE, "worker") == PS_ROLE:
            run_server(source, pod, ps_port(env), PSSettings.from_env(env), metrics=metrics,
                       progress=readiness.progress)
            return None
        return Worker(job, source, pod, ps_port(env), metrics=metrics,
                      recovery=recovery_settings(env), beat=readiness.watchdog.beat,
                      local_rank=local_rank_from_env(env), shards=ps_shards(env)).run()
    finally:
        readiness.close()
        if endpoint is not None:
            endpoint.stop()
        if health is not None:
            health(False, 0.0)
        source.close()
