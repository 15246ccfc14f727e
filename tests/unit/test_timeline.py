"""The demo's timeline: log lines merged by time, read into points and worlds, drawn;
and the demo's wait for the job status it prints."""

from __future__ import annotations

from datetime import datetime
from pathlib import Path

import pytest

from ringwright.devcluster.demo import world_summary
from ringwright.devcluster.timeline import (
    LogLine,
    Timeline,
    draw,
    fields,
    merge,
    read_log,
    read_timeline,
)
from ringwright.objects import Obj

T0 = datetime(2026, 1, 2, 3, 4, 5).timestamp()


def stamp(seconds: float) -> str:
    at = datetime.fromtimestamp(T0 + seconds)
    return at.strftime("%Y-%m-%d %H:%M:%S,") + f"{at.microsecond // 1000:03d}"


def write(path: Path, *lines: tuple[float, str]) -> Path:
    path.write_text("".join(f"{stamp(t)} {text}\n" for t, text in lines) + "Traceback:\n")
    return path


def test_logs_of_several_processes_merge_by_time(tmp_path: Path) -> None:
    a = write(tmp_path / "a.log", (0.0, "first"), (2.5, "third"))
    b = write(tmp_path / "b.log", (1.25, "second"))
    merged = merge([read_log(a, "a"), read_log(b, "b")])
    assert [(line.source, line.text) for line in merged] == [
        ("a", "first"), ("b", "second"), ("a", "third")]
    assert merged[1].at - merged[0].at == pytest.approx(1.25)


def test_fields_of_runtime_events_with_quoted_values() -> None:
    text = 'ringwright.runtime.elastic rolled_back generation=2 step=40 error="peer gone: reset"'
    assert fields(text, "rolled_back") == {"generation": "2", "step": "40",
                                           "error": "peer gone: reset"}
    assert fields(text, "world_ready") is None
    assert fields('world_ready broken "quote', "world_ready") is None


def test_timeline_has_loss_pace_and_the_first_start_of_each_world() -> None:
    def line(t: float, text: str) -> LogLine:
        return LogLine(T0 + t, "pod", text)

    lines = [
        line(0.0, "x world_ready generation=1 size=4 rank=0"),
        line(0.1, "x world_ready generation=1 size=4 rank=1"),
        line(1.0, "x epoch_done epoch=0 step=16 loss=2.0"),
        line(2.0, "x epoch_done epoch=1 step=32 loss=1.0"),
        line(3.0, "x world_ready generation=2 size=3 rank=0"),
        line(6.0, "x epoch_done epoch=2 step=48 loss=0.5"),
    ]
    timeline = read_timeline(lines, samples_per_epoch=2048)
    assert [(p.loss, p.samples_per_s) for p in timeline.points] == [(1.0, 2048.0),
                                                                    (0.5, 512.0)]
    assert [(w.generation, w.size) for w in timeline.worlds] == [(1, 4), (2, 3)]


def test_draw_writes_a_png(tmp_path: Path) -> None:
    lines = [LogLine(T0 + t, "p", text) for t, text in [
        (0, "world_ready generation=1 size=4"), (1, "epoch_done loss=2"), (2, "epoch_done loss=1"),
        (3, "world_ready generation=2 size=3"), (5, "epoch_done loss=0.7"),
        (6, "world_ready generation=3 size=4"), (7, "epoch_done loss=0.5")]]
    path = draw(read_timeline(lines, 100), tmp_path / "t.png", title="t",
                failure_at=T0 + 2.5, rejoin_generation=3)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    empty = draw(Timeline(), tmp_path / "empty.png", title="t", failure_at=T0,
                 rejoin_generation=2)
    assert empty.stat().st_size > 0


@pytest.mark.parametrize(("status", "ready"), [
    (None, False),
    ({"phase": "Running"}, False),
    ({"world": {"gpuModel": "H100"}}, False),  # placement wrote the GPU model only
    ({"world": {"generation": 1, "size": 4, "crossRackEdges": 0}}, False),  # an older generation
    ({"world": {"generation": 2, "size": 3, "crossRackEdges": 0}}, True),
])
def test_the_demo_reads_the_world_summary_only_once_written(status: Obj | None,
                                                            ready: bool) -> None:
    job = None if status is None else {"status": status}
    assert (world_summary(job, generation=2) is not None) == ready
