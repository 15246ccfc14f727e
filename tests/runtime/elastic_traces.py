"""Reading and auditing the traces written by ``elastic_worker.py``.

A step can be trained more than once: a failure rolls it back and a later world
trains it again. The attempt that counts is the one from the latest world generation
(within one world generation a step is trained once, because any failure ends the generation),
and it counts for every rank of that world.
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

Record = dict[str, Any]


@dataclass(frozen=True)
class Rollback:
    """World ``generation`` resumed at step ``resumed`` after step ``completed`` was done."""

    generation: int
    resumed: int
    completed: int

    @property
    def lost(self) -> int:
        """Steps trained again."""
        return self.completed - self.resumed


@dataclass(frozen=True)
class Traces:
    """Every record of every pod, in the order each pod wrote them."""

    by_pod: dict[str, list[Record]]

    @classmethod
    def load(cls, trace_dir: Path) -> Traces:
        """Read ``<pod>.jsonl`` files (a torn last line, from SIGKILL, is skipped)."""
        by_pod: dict[str, list[Record]] = {}
        for path in sorted(trace_dir.glob("*.jsonl")):
            records = []
            for line in path.read_text().splitlines():
                try:
                    records.append(json.loads(line))
                except json.JSONDecodeError:
                    continue
            by_pod[path.stem] = records
        return cls(by_pod)

    def events(self, ev: str) -> list[tuple[str, Record]]:
        """``(pod, record)`` for every record of kind ``ev``."""
        return [(pod, r) for pod, rs in self.by_pod.items() for r in rs if r["ev"] == ev]

    def max_step(self) -> int:
        """Highest step any pod has recorded."""
        return max((r["step"] for _, r in self.events("step")), default=0)

    def starts(self, generation: int) -> dict[str, Record]:
        """The ``start`` record of each pod that trained in world generation ``generation``."""
        return {pod: r for pod, r in self.events("start") if r["generation"] == generation}

    def generations(self) -> list[int]:
        """World generations in which training started."""
        return sorted({r["generation"] for _, r in self.events("start")})

    def trained(self, generation: int) -> set[str]:
        """Pods that completed at least one step in world generation ``generation``."""
        return {pod for pod, r in self.events("stepped") if r["generation"] == generation}

    def summary(self, now: float) -> str:
        """One line per process: the worlds it started (generation:size@step), its last
        record and how long ago it was written, for a failing test's message (a stalled
        process shows as an old last record; a slow one as a young one)."""
        lines = []
        for pod, records in self.by_pod.items():
            worlds = " ".join(f"{r['generation']}:{r['size']}@{r['step']}"
                              for r in records if r["ev"] == "start")
            last = records[-1] if records else {}
            what = " ".join(f"{k}={last[k]}" for k in ("ev", "generation", "step", "why")
                            if k in last)
            age = f"{now - last['t']:.0f}s ago" if "t" in last else "-"
            lines.append(f"{pod}: {len(records)} records; worlds {worlds or '-'}; "
                         f"last {what or '-'} ({age})")
        return "\n".join(lines)

    def pids(self, pod: str) -> list[int]:
        """Process ids that trained as ``pod``, in order of their first world start."""
        seen: list[int] = []
        for r in self.by_pod.get(pod, []):
            if r["ev"] == "start" and r["pid"] not in seen:
                seen.append(r["pid"])
        return seen

    def rollbacks(self) -> list[Rollback]:
        """Every resumption below a step some member had already completed.

        One definition for every launcher whose workers write these traces, needing no
        agreement on generation numbers: a start at step S, when step D > S had been
        completed before it, rolled back D - S steps; the members of one new world
        report the same (S, D) and count once."""
        stepped = sorted((r["t"], r["step"]) for _, r in self.events("stepped"))
        found: dict[tuple[int, int], Rollback] = {}
        for _, r in sorted(self.events("start"), key=lambda pr: pr[1]["t"]):
            done = max((step for t, step in stepped if t < r["t"]), default=0)
            if done > r["step"]:
                found.setdefault((r["step"], done), Rollback(r["generation"], r["step"], done))
        return list(found.values())

    def counted_steps(self) -> dict[int, list[Record]]:
        """For each step, the records of its attempt in the latest world generation."""
        attempts: dict[int, dict[int, list[Record]]] = defaultdict(lambda: defaultdict(list))
        for _, r in self.events("step"):
            attempts[r["step"]][r["generation"]].append(r)
        return {step: by_generation[max(by_generation)]
                for step, by_generation in sorted(attempts.items())}

    def commits(self, generation: int, pods: set[str]) -> list[int]:
        """Steps committed in world generation ``generation`` by any of ``pods``."""
        return [r["step"] for pod, r in self.events("commit")
                if r["generation"] == generation and pod in pods]


def assert_every_sample_once(traces: Traces, samples: int, epochs: int) -> None:
    """Counting the surviving attempt of every step, each data epoch covers each sample
    exactly once, and each counted step was trained by every rank of its world."""
    per_epoch: dict[int, Counter[int]] = defaultdict(Counter)
    for step, records in traces.counted_steps().items():
        sizes = {r["size"] for r in records}
        assert len(sizes) == 1, f"step {step}: records from worlds of sizes {sizes}"
        ranks = sorted(r["rank"] for r in records)
        assert ranks == list(range(sizes.pop())), f"step {step}: ranks {ranks} trained it"
        for r in records:
            per_epoch[r["data_epoch"]].update(r["indices"])
    assert sorted(per_epoch) == list(range(epochs)), f"data epochs {sorted(per_epoch)}"
    for data_epoch, counts in per_epoch.items():
        missing = set(range(samples)) - set(counts)
        repeated = {i: n for i, n in counts.items() if n > 1}
        assert not missing, f"data epoch {data_epoch}: samples never trained: {sorted(missing)}"
        assert not repeated, f"data epoch {data_epoch}: samples trained twice: {repeated}"


def assert_params_identical(traces: Traces) -> None:
    """Parameters are bit-identical across ranks at every world start, every commit and
    at the end."""
    for ev in ("start", "commit"):
        groups: dict[tuple[int, int], set[str]] = defaultdict(set)
        for _, r in traces.events(ev):
            groups[(r["generation"], r["step"])].add(r["hash"])
        for (generation, step), hashes in groups.items():
            assert len(hashes) == 1, f"{ev} at world {generation} step {step}: hashes {hashes}"
    done = {r["hash"] for _, r in traces.events("done")}
    assert len(done) == 1, f"final parameters differ between ranks: {done}"


def assert_resumed_from_commit(traces: Traces, before: int, after: int) -> None:
    """Training in world ``after`` starts at the last step committed in world ``before``
    by the members that carried on into ``after``."""
    _assert_started_at_last(traces, after, {before}, f"in {before}")


def assert_resumed_from_last_commit(traces: Traces, after: int) -> None:
    """Training in world ``after`` starts at the last step its members committed in any
    earlier world (worlds that came and went without a commit change nothing)."""
    _assert_started_at_last(traces, after, set(range(after)), f"before {after}")


def _assert_started_at_last(traces: Traces, after: int, generations: set[int],
                            where: str) -> None:
    starts = traces.starts(after)
    assert starts, f"nobody trained in world generation {after}"
    committed = [step for g in generations for step in traces.commits(g, set(starts))]
    assert committed, f"no commit {where} by {sorted(starts)}"
    start_steps = {r["step"] for r in starts.values()}
    assert start_steps == {max(committed)}, (
        f"world {after} started at steps {start_steps}; last commit {where} was "
        f"{max(committed)}"
    )
