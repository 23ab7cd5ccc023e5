"""Run outputs: JSONL metrics, Chrome traces (a row per stage, grouped by VW), progress and summary text."""

from __future__ import annotations

import json
import math
import re
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, TextIO

from hetpipe.core.errors import UsageError, WriteError

__all__ = [
    "STAGE_PARTS",
    "MetricsWriter",
    "TraceRecorder",
    "VwProgress",
    "format_progress",
    "merge_traces",
    "read_jsonl",
    "stage_breakdown_ms",
    "stage_totals",
    "wave_breakdown_ms",
    "write_summary",
]

# What a stage's own thread times, by part (worker/stage.py; docs/architecture.md#where-a-waves-time-goes);
# its PS thread adds push, pull and parked, and `train` is its whole training loop
STAGE_PARTS = ("compute", "recv", "send", "d2h", "push_wait", "gate_wait", "h2d")
MAX_TRACE_EVENTS = 50_000  # per stage (about 30 MB of Python objects): a long run keeps its first and newest


def _jsonable(value: Any) -> Any:
    """json.dumps fallback: numpy scalars and arrays via .item()/.tolist(), anything else as str (paths)."""
    for method in ("item", "tolist"):
        if hasattr(value, method):
            try:
                return getattr(value, method)()
            except (TypeError, ValueError):
                pass
    return str(value)


# ---------------------------------------------------------------------------------------------- JSONL


class MetricsWriter:
    """Appends one JSON object per line, `{"t": when it happened, "event": ..., **fields}`, flushed at once.

    `t` is the event's own time on the Unix clock (seconds, as time.time() gives it in the process that saw
    it: a stage's for stage events), not when the line was written; `write(..., at=None)` stamps it now.
    Lines survive a crash of the process that wrote them; several writers may append to different files.
    """

    def __init__(self, path: str | Path, clock: Callable[[], float] = time.time) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._clock = clock
        self._file: TextIO | None = self.path.open("a", encoding="utf-8")
        self._failed = False  # a write failed (its line may still sit in the buffer)

    def write(self, event: str, at: float | None = None, **fields: Any) -> None:
        """Append `{"t": at (default now), "event", **fields}`; fields must be JSON values (numpy scalars and
        paths are converted)."""
        if self._file is None:
            raise ValueError(f"MetricsWriter for {self.path} is closed")
        record = {"t": round(self._clock() if at is None else at, 6), "event": event, **fields}
        try:
            self._file.write(json.dumps(record, default=_jsonable) + "\n")
            self._file.flush()
        except OSError as exc:  # a full disk: say so, naming the file, not a raw traceback
            self._failed = True
            raise WriteError.of(self.path, exc) from None

    def close(self) -> None:
        if self._file is not None:
            file, self._file = self._file, None
            try:
                file.close()
            except OSError as exc:
                if not self._failed:  # after a failed write its unwritten line fails again: said already
                    raise WriteError.of(self.path, exc) from None

    def __enter__(self) -> MetricsWriter:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """Every line of a metrics file as a dict (blank lines skipped)."""
    with Path(path).open(encoding="utf-8") as file:
        return [json.loads(line) for line in file if line.strip()]


# ---------------------------------------------------------------------------------------------- traces

_CATEGORY = re.compile(r"[A-Za-z]+")


def _category(name: str) -> str:
    """ "F3" -> "f", "PUSH1" -> "push": lets Perfetto filter forwards, backwards, pushes, waits."""
    match = _CATEGORY.match(name)
    return match[0].lower() if match else "span"


class TraceRecorder:
    """Complete events (`ph: "X"`) of one thread of the timeline: pid_label "vw0" groups, tid is the stage.

    Timestamps are microseconds of the Unix clock (time.time), shared by every process on the machine,
    so traces recorded by separate stage processes line up when merged; durations come from a
    monotonic clock. `thread_label` names the row ("stage 0 (n0:1)"); default "stage {tid}".
    """

    def __init__(
        self,
        pid_label: str,
        tid: int,
        thread_label: str | None = None,
        wall: Callable[[], float] = time.time,
        clock: Callable[[], float] = time.perf_counter,
        max_events: int = MAX_TRACE_EVENTS,
    ) -> None:
        if max_events < 2:
            raise UsageError(f"a trace keeps at least 2 events, got max_events={max_events}")
        self.pid_label = pid_label
        self.tid = tid
        self.thread_label = thread_label if thread_label is not None else f"stage {tid}"
        self._wall = wall
        self._clock = clock
        self.first: list[dict[str, Any]] = []  # the run's first events (start-up, pipeline fill)
        self.last: deque[dict[str, Any]] = deque(maxlen=max_events - max_events // 2)  # and its newest
        self.head = max_events // 2
        self.dropped = 0  # events between the two, left out so a long run's trace stays bounded
        self.other_threads: dict[int, str] = {}  # more rows this recorder writes (tid -> label)

    def add(self, name: str, ts_us: float, dur_us: float, tid: int | None = None, **args: Any) -> None:
        """Record an event measured elsewhere: start in Unix microseconds, duration in microseconds; `tid`
        puts it on another row (e.g. the stage's PS traffic thread), default this recorder's."""
        event: dict[str, Any] = {
            "name": name,
            "cat": _category(name),
            "ph": "X",
            "ts": ts_us,
            "dur": dur_us,
            "pid": 0,
            "tid": self.tid if tid is None else tid,
        }
        if args:
            event["args"] = args
        if len(self.first) < self.head:
            self.first.append(event)
            return
        if len(self.last) == self.last.maxlen:
            self.dropped += 1
        self.last.append(event)

    @property
    def events(self) -> list[dict[str, Any]]:
        """The events kept: the first half of max_events and the newest, in order."""
        return self.first + list(self.last)

    @contextmanager
    def span(self, name: str, **args: Any) -> Iterator[None]:
        """Record the block as one event (also when it raises)."""
        ts_us = self._wall() * 1e6
        start = self._clock()
        try:
            yield
        finally:
            self.add(name, round(ts_us, 3), round((self._clock() - start) * 1e6, 3), **args)

    def dump(self, path: str | Path, other: Mapping[str, Any] | None = None) -> None:
        """Write a trace file of this thread alone (viewable as is; merge_traces combines several); `other`
        goes into its otherData (a stage puts its totals there: stage_totals reads them)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        meta = [
            _meta("process_name", 0, 0, self.pid_label),
            _meta("thread_name", 0, self.tid, self.thread_label),
        ]
        meta += [_meta("thread_name", 0, tid, label) for tid, label in self.other_threads.items()]
        if self.dropped:  # an instant event where the gap is, saying what was left out
            gap = self.last[0]["ts"] if self.last else 0.0
            meta.append(
                {
                    "name": f"{self.dropped} events left out (trace keeps {self.head} first and "
                    f"{self.last.maxlen} newest)",
                    "ph": "i",
                    "s": "t",
                    "ts": gap,
                    "pid": 0,
                    "tid": self.tid,
                }
            )
        document: dict[str, Any] = {"traceEvents": meta + self.events}
        if other:
            document["otherData"] = dict(other)
        path.write_text(json.dumps(document, default=_jsonable), encoding="utf-8")


_STAGE_TRACE = re.compile(r"vw(\d+)-s(\d+)")


def stage_totals(trace_dir: str | Path) -> dict[tuple[int, int], dict[str, Any]]:
    """(vw, stage) -> the totals a stage wrote into its trace's otherData (`times_s`: seconds by part, `waves`
    it ran), for every vw<V>-s<S>.json in `trace_dir` that has them: what a run on other machines (`hetpipe
    worker`, the testbed) leaves for wave_breakdown_ms."""
    out = {}
    for path in sorted(Path(trace_dir).glob("vw*-s*.json")):
        match = _STAGE_TRACE.fullmatch(path.stem)
        other = json.loads(path.read_text(encoding="utf-8")).get("otherData") if match else None
        if match and other and "times_s" in other:
            out[(int(match[1]), int(match[2]))] = other
    return out


def stage_breakdown_ms(
    times: Mapping[tuple[int, int], Mapping[str, float]], waves: int
) -> dict[tuple[int, int], dict[str, float]]:
    """Per (vw, stage), ms per wave in each part it timed (STAGE_PARTS on its own thread; push, pull and
    parked on its PS thread; train: its whole training loop), over `waves` waves."""
    return {
        key: {part: round(1000 * seconds / max(waves, 1), 3) for part, seconds in parts.items()}
        for key, parts in sorted(times.items())
    }


def wave_breakdown_ms(
    times: Mapping[tuple[int, int], Mapping[str, float]], waves: int
) -> dict[str, dict[str, float]]:
    """Per VW ("0", "1", ...), ms per wave in each part: the most any of the VW's stages spent there
    (stage_breakdown_ms)."""
    out: dict[str, dict[str, float]] = {}
    for (vw, _), parts in stage_breakdown_ms(times, waves).items():
        mine = out.setdefault(str(vw), {})
        for part, ms in parts.items():
            mine[part] = max(mine.get(part, 0.0), ms)
    return out


def _meta(kind: str, pid: int, tid: int, value: str | int) -> dict[str, Any]:
    key = "sort_index" if kind.endswith("sort_index") else "name"
    return {"name": kind, "ph": "M", "pid": pid, "tid": tid, "args": {key: value}}


def _natural(text: str) -> list[Any]:
    """ "vw10" after "vw2": digit runs compare as numbers."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", text)]


def merge_traces(paths: Sequence[str | Path], out_path: str | Path) -> None:
    """Combine dumped traces into one `{"traceEvents": [...]}` file: one process per pid label (VW), ordered
    naturally (vw2 before vw10), one thread per stage; times shifted so the earliest event starts at 0
    (the Unix origin is kept in otherData.origin_unix_us)."""
    labels: list[str] = []
    threads: dict[tuple[str, int], str] = {}
    spans: list[tuple[str, dict[str, Any]]] = []
    for path in paths:
        events = json.loads(Path(path).read_text(encoding="utf-8"))["traceEvents"]
        process = {
            e["pid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"
        }
        for event in events:
            label = process.get(event["pid"], f"pid {event['pid']}")
            if label not in labels:
                labels.append(label)
            if event["ph"] == "M" and event["name"] == "thread_name":
                threads[(label, event["tid"])] = event["args"]["name"]
            elif event["ph"] != "M":
                spans.append((label, event))
    labels.sort(key=_natural)
    pid_of = {label: i + 1 for i, label in enumerate(labels)}
    origin = min((event["ts"] for _, event in spans), default=0)
    meta = []
    for label in labels:
        pid = pid_of[label]
        meta += [_meta("process_name", pid, 0, label), _meta("process_sort_index", pid, 0, pid)]
    for (label, tid), name in sorted(threads.items(), key=lambda item: (pid_of[item[0][0]], item[0][1])):
        pid = pid_of[label]
        meta += [_meta("thread_name", pid, tid, name), _meta("thread_sort_index", pid, tid, tid)]
    merged = [
        {**event, "pid": pid_of[label], "ts": round(event["ts"] - origin, 3)}
        for label, event in sorted(spans, key=lambda item: item[1]["ts"])
    ]
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    document = {
        "traceEvents": meta + merged,
        "displayTimeUnit": "ms",
        "otherData": {"origin_unix_us": origin},
    }
    out_path.write_text(json.dumps(document), encoding="utf-8")


# ---------------------------------------------------------------------------------------------- progress


@dataclass(frozen=True)
class VwProgress:
    """One virtual worker's line of the live view."""

    vw: int
    gpus: str  # label of its GPUs in stage order, e.g. "titan-v,rtx-2060"
    wave: int  # waves completed, c_local
    loss: float | None  # latest training loss; None before the first
    samples_per_s: float
    lead: int  # c_local - c_global, waves ahead of the slowest VW
    gate_wait_s: float  # total time its stages spent waiting at the WSP gate
    span: tuple[int, int] | None = None  # the waves [start, end) it trains (wsp.md#planned-spans); None: all


def _duration(seconds: float) -> str:
    """41 s, 3 min 05 s, 2 h 07 min."""
    s = max(0, round(seconds))
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60:02d} s"
    return f"{s // 3600} h {s % 3600 // 60:02d} min"


def _progress_cells(row: VwProgress, total_waves: int) -> list[str]:
    loss = "-" if row.loss is None else f"{row.loss:.3f}"
    return [
        f"vw{row.vw} [{row.gpus}]",
        f"{row.wave}/{row.span[1] if row.span else total_waves}",
        loss,
        f"{row.samples_per_s:.0f}",
        f"{row.lead:+d}",
        f"{row.gate_wait_s:.1f}",
    ]


def format_progress(
    rows: Sequence[VwProgress], total_waves: int, width: int = 100, *, elapsed_s: float
) -> str:
    """The live view: one line per VW, columns aligned across VWs, then the overall bar, `width` wide.

        vw0 [fast,slow] wave 7/20  loss 0.412  312 samples/s  lead +1  gate wait 3.2 s
        [#######.............................] 35%  elapsed 41 s  eta 76 s

    Done = the waves the VWs completed / the waves they train (each its span's, or total_waves); eta
    extrapolates elapsed_s at that rate.
    """
    cells = [_progress_cells(row, total_waves) for row in rows]
    widths = [max((len(c[i]) for c in cells), default=0) for i in range(6)]
    lines = [
        f"{c[0]:<{widths[0]}} wave {c[1]:>{widths[1]}}  loss {c[2]:>{widths[2]}}  "
        f"{c[3]:>{widths[3]}} samples/s"
        f"  lead {c[4]:>{widths[4]}}  gate wait {c[5]:>{widths[5]}} s"
        for c in cells
    ]
    spans = [row.span or (0, total_waves) for row in rows]
    planned = sum(end - start for start, end in spans)
    trained = sum(max(0, min(row.wave, end) - start) for row, (start, end) in zip(rows, spans, strict=True))
    done = min(1.0, trained / planned) if planned > 0 else 0.0
    eta = _duration(elapsed_s * (1 - done) / done) if done > 0 else "-"
    tail = f" {math.floor(done * 100):>2d}%  elapsed {_duration(elapsed_s)}  eta {eta}"
    bar = max(10, width - len(tail) - 2)
    filled = math.floor(done * bar)
    lines.append(f"[{'#' * filled}{'.' * (bar - filled)}]{tail}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------- summary


def write_summary(path: str | Path, summary: Mapping[str, Any]) -> None:
    """The run summary as JSON, sorted keys, two-space indent."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(summary, indent=2, sort_keys=True, default=_jsonable) + "\n", encoding="utf-8")
