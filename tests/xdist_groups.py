"""Which tests must share a pytest-xdist worker, and telling xdist's scheduler so.

``make test`` runs pytest-xdist with ``--dist loadgroup``: a group of tests goes to one
worker as a whole and runs there one test after the other.

* Every test that uses the ``cluster`` fixture (directly or through ``kube``,
  ``namespace``, ``operator`` ...) is in :data:`CLUSTER_GROUP`: one worker starts the
  control plane its pod host's pods run against, and the pods of two pod hosts never
  share a 127.x address.
* The real-node tests (:data:`REALNODE_DIR`) are in :data:`REALNODE_GROUP`: their worker
  starts a control plane of its own. Their pods live in network namespaces their nodes
  make, never on a 127.x address, so the two clusters run side by side; the real-node
  tests are mostly waiting (on the kubelet, containerd, grace periods), and beside the
  other cluster tests instead of after them they take that waiting off the run's longest
  lane.
* Every other test under :data:`PROCESS_DIRS` starts several torch processes; they are
  dealt in turn (in node-id order) to :data:`PROCESS_LANES` lanes, so at most that many
  of them start and train at once. On two cores, four at once starved each other past
  their deadlines before a single process had imported torch.

A test may add its own ``@pytest.mark.xdist_group(name)`` too.
"""

from __future__ import annotations

import collections
from collections.abc import Iterable

import pytest
from _pytest.nodeid import NodeId

CLUSTER_GROUP = "cluster"
"""The xdist group of every test that needs the local control plane (but the real-node
tests)."""

REALNODE_GROUP = "realnode"
"""The xdist group of the real-node tests, with a control plane of their own."""

REALNODE_DIR = "tests/realnode/"
"""Where the real-node tests live."""

PROCESS_DIRS = ("tests/runtime/", "tests/ps/")
"""Where the tests that run real training processes live."""

PROCESS_LANES = 2
"""How many real-process tests (outside the cluster group) may run at once."""


def group_names(item: pytest.Item) -> list[str]:
    """The item's xdist groups, as xdist names them (a mark's first argument or ``name``)."""
    return sorted({str(m.args[0] if m.args else m.kwargs.get("name", "default"))
                   for m in item.iter_markers("xdist_group")})


def plain_nodeid(item: pytest.Item) -> str:
    """The item's node id without the ``@group`` suffix :func:`assign_groups` adds under
    ``--dist loadgroup``: the id a targeted run of the same test has."""
    names = group_names(item)
    return item.nodeid.removesuffix("@" + "_".join(names)) if names else item.nodeid


def assign_groups(items: list[pytest.Item], loadgroup: bool) -> None:
    """Mark every cluster test with :data:`CLUSTER_GROUP` (:data:`REALNODE_GROUP` under
    :data:`REALNODE_DIR`) and every other real-process
    test with its lane; under ``--dist loadgroup`` make sure the scheduler sees each
    grouped item's groups.

    The scheduler learns an item's group only from an ``@group`` suffix on its node id.
    pytest-xdist 3.8 writes that suffix into ``Item._nodeid``, which pytest 9.2 no longer
    reads (its node ids are structured), so the groups are silently ignored
    (pytest-xdist issue 1386). Here the suffix goes onto the structured id, once.
    """
    in_processes: list[pytest.Item] = []
    for item in items:
        if "cluster" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.xdist_group(
                REALNODE_GROUP if item.nodeid.startswith(REALNODE_DIR) else CLUSTER_GROUP))
        elif item.nodeid.startswith(PROCESS_DIRS):
            in_processes.append(item)
    # Dealt in node-id order: every worker collects the same ids, so all agree.
    for i, item in enumerate(sorted(in_processes, key=lambda it: it.nodeid)):
        item.add_marker(pytest.mark.xdist_group(f"processes-{i % PROCESS_LANES}"))
    if loadgroup:
        # xdist hands out work in collection order, first one unit to every worker: the
        # groups first, so that each starts at once on a worker of its own (with at least
        # as many workers as groups) and the quick ungrouped tests fill in around them.
        items.sort(key=lambda it: not group_names(it))
    for item in items:
        names = group_names(item)
        if not loadgroup or not names:
            continue
        suffix = "@" + "_".join(names)
        if item.nodeid.endswith(suffix):
            continue
        item._id = NodeId.parse(item.nodeid + suffix)
        if not item.nodeid.endswith(suffix):
            # Fail loudly should pytest's ids change again: silently ungrouped cluster
            # tests would start one control plane per worker.
            raise RuntimeError(f"cannot tag {item.nodeid} with its xdist group {suffix}")


UNGROUPED = "ungrouped"
"""The lane name of tests in no group: xdist spreads them over every worker."""


def lane_seconds(reports: Iterable[object]) -> dict[str, float]:
    """Seconds spent per xdist group (setup, call and teardown summed), from the run's
    test reports: under ``--dist loadgroup`` a group runs on one worker, one test after
    the other, so the longest group bounds the run's wall time from below."""
    lanes: dict[str, float] = collections.defaultdict(float)
    for report in reports:
        nodeid = getattr(report, "nodeid", "")
        duration = getattr(report, "duration", None)
        if not nodeid or not isinstance(duration, float) or not getattr(report, "when", ""):
            continue
        # The group is the node id's "@name" suffix (ids of parametrized tests may
        # hold "@" inside their brackets, never after them).
        tail = nodeid.rsplit("]", 1)[-1]
        lanes[tail.rsplit("@", 1)[1] if "@" in tail else UNGROUPED] += duration
    return dict(lanes)
