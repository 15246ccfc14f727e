"""The demo's timeline: log lines of every process merged by time, and a PNG of them.

Every process (operator and training pods) logs ``<date> <time>,<ms> ...`` lines;
the runtime's are ``event key=value ...`` (see ``runtime/kvlog.py``). From the pods'
lines :func:`read_timeline` takes the loss and the pace of each data epoch
(``epoch_done``, logged by rank 0) and the first ``world_ready`` of each world generation;
:func:`draw` plots loss, samples/s and world size against wall time, with marks for
the failure, every new generation and the rejoin.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from matplotlib.figure import Figure

_STAMP = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) (.*)$")


@dataclass(frozen=True, order=True)
class LogLine:
    """One timestamped line of one process's log."""

    at: float
    """Seconds since the Unix epoch."""
    source: str
    text: str


def read_log(path: Path, source: str) -> list[LogLine]:
    """The timestamped lines of a log (tracebacks and other lines are left out)."""
    lines = []
    for raw in path.read_text(errors="replace").splitlines():
        found = _STAMP.match(raw)
        if found:
            at = datetime.strptime(found.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
            lines.append(LogLine(at, source, found.group(2)))
    return lines


def merge(logs: Iterable[list[LogLine]]) -> list[LogLine]:
    """Lines of several logs in time order."""
    return sorted(line for log in logs for line in log)


def fields(text: str, event: str) -> dict[str, str] | None:
    """The ``key=value`` fields of a runtime ``event`` line; None for other lines."""
    if f" {event} " not in f" {text} ":
        return None
    try:
        words = shlex.split(text, posix=True)
    except ValueError:  # an unbalanced quote in a free-text line
        return None
    if event not in words:
        return None
    rest = words[words.index(event) + 1:]
    return dict(w.split("=", 1) for w in rest if "=" in w)


@dataclass(frozen=True)
class Point:
    """A data epoch finished: its loss and how fast it went."""

    at: float
    loss: float
    samples_per_s: float


@dataclass(frozen=True)
class WorldMark:
    """The first member of a world generation started training in it."""

    at: float
    generation: int
    size: int


@dataclass
class Timeline:
    """What the demo plots."""

    points: list[Point] = field(default_factory=list)
    worlds: list[WorldMark] = field(default_factory=list)


def read_timeline(lines: Sequence[LogLine], samples_per_epoch: int) -> Timeline:
    """Loss, pace and worlds from merged pod log lines (see the module docstring)."""
    timeline = Timeline()
    last_done: float | None = None
    seen: set[int] = set()
    for line in lines:
        done = fields(line.text, "epoch_done")
        if done is not None and "loss" in done:
            if last_done is not None and line.at > last_done:
                rate = samples_per_epoch / (line.at - last_done)
                timeline.points.append(Point(line.at, float(done["loss"]), rate))
            last_done = line.at
        ready = fields(line.text, "world_ready")
        if ready is not None and int(ready["generation"]) not in seen:
            seen.add(int(ready["generation"]))
            timeline.worlds.append(WorldMark(line.at, int(ready["generation"]), int(ready["size"])))
    return timeline


def draw(timeline: Timeline, path: Path, *, title: str, failure_at: float,
         rejoin_generation: int) -> Path:
    """Write the timeline as a PNG at ``path`` and return it."""
    start = min([failure_at] + [p.at for p in timeline.points]
                + [w.at for w in timeline.worlds])
    fig = Figure(figsize=(11, 7.5), dpi=110, layout="constrained")
    loss_ax, rate_ax, size_ax = fig.subplots(3, 1, sharex=True,
                                             height_ratios=(3, 3, 2))
    xs = [p.at - start for p in timeline.points]
    loss_ax.plot(xs, [p.loss for p in timeline.points], "o-", ms=3, color="tab:blue")
    loss_ax.set_yscale("log")
    loss_ax.set_ylabel("loss (full data set)")
    # Each value is the mean over its data epoch, so it holds back to the previous one.
    rate_ax.step(xs, [p.samples_per_s for p in timeline.points], where="pre",
                 color="tab:orange")
    rate_ax.plot(xs, [p.samples_per_s for p in timeline.points], "o", ms=3, color="tab:orange")
    rate_ax.set_ylabel("samples / s (per data epoch)")
    rate_ax.set_ylim(bottom=0)
    if timeline.worlds:
        end = max([timeline.worlds[-1].at, *(p.at for p in timeline.points)]) - start
        size_ax.step([w.at - start for w in timeline.worlds] + [end],
                     [w.size for w in timeline.worlds] + [timeline.worlds[-1].size],
                     where="post", color="tab:green", lw=2)
        top = max(w.size for w in timeline.worlds)
        size_ax.set_ylim(0, top + 1)
        size_ax.set_yticks(range(0, top + 1))
    size_ax.set_ylabel("world size (training)")
    size_ax.set_xlabel("wall time (s)")
    for ax in (loss_ax, rate_ax, size_ax):
        ax.grid(alpha=0.3)
        ax.axvline(failure_at - start, color="tab:red", ls="--", lw=1.5)
        for w in timeline.worlds[1:]:
            rejoin = w.generation == rejoin_generation
            ax.axvline(w.at - start, color="tab:green" if rejoin else "0.4",
                       ls="--" if rejoin else ":", lw=1.5 if rejoin else 1)
    top_y = loss_ax.get_ylim()[1]
    loss_ax.annotate("pod deleted", (failure_at - start, top_y), color="tab:red",
                     rotation=90, va="top", ha="right", fontsize=8,
                     textcoords="offset points", xytext=(-2, -2))
    for w in timeline.worlds[1:]:
        rejoined = w.generation == rejoin_generation
        label = f"generation {w.generation}: {w.size} workers" + (" (rejoin)" if rejoined else "")
        loss_ax.annotate(label, (w.at - start, top_y), rotation=90, va="top", ha="left",
                         fontsize=8, color="tab:green" if rejoined else "0.3",
                         textcoords="offset points", xytext=(2, -2))
    fig.suptitle(title)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    return path
