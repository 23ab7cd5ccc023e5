"""Shard checkpoints on disk (the file format lives in hetpipe.core.runs.checkpoint; stages write theirs with
it too) and the thread that writes them while the shard goes on serving."""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from hetpipe.core.runs.checkpoint import (
    Checkpoint,
    CheckpointError,
    discard_after,
    list_clocks,
    list_manifests,
    load_clock,
    load_newest,
    read_checkpoint,
    write_checkpoint,
)

__all__ = [
    "BackgroundWriter",
    "Checkpoint",
    "CheckpointError",
    "discard_after",
    "list_clocks",
    "list_manifests",
    "load_clock",
    "load_newest",
    "read_checkpoint",
    "write_checkpoint",
]

Job = tuple[int, Mapping[str, Any], Mapping[str, np.ndarray], Callable[[Path], None]]


class BackgroundWriter:
    """Writes checkpoints in a thread (file writes, sha256 and fsync let the shard's loop run meanwhile). One
    is written at a time; one more may wait, and a newer one replaces it. `done(path)` runs in the writer
    thread once a checkpoint is on disk."""

    def __init__(self, directory: Path, keep: int, log: Callable[[str], None]) -> None:
        self.directory, self.keep, self.log = directory, keep, log
        self._cond = threading.Condition()
        self._waiting: Job | None = None
        self._busy = False
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="checkpoint-writer", daemon=True)
        self._thread.start()

    def submit(
        self,
        clock: int,
        meta: Mapping[str, Any],
        arrays: Mapping[str, np.ndarray],
        done: Callable[[Path], None],
    ) -> None:
        """Queue a checkpoint (its arrays must not change any more); a newer one queued before it starts
        wins."""
        with self._cond:
            self._waiting = (clock, meta, arrays, done)
            self._cond.notify_all()

    def drain(self) -> None:
        """Return once nothing is queued or being written."""
        with self._cond:
            while self._waiting is not None or self._busy:
                self._cond.wait()

    def close(self) -> None:
        self.drain()
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(10)

    def _run(self) -> None:
        while True:
            with self._cond:
                while self._waiting is None and not self._closed:
                    self._cond.wait()
                if self._waiting is None:
                    return
                job, self._waiting, self._busy = self._waiting, None, True
            clock, meta, arrays, done = job
            try:
                done(write_checkpoint(self.directory, clock, meta, arrays, self.keep))
            except Exception as exc:  # a full disk must not take the shard down; the next one tries again
                self.log(f"checkpoint of clock {clock} failed: {exc}")
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()
