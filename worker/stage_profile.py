"""A stage's `hetpipe train --profile` window: torch.profiler around those actions, written to
<run>/profile/."""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from hetpipe.compute.op_profile import format_profile, op_profile, start_profiler, stop_profiler
from hetpipe.core.pipeline.profile_window import ProfileWindow
from hetpipe.core.pipeline.schedule import FORWARD, UPDATE

__all__ = ["StageProfiler"]


class StageProfiler:
    """Call before() and after() around every action; close() at the end writes a window the run cut short.
    Writes <out_dir>/<name>.txt (the tables) and <name>.json (op_profile's summary). Per-minibatch figures
    divide by the forwards run inside the window (with Nm in flight some are of minibatches past its last; as
    many backwards and updates of earlier ones are inside it too)."""

    def __init__(self, window: ProfileWindow, device: torch.device, out_dir: Path, name: str) -> None:
        self.window, self.device, self.out_dir, self.name = window, device, out_dir, name
        self._prof = None
        self._started = 0.0
        self._first = -1  # the minibatch whose forward opened it
        self._last = -1  # the last minibatch an update covered inside it
        self._forwards = 0  # forwards run inside it
        self.done = False

    def before(self, kind: str, index: int) -> None:
        if self._prof is None and not self.done and self.window.opens_at(kind, index):
            self._first = index
            self._prof = start_profiler(self.device)
            self._started = time.perf_counter()
        if self._prof is not None and kind == FORWARD:
            self._forwards += 1

    def after(self, kind: str, index: int) -> None:
        if self._prof is None or kind != UPDATE:
            return
        self._last = index
        if self.window.closes_after(kind, index):
            self._finish("")

    def close(self) -> None:
        """The run ended inside the window: write what was profiled, saying so."""
        if self._prof is not None:
            self._finish(
                f" (the run ended at minibatch {self._last} before the window's end, {self.window.last})"
            )

    def _finish(self, note: str) -> None:
        assert self._prof is not None
        stop_profiler(self._prof, self.device)
        wall = time.perf_counter() - self._started
        summary = op_profile(self._prof, self._forwards, wall, self.device)
        summary["window"] = [self._first, self._last]
        self._prof, self.done = None, True
        self.out_dir.mkdir(parents=True, exist_ok=True)
        title = (
            f"{self.name}, from the forward of minibatch {self._first} through the update of "
            f"{self._last}{note}"
        )
        (self.out_dir / f"{self.name}.txt").write_text(format_profile(summary, title) + "\n")
        (self.out_dir / f"{self.name}.json").write_text(json.dumps(summary, indent=1))
