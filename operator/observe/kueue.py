"""What a round of a job queued through Kueue reads: its Workload and the node labels of
the flavors Kueue assigned it."""

from __future__ import annotations

from dataclasses import replace

from ..plan.kueue import admission, priority_class, queue_name, workload_name
from ..plan.types import Observed
from .cache import IndexCache


def with_queue(observed: Observed, cache: IndexCache) -> Observed:
    """``observed`` plus the job's Workload, its flavors' node labels and its priority
    (unchanged for a job without a queue label)."""
    job = observed.job
    if queue_name(job) is None:
        return observed
    wl = cache.workload(job["metadata"]["namespace"], workload_name(job))
    given = admission(wl)
    labels = {f: cache.flavor_labels(f) for names in given.flavors.values() for f in names}
    named = priority_class(job)
    priority = cache.workload_priority(named) if named is not None else None
    return replace(observed, workload=wl, flavor_labels=labels, workload_priority=priority)
