"""Jobs with a Kueue topology assignment growing and shrinking through workload slices,
against the real Kueue (v0.17, built from its Go module) with its alpha gate
``ElasticJobsViaWorkloadSlicesWithTAS`` on, and the operator with kueueElasticTopology.

A module of its own (its own Kueue): under that gate Kueue admits no pod set with a
required or preferred topology request, which tests/cluster/test_kueue.py needs.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest

from ringwright.kube import KubeClient
from ringwright.operator.api.schedulingpolicy import RACK_LABEL
from ringwright.operator.plan.kueue_topology import HOSTNAME, read_assignment
from ringwright.world import World
from tests.cluster.test_placement_cluster import SLOW, pods_of, wait_quiet, wait_running
from tests.jobs import reconciled, tj_path
from tests.queueing import REQUIRED_TOPOLOGY, queued_job, scale, slices_of, wait_condition
from tests.waiting import wait_for

pytestmark = pytest.mark.cluster

UNCONSTRAINED = "kueue.x-k8s.io/podset-unconstrained-topology"


@pytest.fixture(scope="module")
def elastic_topology() -> bool:
    return True


def hosts_counted(wl: dict[str, Any]) -> Counter[str]:
    """The pods Kueue counted per host in an admitted slice's topology assignment."""
    assigned = read_assignment(wl["status"]["admission"]["podSetAssignments"][0][
        "topologyAssignment"])
    at = assigned.levels.index(HOSTNAME)
    return Counter({values[at]: count for values, count in assigned.domains})


def placed(world: World) -> Counter[str]:
    """The world's pods per host (a pod holds one member per GPU)."""
    return Counter({m.pod: m.node for m in world.members}.values())


def admitted_slice(kube: KubeClient, ns: str, name: str, number: int, count: int
                   ) -> dict[str, Any]:
    """Slice ``number`` of the job's chain once Kueue admitted it with ``count`` workers
    and finished the slice it replaced."""
    def seen() -> dict[str, Any] | None:
        chain = slices_of(kube, ns, name)
        if len(chain) <= number:
            return None
        wl, replaced = chain[number], chain[number - 1]
        assignments = ((wl.get("status") or {}).get("admission") or {}).get(
            "podSetAssignments") or ()
        finished = any(c["type"] == "Finished" and c["status"] == "True"
                       for c in (replaced.get("status") or {}).get("conditions") or ())
        return wl if finished and assignments and assignments[0]["count"] == count else None

    return wait_for(seen, f"{name}: slice {number} admitted with {count} workers",
                    timeout=SLOW)


def test_an_unconstrained_job_grows_and_shrinks_through_slices_where_kueue_counts_it(
    kube: KubeClient, namespace: str, rack_topology: str
) -> None:
    ns = namespace
    wait_quiet(kube, ns)
    kube.create(tj_path(ns), queued_job("tas", 2, 4, rack_topology,
                                        worker_annotations={UNCONSTRAINED: "true"}))
    world, _ = wait_running(kube, ns, "tas", 2)
    (first,) = slices_of(kube, ns, "tas")
    assert first["spec"]["podSets"][0]["topologyRequest"] == {"unconstrained": True}
    before = hosts_counted(first)
    assert placed(world) == before, (world.members, before)
    stayed = {m.pod: m.node for m in world.members}

    # 5 workers of 4 GPUs (quota 64): a new slice, which keeps the two running pods'
    # hosts and adds hosts for three more.
    scale(kube, ns, "tas", 5)
    grown = admitted_slice(kube, ns, "tas", 1, 5)
    after = hosts_counted(grown)
    assert all(after[host] >= n for host, n in before.items()), (before, after)
    world, _ = wait_running(kube, ns, "tas", 5)
    assert placed(world) == after, (world.members, after)
    assert {m.pod: m.node for m in world.members if m.pod in stayed} == stayed

    # Down to 3: a smaller slice; Kueue keeps the first hosts of the list, and the pods
    # on the others are the ones that leave.
    scale(kube, ns, "tas", 3)
    shrunk = admitted_slice(kube, ns, "tas", 2, 3)
    kept = hosts_counted(shrunk)
    assert sum(kept.values()) == 3 and all(after[h] >= n for h, n in kept.items()), kept
    world, _ = wait_running(kube, ns, "tas", 3)
    assert placed(world) == kept, (world.members, kept)


def test_under_the_gate_kueue_drops_a_required_request_and_the_job_says_so(
    kube: KubeClient, namespace: str, rack_topology: str
) -> None:
    ns = namespace
    wait_quiet(kube, ns)
    kube.create(tj_path(ns), queued_job("racked", 2, 4, rack_topology,
                                        worker_annotations={REQUIRED_TOPOLOGY: RACK_LABEL}))
    # Kueue admits it on quota alone: no topology assignment.
    dropped = wait_condition(kube, ns, "racked", "TopologyAssigned", "False")
    assert dropped["reason"] == "KueueDroppedRequest", dropped
    assert f"workers (required: {RACK_LABEL})" in dropped["message"], dropped
    wait_running(kube, ns, "racked", 2)
    (only,) = slices_of(kube, ns, "racked")
    assert "topologyAssignment" not in only["status"]["admission"]["podSetAssignments"][0]

    # It keeps its admitted size: a new slice would be admitted without topology too.
    scale(kube, ns, "racked", 3)
    fixed = wait_condition(kube, ns, "racked", "Resizable", "False")
    assert "asked for 3 workers but Kueue admitted 2" in fixed["message"], fixed
    reconciled(kube, ns, "racked", timeout=SLOW)
    assert len(pods_of(kube, ns, "racked")) == 2
    assert len(slices_of(kube, ns, "racked")) == 1
