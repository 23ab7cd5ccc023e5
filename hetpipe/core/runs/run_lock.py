"""One run per run dir: `hetpipe train` holds an flock on <run dir>/train.lock for its life, and its children
hold it with it (ChildGroup's `hold`), so a second run cannot start in the dir while any process of the first
is left. Locks only; writes nothing else in the dir."""

from __future__ import annotations

import fcntl
import os
import time
from dataclasses import dataclass
from pathlib import Path

from hetpipe.core.errors import UsageError

__all__ = ["LOCK_NAME", "RunLock", "lock_run_dir"]

LOCK_NAME = "train.lock"
LEFTOVER_WAIT_S = 15.0  # how long to wait for the children of a launcher that died to end (they do in ~3 s)


@dataclass
class RunLock:
    """The lock a launcher holds on its run dir; `fd` is what its children keep open."""

    path: Path
    fd: int

    def release(self) -> None:
        """Close the launcher's descriptor: the lock is free once its children's are closed too (at their
        end), so a child left running still keeps the dir."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def lock_run_dir(run_dir: Path, wait_s: float = LEFTOVER_WAIT_S) -> RunLock:
    """Take `run_dir`'s lock (the dir exists) and write this PID in it; UsageError naming the dir and the
    holder when another run holds it. When the holder is a launcher that died, wait up to `wait_s` for its
    children, which end within seconds of it."""
    path = run_dir / LOCK_NAME
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    deadline = time.monotonic() + wait_s
    while not _try_lock(fd):
        holder = _holder(fd)
        if holder is not None and _alive(holder) or time.monotonic() >= deadline:
            os.close(fd)
            raise UsageError(_busy(run_dir, path, holder))
        time.sleep(0.2)
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return RunLock(path, fd)


def _try_lock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def _holder(fd: int) -> int | None:
    """The PID the holder wrote, or None (not written yet)."""
    try:
        return int(os.pread(fd, 32, 0).decode().strip())
    except (OSError, ValueError):
        return None


def _alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie, dead but not yet reaped by its parent, does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            return stat.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except (OSError, IndexError):
        return True


def _busy(run_dir: Path, path: Path, holder: int | None) -> str:
    if holder is None or _alive(holder):
        who = f"pid {holder}" if holder is not None else "a process that has not yet written its PID"
        return (
            f"{run_dir} is in use by another `hetpipe train` ({who}, holding {path}): wait for it to end or "
            f"stop it{f' (kill {holder})' if holder else ''}, or choose another run dir"
        )
    return (
        f"{run_dir} is still held by the processes of a `hetpipe train` that died (pid {holder}; {path}): "
        "they should have ended within seconds; find them with `fuser " + f"{path}` and stop them"
    )
