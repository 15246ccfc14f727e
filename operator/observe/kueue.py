"""What a round of a job queued through Kueue reads: its Workload and the node labels of
the flavors Kueue assigned it."""

from __future__ import annotations

from dataclasses import replace

from ringwright.objects import Obj

from ..plan.kueue import admission, priority_class, queue_name, slice_number, workload_name
from ..plan.types import Observed
from .cache import IndexCache


def with_queue(observed: Observed, cache: IndexCache) -> Observed:
    """``observed`` plus the job's Workload (the oldest slice of its chain not finished,
    and a newer one waiting), its flavors' node labels and its priority (unchanged for a
    job without a queue label)."""
    job = observed.job
    if queue_name(job) is None:
        return observed
    meta = job["metadata"]
    chain = slices_of(cache.workloads(meta["namespace"], meta["name"]), workload_name(job))
    going = [wl for wl in chain if not admission(wl).finished]
    wl = going[0] if going else (chain[-1] if chain else None)
    given = admission(wl)
    labels = {f: cache.flavor_labels(f) for names in given.flavors.values() for f in names}
    named = priority_class(job)
    priority = cache.workload_priority(named) if named is not None else None
    return replace(observed, workload=wl, waiting_slice=going[-1] if len(going) > 1 else None,
                   next_slice=slice_number(chain[-1]) + 1 if chain else 1,
                   flavor_labels=labels, workload_priority=priority)


def slices_of(workloads: list[Obj], first: str) -> list[Obj]:
    """The slices of the chain whose first Workload is ``first`` (a job recreated under
    the same name has another), in order."""
    mine = [wl for wl in workloads if wl["metadata"]["name"] == first
            or wl["metadata"]["name"].startswith(f"{first}-")]
    return sorted(mine, key=slice_number)
