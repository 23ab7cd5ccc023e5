"""Shard checkpoints on disk (the file format lives in hetpipe.core.runs.checkpoint; stages write theirs with
it too) and the thread that writes them while the shard goes on serving."""

from __future__ import annotations

import errno
import os
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
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
    "CHECKPOINT_FAILURES_FATAL",
    "BackgroundWriter",
    "CheckpointHealth",
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

CHECKPOINT_FAILURES_FATAL = 3  # periodic checkpoints failed in a row that stop the run (a constant)
RESERVED_FILES = 8  # descriptors the writer holds between checkpoints and frees just before writing one
# a write that finds no descriptor is tried again this many times, WAIT_FOR_FILES_S apart: connections over
# the shard's limits are closed within milliseconds of their accept, but while a flood lasts they hold
# descriptors for that moment and may take the ones the reserve just freed
OUT_OF_FILES_RETRIES = 20
WAIT_FOR_FILES_S = 0.05


@dataclass
class CheckpointHealth:
    """How the periodic checkpoints fare: each failure is a warning (the shard's log, its status:
    `checkpoint_failures`); CHECKPOINT_FAILURES_FATAL in a row stop the run, since a crash of the shard could
    no longer be recovered. Written by the writer thread, read by the loop (plain ints and a str)."""

    failures: int = 0
    in_a_row: int = 0
    last_error: str = ""

    def failed(self, clock: int, exc: BaseException) -> str:
        """Count a failed checkpoint of `clock`; the warning to log."""
        self.failures += 1
        self.in_a_row += 1
        self.last_error = f"clock {clock}: {exc}"
        return (
            f"warning: checkpoint of clock {clock} failed: {exc} ({self.in_a_row} in a row; "
            f"{CHECKPOINT_FAILURES_FATAL} in a row stop the run). Until one succeeds a crash of this shard "
            "loses the pushes since the last one: free disk space or file descriptors (ulimit -n)"
        )

    def succeeded(self) -> None:
        self.in_a_row = 0

    @property
    def fatal(self) -> bool:
        return self.in_a_row >= CHECKPOINT_FAILURES_FATAL

    def info(self) -> dict[str, Any]:
        """The fields of the shard's status."""
        return {
            "checkpoint_failures": self.failures,
            "checkpoint_failures_in_a_row": self.in_a_row,
            "checkpoint_error": self.last_error,
        }


class FileReserve:
    """A few descriptors (of /dev/null) held so that a checkpoint finds some free even when connections took
    every other one: freed just before a write, taken again after it."""

    def __init__(self, count: int) -> None:
        self.count = count
        self.fds: list[int] = []
        self.take()

    def take(self) -> None:
        try:
            while len(self.fds) < self.count:
                self.fds.append(os.open(os.devnull, os.O_RDONLY))
        except OSError:
            pass  # out of descriptors right now: fewer held until the next write

    def release(self) -> None:
        for fd in self.fds:
            os.close(fd)
        self.fds = []


def out_of_files(exc: BaseException) -> bool:
    """`exc` says no file descriptor was free (this process's, or the system's)."""
    return getattr(exc, "errno", None) in (errno.EMFILE, errno.ENFILE)


def write_out_of_files_retried(
    write: Callable[[], Path], sleep: Callable[[float], None] = time.sleep
) -> Path:
    """`write()`, tried again up to OUT_OF_FILES_RETRIES times while it finds no free descriptor (EMFILE,
    ENFILE); any other error, or the last one, is raised."""
    for _ in range(OUT_OF_FILES_RETRIES):
        try:
            return write()
        except Exception as exc:  # an OSError, or the WriteError that names it (with its errno)
            if not out_of_files(exc):
                raise
        sleep(WAIT_FOR_FILES_S)
    return write()


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
        self.health = CheckpointHealth()
        self._reserve = FileReserve(RESERVED_FILES)
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
        self._reserve.release()

    def _run(self) -> None:
        while True:
            with self._cond:
                while self._waiting is None and not self._closed:
                    self._cond.wait()
                if self._waiting is None:
                    return
                job, self._waiting, self._busy = self._waiting, None, True
            self._write(job)

    def _write(self, job: Job) -> None:
        """Write one checkpoint with the reserved descriptors freed; a failure is counted and logged."""
        clock, meta, arrays, done = job
        self._reserve.release()
        try:
            path = write_out_of_files_retried(
                lambda: write_checkpoint(self.directory, clock, meta, arrays, self.keep)
            )
            self.health.succeeded()
            done(path)
        except Exception as exc:  # a full disk must not take the shard down; the next one tries again
            self.log(self.health.failed(clock, exc))
        finally:
            self._reserve.take()
            with self._cond:
                self._busy = False
                self._cond.notify_all()
