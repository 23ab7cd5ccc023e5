"""The running part of `hetpipe train`: pump the stages' and the live evaluator's events into metrics.jsonl,
the progress view and TensorBoard while the supervisor watches the children, until every stage is done; and
the error that names the child a failed run stopped on. Starts nothing and reads no weights."""

from __future__ import annotations

import queue as queue_mod
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hetpipe.app.board import Board
from hetpipe.app.live_eval import LiveEvaluator
from hetpipe.app.progress import Progress, ProgressView
from hetpipe.app.span_starts import SpanStarts
from hetpipe.app.supervise import Supervisor
from hetpipe.core.config.schema import ClusterConfig
from hetpipe.core.errors import HetpipeError
from hetpipe.core.runs.metrics import MetricsWriter, format_progress
from hetpipe.core.runs.procs import ChildFailed

__all__ = ["PEER_LOST", "REJOINED_GRACE_S", "RunWatch", "failure_error", "root_cause"]

# After the last wave, how long `hetpipe train` keeps the PS up for the stages of a VW that rejoined through
# `hetpipe worker --join` (not its children) to learn by heartbeat that their last pushes are in a checkpoint.
REJOINED_GRACE_S = 3.0


@dataclass
class RunWatch:
    """A started run as the launcher watches it: the events queued by its stages and its live evaluator go
    to metrics.jsonl, `failures`, the progress (and its view) and TensorBoard; the supervisor restarts and
    evicts."""

    config: ClusterConfig
    events: Any  # the stages' event queue
    metrics: MetricsWriter
    failures: dict[str, dict[str, Any]]  # stage_failed events by child name ("vw<V>-s<S>")
    progress: Progress
    view: ProgressView
    board: Board | None
    supervisor: Supervisor
    live: LiveEvaluator
    started: float  # time.monotonic() when the launcher started its children
    starts: SpanStarts | None = None  # VWs planned for later waves on GPUs earlier VWs hold: started here

    def pump(self) -> None:
        """Take every queued event, record and show it, and let the live evaluator see each new c_global."""
        for source in (self.events, self.live.results):
            while True:
                try:
                    event = source.get_nowait()
                except queue_mod.Empty:
                    break
                fields = {k: v for k, v in event.items() if k not in ("event", "time")}
                self.metrics.write(event["event"], at=event.get("time"), **fields)
                if event["event"] == "stage_failed":
                    self.failures[f"vw{event['vw']}-s{event['stage']}"] = event
                self.progress.update(event)
                if self.board is not None:
                    self.board.write(event, self.progress)
                self.live.wave_done(
                    self.progress.c_global()
                )  # per event: every due point is seen, however late
        self.progress.evicted = set(self.supervisor.evicted)
        self._show()

    def _show(self, force: bool = False) -> None:
        self.view.show(
            format_progress(
                self.progress.rows(), self.config.train.waves, elapsed_s=time.monotonic() - self.started
            ),
            force=force,
        )

    def waiting(self) -> bool:
        """Whether a stage runs, or a VW's stages are still to start."""
        return self.supervisor.stages_running() or bool(self.starts and self.starts.pending)

    def _start_later(self) -> None:
        """Start the stages of each VW whose GPUs' earlier VWs have pushed their last waves."""
        if self.starts is None or not self.starts.pending:
            return
        layouts, waves = self.progress.layouts, self.config.train.waves
        started = self.starts.tick(lambda u: self.progress.completed(u) >= layouts[u].span(waves)[1])
        if started:
            self.supervisor.stages.update(started)
            self.supervisor.write_pids()

    def until_done(self) -> tuple[float, float]:
        """Pump and supervise until every stage has stopped and every live VW did all its waves (a little
        longer when a VW was evicted); returns (wall seconds since the start, seconds from the first minibatch
        to the last)."""
        waves = self.config.train.waves
        while self.waiting() or not self.supervisor.all_live_done(waves):
            self.pump()
            self._start_later()
            self.supervisor.tick()
            time.sleep(0.2)
        if self.supervisor.evicted:
            time.sleep(REJOINED_GRACE_S)  # a rejoined worker's stages hear "in a checkpoint" by heartbeat
        self.pump()
        self.supervisor.tick()
        self._show(force=True)
        finished = time.monotonic()
        wall = finished - self.started
        training = (self.progress.last_step or 0.0) - (self.progress.first_step or 0.0)
        return wall, training


def failure_error(
    exc: ChildFailed, events: Any, failures: dict[str, dict[str, Any]], log_dir: Path
) -> HetpipeError:
    """The error a run that lost child `exc.child` ends with (its children already stopped): the stage that
    met a non-finite loss or update when one did, else the child that failed, with why when its stage said."""
    _collect_failures(events, failures)
    stopped = _non_finite_stop(failures, log_dir)
    if stopped is not None:
        return stopped
    name = root_cause(exc.child.name, failures)
    why = failures.get(name, {}).get("error")
    return HetpipeError(f"{exc}" + (f"\n{name} failed with {why}" if why else ""))


# what a stage says when a neighbour died under it: its failure is the neighbour's, not its own
PEER_LOST = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")


def root_cause(name: str, failures: dict[str, dict[str, Any]]) -> str:
    """The stage whose error to show for a run that lost `name`: `name`, unless all it said is that a peer
    went away while another stage said what went wrong (a full disk, an error of its own); then the first of
    those."""

    def lost_a_peer(stage: str) -> bool:
        return any(text in failures.get(stage, {}).get("error", "") for text in PEER_LOST)

    if not lost_a_peer(name):
        return name
    causes = [stage for stage, failure in failures.items() if failure.get("error") and not lost_a_peer(stage)]
    return min(causes, key=lambda stage: failures[stage].get("time", 0.0)) if causes else name


def _non_finite_stop(failures: dict[str, dict[str, Any]], log_dir: Path) -> HetpipeError | None:
    """The error that ends a run whose stage stopped on a NaN or inf loss, or whose update the PS refused as
    non-finite (no traceback: the cause is known)."""
    for name, event in failures.items():
        error = str(event.get("error", ""))
        if error.startswith("NonFiniteLoss") or "non_finite:" in error:
            wave = f" in wave {event['wave']}" if "wave" in event else ""
            fix = (
                ""
                if "on_nan" in error
                else (
                    '; lower train.lr or check the data, or set train.on_nan = "skip" '
                    "to skip such minibatches"
                )
            )
            return HetpipeError(
                f"stage {event['stage']} of virtual worker {event['vw']} ({name}) stopped the run"
                f"{wave}: {error}\n  its log: {log_dir / (name + '.log')}{fix}"
            )
    return None


def _collect_failures(events: Any, failures: dict[str, dict[str, Any]]) -> None:
    """Stage failures still queued when a child's exit was seen first."""
    while True:
        try:
            event = events.get(timeout=0.5)
        except (queue_mod.Empty, OSError, ValueError):
            return
        if event.get("event") == "stage_failed":
            failures[f"vw{event['vw']}-s{event['stage']}"] = event
