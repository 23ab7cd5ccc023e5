"""Child processes owned by a launcher: started, logged to files, watched, and all stopped together.

No process is left behind: `stop()` sends SIGTERM, waits, then SIGKILLs stragglers; a launcher that
sees one child fail stops the rest and reports the failed child's exit and its last log lines.

Children start from a fork server where the platform has one (`HETPIPE_START_METHOD` = forkserver or spawn
chooses): a clean process, exec'd like a spawned child, that has only imported modules (`warm_forkserver`
names them, e.g. torch and the stage code) and forks each child from that state, so a child starts in
milliseconds instead of paying an interpreter start and `import torch` (about 1 s) of its own. The fork
server holds no ZeroMQ context, no torch thread pool and (OPENBLAS_NUM_THREADS=1 while it starts) no BLAS
thread: nothing that must not be forked. ZeroMQ contexts are still created inside each child. A child gets
the launcher's sys.path and working directory at its start, but the environment the fork server started with.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import multiprocessing.forkserver
import os
import signal
import socket
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

from hetpipe.core.errors import UsageError

__all__ = [
    "Child",
    "ChildFailed",
    "ChildGroup",
    "child_entered_at",
    "describe_exit",
    "free_port",
    "process_started_at",
    "start_method",
    "tail",
    "warm_forkserver",
]

_entered_at: float | None = None  # when _child_main began in this process (its target's imports done)


def start_method() -> str:
    """How children start: $HETPIPE_START_METHOD if set, else "forkserver" where available, else "spawn"."""
    wanted = os.environ.get("HETPIPE_START_METHOD", "")
    if wanted:
        if wanted not in ("forkserver", "spawn"):
            raise UsageError(f"HETPIPE_START_METHOD={wanted!r}: use forkserver or spawn (never fork)")
        return wanted
    return "forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn"


def warm_forkserver(preload: Sequence[str]) -> None:
    """Start the fork server now, importing `preload` while the caller goes on (nothing when children are
    spawned; a fork server already running keeps the preload it was started with)."""
    if start_method() != "forkserver":
        return
    mp.get_context("forkserver").set_forkserver_preload(list(preload))
    blas = {k: os.environ.get(k) for k in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS")}
    # read by the fork server at exec: no BLAS thread in it (children set torch's threads to 1 themselves)
    try:
        os.environ.update({k: v or "1" for k, v in blas.items()})
        multiprocessing.forkserver.ensure_running()
    finally:
        for key, value in blas.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def process_started_at(pid: int | None = None) -> float | None:
    """When process `pid` (default: this one) started, on the Unix clock, to 10 ms; None where /proc is
    missing."""
    try:
        with open(f"/proc/{pid or 'self'}/stat", "rb") as stat, open("/proc/uptime", "rb") as uptime:
            ticks = int(stat.read().rsplit(b")", 1)[1].split()[19])
            up = float(uptime.read().split()[0])
        now = time.time()
        return now - (up - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return None


def child_entered_at() -> float | None:
    """In a child of a ChildGroup: when its entry point began (after the imports its target needed)."""
    return _entered_at


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` right now (the OS picks it), e.g. for a process-group rendezvous."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def tail(path: Path, lines: int = 15) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.rstrip("\n").splitlines()[-lines:])


def describe_exit(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with code {code}"


def _child_main(log_path: str | None, target: Callable[..., Any], args: tuple[Any, ...]) -> None:
    global _entered_at
    _entered_at = time.time()
    if log_path is not None:
        fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        sys.stdout = os.fdopen(1, "w", buffering=1)
        sys.stderr = os.fdopen(2, "w", buffering=1)
    target(*args)


@dataclass
class Child:
    name: str
    process: BaseProcess
    log: Path | None


class ChildFailed(Exception):
    def __init__(self, child: Child) -> None:
        self.child = child
        detail = describe_exit(child.process.exitcode)
        last = tail(child.log) if child.log else ""
        text = f"{child.name} (pid {child.process.pid}) {detail}"
        if last:
            text += f"; its last log lines ({child.log}):\n{last}"
        super().__init__(text)


class ChildGroup:
    """Children that live and die together (started as `start_method()` says, or as `method` says)."""

    def __init__(self, log_dir: Path | None = None, method: str | None = None) -> None:
        self.ctx = mp.get_context(method or start_method())
        self.log_dir = log_dir
        self.children: list[Child] = []
        if log_dir is not None:
            log_dir.mkdir(parents=True, exist_ok=True)

    def start(self, name: str, target: Callable[..., Any], *args: Any) -> Child:
        log = self.log_dir / f"{name}.log" if self.log_dir is not None else None
        if log is not None:
            log.write_text("")
        proc = self.ctx.Process(target=_child_main, args=(str(log) if log else None, target, args), name=name)
        proc.start()
        child = Child(name, proc, log)
        self.children.append(child)
        return child

    def failed(self) -> Child | None:
        """The first child that ended with a non-zero exit, if any."""
        for child in self.children:
            code = child.process.exitcode
            if code is not None and code != 0:
                return child
        return None

    def all_done(self) -> bool:
        return all(c.process.exitcode is not None for c in self.children)

    def wait(self, poll_s: float = 0.2, on_tick: Callable[[], None] | None = None) -> None:
        """Until every child exits 0; raises ChildFailed (after stopping the rest) when one fails."""
        while not self.all_done():
            bad = self.failed()
            if bad is not None:
                self.stop()
                raise ChildFailed(bad)
            if on_tick:
                on_tick()
            time.sleep(poll_s)
        bad = self.failed()
        if bad is not None:
            raise ChildFailed(bad)

    def stop(self, grace_s: float = 5.0) -> None:
        """SIGTERM every live child, wait up to grace_s, SIGKILL the rest, reap all."""
        for child in self.children:
            if child.process.exitcode is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(child.process.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for child in self.children:
            child.process.join(max(0.0, deadline - time.monotonic()))
        for child in self.children:
            if child.process.exitcode is None:
                child.process.kill()
                child.process.join(2.0)

    def __enter__(self) -> ChildGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
