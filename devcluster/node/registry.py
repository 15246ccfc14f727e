"""The machine-wide record of live sets of real nodes, and removing a set from it,
also after a crash.

A set of real nodes holds a slot (:mod:`.layout`); its record, a JSON file in
:data:`REGISTRY`, is written before anything is created and lists the set's nodes and
every process started for them, with the process that owns the set. The record alone
is enough to remove the set: :func:`teardown` kills the kubelets, every process in
the nodes' cgroups, containerd's shims, containerd, the API relays and the holder of
each node's mount namespace (whose mounts go with it), then deletes the network
namespaces (their links and routes go with them), the cgroups, the nodes' folders and
the set's backbone namespace, and last the record. A
set whose owner is gone is torn down by the next :meth:`Registry.sweep` on the machine
(every start runs one), whichever cluster it belonged to.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ringwright.procstat import start_ticks

from .host import (
    HostError,
    Proc,
    cgroups_named,
    host_links,
    kill_pids,
    mounts_under,
    network_namespaces,
    pids_mentioning,
    remove_cgroup,
    remove_network,
    stop,
)
from .layout import LINK_PREFIX, NAME_PREFIX, SLOTS, NodeLayout, backbone_netns

REGISTRY = Path("/run/ringwright-realnodes")
"""One record per live set of real nodes on this machine (a tmpfs: a reboot, which
also ends every process, namespace and cgroup, empties it)."""


@dataclass
class SetRecord:
    """A live set of real nodes: its slot, nodes, processes and owner."""

    slot: int
    cluster_dir: str
    owner: tuple[int, int]
    """(pid, start time) of the process that started the set."""
    nodes: list[dict[str, Any]] = field(default_factory=list)
    processes: list[Proc] = field(default_factory=list)

    def layouts(self) -> list[NodeLayout]:
        return [NodeLayout.from_record(n) for n in self.nodes]

    def owner_alive(self) -> bool:
        return start_ticks(self.owner[0]) == self.owner[1]

    def to_json(self) -> str:
        return json.dumps({"slot": self.slot, "cluster_dir": self.cluster_dir,
                           "owner": list(self.owner), "nodes": self.nodes,
                           "processes": [p.__dict__ for p in self.processes]})

    @classmethod
    def from_json(cls, text: str) -> SetRecord:
        doc = json.loads(text)
        return cls(slot=int(doc["slot"]), cluster_dir=doc["cluster_dir"],
                   owner=(int(doc["owner"][0]), int(doc["owner"][1])), nodes=doc["nodes"],
                   processes=[Proc(**p) for p in doc["processes"]])


class Registry:
    """The records of live sets in ``folder``, changed under one machine-wide lock."""

    def __init__(self, folder: Path = REGISTRY) -> None:
        self.folder = folder

    def path(self, slot: int) -> Path:
        return self.folder / f"slot-{slot}.json"

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """Hold the registry's lock (one holder on the machine at a time)."""
        self.folder.mkdir(parents=True, exist_ok=True)
        with open(self.folder / ".lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def records(self) -> list[SetRecord]:
        found = []
        for path in sorted(self.folder.glob("slot-*.json")):
            with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
                found.append(SetRecord.from_json(path.read_text()))
        return found

    def save(self, record: SetRecord) -> None:
        tmp = self.path(record.slot).with_suffix(".tmp")
        tmp.write_text(record.to_json())
        tmp.replace(self.path(record.slot))

    def claim(self, cluster_dir: Path) -> SetRecord:
        """Tear down sets whose owner is gone and what no record accounts for, then
        take a free slot for a new set owned by this process. Call it locked."""
        self.sweep()
        used = {r.slot for r in self.records()}
        free = next((s for s in range(SLOTS) if s not in used), None)
        if free is None:
            raise HostError(f"all {SLOTS} slots for sets of real nodes are taken on this "
                            f"machine; see {self.folder}")
        me = os.getpid()
        record = SetRecord(slot=free, cluster_dir=str(cluster_dir),
                           owner=(me, start_ticks(me) or 0))
        self.save(record)
        return record

    def sweep(self) -> list[int]:
        """Tear down every set whose owner is gone, and what no record accounts for;
        the slots freed. Call it locked."""
        stale = [r for r in self.records() if not r.owner_alive()]
        for record in stale:
            self.teardown(record)
        remove_unrecorded({r.slot for r in self.records()})
        return [r.slot for r in stale]

    def teardown(self, record: SetRecord) -> None:
        """Remove everything ``record``'s set made; idempotent. Call it locked."""
        teardown(record)
        self.path(record.slot).unlink(missing_ok=True)


def teardown(record: SetRecord) -> None:
    """Stop every process of the set and remove its namespaces, links, cgroups and
    folders (see the module's docstring for the order and why)."""
    layouts = record.layouts()
    procs = record.processes
    stop([p for p in procs if p.role == "kubelet"])
    for layout in layouts:
        remove_cgroup(layout.cgroup)
    for layout in layouts:
        kill_pids(pids_mentioning(str(layout.containerd_socket)))
    stop([p for p in procs if p.role != "kubelet"])
    for layout in layouts:
        remove_network(layout.netns, layout.host_link)
        remove_cgroup(layout.cgroup)
        for point in sorted(mounts_under(layout.dir), reverse=True):
            subprocess.run(["umount", "--lazy", point], capture_output=True, check=False)
        shutil.rmtree(layout.dir, ignore_errors=True)
        with contextlib.suppress(OSError):
            layout.dir.parent.rmdir()
    remove_network(backbone_netns(record.slot), "")


def _slot_of(name: str, prefix: str) -> int | None:
    rest = name[len(prefix):].lstrip("s")
    digits = ""
    for ch in rest:
        if not ch.isdigit():
            break
        digits += ch
    return int(digits) if digits else None


def remove_unrecorded(used: set[int]) -> None:
    """Remove real-node namespaces, links and cgroups of slots no record holds (what a
    crash in the middle of a teardown would leave)."""
    for ns in network_namespaces():
        if _slot_of(ns, NAME_PREFIX) not in used:
            remove_network(ns, "")
    for link in host_links():
        if _slot_of(link, LINK_PREFIX) not in used:
            remove_network("", link)
    for name in cgroups_named(NAME_PREFIX):
        if _slot_of(name, NAME_PREFIX) not in used:
            remove_cgroup(name)
