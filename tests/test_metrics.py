"""Tests of hetpipe.core.runs.metrics: JSONL parses, merged traces hold the expected events, text equals
literals."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from hetpipe.core.errors import UsageError
from hetpipe.core.runs.metrics import (
    MetricsWriter,
    TraceRecorder,
    VwProgress,
    format_progress,
    merge_traces,
    read_jsonl,
    stage_breakdown_ms,
    stage_totals,
    wave_breakdown_ms,
    write_summary,
)


class FakeClock:
    """Monotonic seconds that tests move by hand; `wall` is the same clock shifted to a Unix time."""

    def __init__(self, unix_start: float = 1_700_000_000.0) -> None:
        self.now = 0.0
        self.unix_start = unix_start

    def clock(self) -> float:
        return self.now

    def wall(self) -> float:
        return self.unix_start + self.now


# ---------------------------------------------------------------------------------------------- JSONL


def test_metrics_lines_parse_and_are_flushed(tmp_path: Path) -> None:
    fake = FakeClock()
    path = tmp_path / "run" / "metrics.jsonl"
    with MetricsWriter(path, clock=fake.wall) as writer:
        writer.write("start", vws=2)
        fake.now = 1.5
        writer.write("wave", vw=0, wave=3, loss=np.float32(0.25), out=tmp_path / "x")
        assert len(read_jsonl(path)) == 2  # readable before close
    assert read_jsonl(path) == [
        {"t": 1_700_000_000.0, "event": "start", "vws": 2},
        {"t": 1_700_000_001.5, "event": "wave", "vw": 0, "wave": 3, "loss": 0.25, "out": str(tmp_path / "x")},
    ]
    with MetricsWriter(path, clock=fake.wall) as writer:  # appends
        writer.write("end")
    lines = path.read_text().splitlines()
    assert len(lines) == 3
    assert json.loads(lines[2]) == {"t": 1_700_000_001.5, "event": "end"}
    with pytest.raises(ValueError, match="closed"):
        writer.write("late")


def test_metrics_t_is_the_events_own_time(tmp_path: Path) -> None:
    """An event that happened earlier (a stage's, queued) keeps its own time, not the time it was written."""
    fake = FakeClock()
    path = tmp_path / "metrics.jsonl"
    with MetricsWriter(path, clock=fake.wall) as writer:
        fake.now = 10.0
        writer.write("minibatch", at=1_700_000_002.25, vw=1, p=4)
        writer.write("push", vw=1)
    assert [(r["event"], r["t"]) for r in read_jsonl(path)] == [
        ("minibatch", 1_700_000_002.25),
        ("push", 1_700_000_010.0),
    ]


# ---------------------------------------------------------------------------------------------- traces


def record(
    fake: FakeClock, recorder: TraceRecorder, name: str, start: float, seconds: float, **args: object
) -> None:
    fake.now = start
    with recorder.span(name, **args):
        fake.now += seconds


def test_merge_two_vws(tmp_path: Path) -> None:
    fake = FakeClock()
    a = TraceRecorder("vw10", 0, "stage 0 (n1:0)", wall=fake.wall, clock=fake.clock)
    b = TraceRecorder("vw2", 1, wall=fake.wall, clock=fake.clock)
    record(fake, a, "F0", 0.5, 0.25, minibatch=0)
    record(fake, b, "WAIT2", 0.25, 0.125)
    record(fake, b, "PUSH1", 1.0, 0.0)
    a.dump(tmp_path / "a.json")
    b.dump(tmp_path / "b.json")

    single = json.loads((tmp_path / "a.json").read_text())["traceEvents"]
    assert [e["ph"] for e in single] == ["M", "M", "X"]

    merge_traces([tmp_path / "a.json", tmp_path / "b.json"], tmp_path / "out" / "trace.json")
    doc = json.loads((tmp_path / "out" / "trace.json").read_text())
    assert doc["otherData"] == {"origin_unix_us": 1_700_000_000_250_000.0}
    meta = [(e["name"], e["pid"], e["tid"], e["args"]) for e in doc["traceEvents"] if e["ph"] == "M"]
    assert meta == [  # vw2 before vw10
        ("process_name", 1, 0, {"name": "vw2"}),
        ("process_sort_index", 1, 0, {"sort_index": 1}),
        ("process_name", 2, 0, {"name": "vw10"}),
        ("process_sort_index", 2, 0, {"sort_index": 2}),
        ("thread_name", 1, 1, {"name": "stage 1"}),
        ("thread_sort_index", 1, 1, {"sort_index": 1}),
        ("thread_name", 2, 0, {"name": "stage 0 (n1:0)"}),
        ("thread_sort_index", 2, 0, {"sort_index": 0}),
    ]
    spans = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    assert spans == [
        {"name": "WAIT2", "cat": "wait", "ph": "X", "ts": 0.0, "dur": 125_000.0, "pid": 1, "tid": 1},
        {
            "name": "F0",
            "cat": "f",
            "ph": "X",
            "ts": 250_000.0,
            "dur": 250_000.0,
            "pid": 2,
            "tid": 0,
            "args": {"minibatch": 0},
        },
        {"name": "PUSH1", "cat": "push", "ph": "X", "ts": 750_000.0, "dur": 0.0, "pid": 1, "tid": 1},
    ]


def test_span_records_a_block_that_raises() -> None:
    recorder = TraceRecorder("vw0", 0)
    with pytest.raises(RuntimeError), recorder.span("B3"):
        raise RuntimeError("boom")
    assert [e["name"] for e in recorder.events] == ["B3"]


def test_a_long_trace_keeps_its_first_and_newest_events_and_says_what_it_left_out(tmp_path) -> None:
    recorder = TraceRecorder("vw0", 0, max_events=6)
    for i in range(20):
        recorder.add(f"F{i}", ts_us=float(i), dur_us=1.0)
    assert [e["name"] for e in recorder.events] == ["F0", "F1", "F2", "F17", "F18", "F19"]
    recorder.dump(tmp_path / "t.json")
    events = json.loads((tmp_path / "t.json").read_text())["traceEvents"]
    gap = [e for e in events if e["ph"] == "i"]
    assert len(gap) == 1 and gap[0]["name"].startswith("14 events left out") and gap[0]["ts"] == 17.0
    with pytest.raises(UsageError, match="at least 2 events"):
        TraceRecorder("vw0", 0, max_events=1)


def test_stage_totals_come_back_from_the_traces_and_break_down_per_vw_by_its_slowest_stage(tmp_path) -> None:
    """What a stage writes into its trace (hetpipe worker runs leave nothing else) is what wave_breakdown_ms
    reads: per VW the most any stage spent in each part, in ms per wave; traces without totals are skipped."""
    totals = {
        (0, 0): {"compute": 2.0, "recv": 0.5, "train": 4.0},
        (0, 1): {"compute": 1.0, "recv": 3.0, "train": 4.1},
        (1, 0): {"compute": 3.0, "gate_wait": 0.25, "train": 4.0},
    }
    for (vw, stage), times in totals.items():
        TraceRecorder(f"vw{vw}", stage).dump(
            tmp_path / f"vw{vw}-s{stage}.json", other={"times_s": times, "waves": 10}
        )
    TraceRecorder("vw2", 0).dump(tmp_path / "vw2-s0.json")  # an older trace: no totals
    (tmp_path / "merged.json").write_text('{"traceEvents": []}')
    found = stage_totals(tmp_path)
    assert sorted(found) == [(0, 0), (0, 1), (1, 0)] and found[(0, 1)] == {
        "times_s": totals[(0, 1)],
        "waves": 10,
    }
    assert stage_breakdown_ms({k: v["times_s"] for k, v in found.items()}, 10)[(0, 1)] == {
        "compute": 100.0,
        "recv": 300.0,
        "train": 410.0,
    }
    assert wave_breakdown_ms({k: v["times_s"] for k, v in found.items()}, 10) == {
        "0": {"compute": 200.0, "recv": 300.0, "train": 410.0},
        "1": {"compute": 300.0, "gate_wait": 25.0, "train": 400.0},
    }


# ---------------------------------------------------------------------------------------------- progress


def test_progress_two_equal_vws() -> None:
    rows = [
        VwProgress(vw=0, gpus="fast,slow", wave=7, loss=0.412, samples_per_s=312.4, lead=1, gate_wait_s=3.21),
        VwProgress(vw=1, gpus="fast,slow", wave=6, loss=0.4567, samples_per_s=298.0, lead=0, gate_wait_s=0.0),
    ]
    assert format_progress(rows, 20, 40, elapsed_s=41.0) == (
        "vw0 [fast,slow] wave 7/20  loss 0.412  312 samples/s  lead +1  gate wait 3.2 s\n"
        "vw1 [fast,slow] wave 6/20  loss 0.457  298 samples/s  lead +0  gate wait 0.0 s\n"
        "[###.......] 32%  elapsed 41 s  eta 1 min 25 s"  # the bar never drops below 10 cells
    )


def test_progress_aligns_columns() -> None:
    rows = [
        VwProgress(
            vw=2, gpus="titan-v,rtx-2060", wave=3, loss=None, samples_per_s=95.0, lead=0, gate_wait_s=12.54
        ),
        VwProgress(vw=10, gpus="p4000", wave=12, loss=1.5, samples_per_s=1234.0, lead=9, gate_wait_s=0.0),
    ]
    assert format_progress(rows, 20, 60, elapsed_s=200.0) == (
        "vw2 [titan-v,rtx-2060] wave  3/20  loss     -    95 samples/s  lead +0  gate wait 12.5 s\n"
        "vw10 [p4000]           wave 12/20  loss 1.500  1234 samples/s  lead +9  gate wait  0.0 s\n"
        "[######............] 37%  elapsed 3 min 20 s  eta 5 min 33 s"
    )


def test_progress_start_and_end() -> None:
    start = [VwProgress(vw=0, gpus="fast", wave=0, loss=None, samples_per_s=0.0, lead=0, gate_wait_s=0.0)]
    assert (
        format_progress(start, 5, elapsed_s=0.0).splitlines()[1]
        == "[" + "." * 74 + "]  0%  elapsed 0 s  eta -"
    )
    end = [VwProgress(vw=0, gpus="fast", wave=5, loss=0.1, samples_per_s=10.0, lead=0, gate_wait_s=0.0)]
    assert format_progress(end, 5, 30, elapsed_s=7300.0).splitlines()[1] == (
        "[##########] 100%  elapsed 2 h 01 min  eta 0 s"  # the bar never drops below 10 cells
    )


# ---------------------------------------------------------------------------------------------- summary

SUMMARY = {
    "waves": 20,
    "loss": 0.41234567,
    "vws": {"vw0": {"samples_per_s": 312.5}},
    "pull": "exact",
    "emulated": True,
    "gpus": ["n0:0", "n0:1"],
    "accuracy": None,
}


def test_write_summary(tmp_path: Path) -> None:
    path = tmp_path / "run" / "summary.json"
    write_summary(path, SUMMARY)
    text = path.read_text()
    assert json.loads(text) == SUMMARY
    assert list(json.loads(text)) == ["accuracy", "emulated", "gpus", "loss", "pull", "vws", "waves"]
    assert text.endswith("}\n")
