"""Hierarchical and bucketed all-reduce give the flat ring's result, on real gloo groups.

Each case starts one process per rank (``collective_worker.py``) in a world whose
members sit in uneven racks; every rank compares the runtime's paths against the
flat ring on the same inputs and reports the largest difference.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from ringwright.runtime.local.launcher import free_port
from ringwright.runtime.membership.file_source import write_world_file
from ringwright.world import (
    HierarchicalAllReduce,
    JobRef,
    Member,
    StoreAddress,
    TopologySettings,
    World,
)

WORKER = Path(__file__).with_name("collective_worker.py")

pytestmark = pytest.mark.timeout(420)


def rack_world(racks: str, mode: HierarchicalAllReduce) -> World:
    """A world with one member per letter of ``racks``, the letter naming its rack."""
    members = tuple(Member(rank=i, pod=f"w-{i}", ip=f"127.0.0.{60 + i}", rack=f"rack-{r}")
                    for i, r in enumerate(racks))
    return World(job=JobRef(namespace="t", name="topo"), generation=0, members=members,
                 store=StoreAddress(address=members[0].ip, port=free_port()),
                 topology=TopologySettings(hierarchical_all_reduce=mode))


def run_world(world: World, tmp_path: Path) -> list[dict[str, Any]]:
    world_file = tmp_path / "world.json"
    write_world_file(world_file, world)
    env_base = {"WORLD_FILE": str(world_file), "OMP_NUM_THREADS": "1",
                "TORCH_CPP_LOG_LEVEL": "ERROR"}
    procs = []
    for m in world.members:
        out = tmp_path / f"out-{m.rank}.json"
        env = {**env_base, "RANK": str(m.rank), "OUT": str(out)}
        procs.append((out, subprocess.Popen(
            [sys.executable, str(WORKER)], env={**os.environ, **env},
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)))
    results = []
    for out, proc in procs:
        log, _ = proc.communicate(timeout=360)
        assert proc.returncode == 0, log.decode()[-3000:]
        results.append(json.loads(out.read_text()))
    return results


@pytest.mark.parametrize("racks", ["aab", "aaab", "aabbb", "aaabbccc"])
def test_hierarchical_and_bucketed_equal_flat_on_uneven_racks(racks: str,
                                                              tmp_path: Path) -> None:
    # Enabled: Auto would send the larger buffers to the flat ring (AUTO_MAX_BYTES).
    results = run_world(rack_world(racks, HierarchicalAllReduce.ENABLED), tmp_path)

    assert all(r["hierarchical"] for r in results)
    for r in results:
        assert r["hierarchical_diff"] < 1e-4, r
        assert r["bucket_diff"] < 1e-5, r
        # bf16 keeps 8 bits of mantissa; error feedback keeps it from growing.
        assert r["bucket_bf16_diff"] < 5e-2, r
        assert r["none_grads"] == ["unused.weight", "unused.bias"], r


def test_auto_stays_flat_in_one_rack(tmp_path: Path) -> None:
    results = run_world(rack_world("aaa", HierarchicalAllReduce.AUTO), tmp_path)

    assert not any(r["hierarchical"] for r in results)
    assert all(r["hierarchical_diff"] == 0.0 for r in results)
