"""Child processes owned by a launcher: started, logged to files, watched, and all stopped together.

No process is left behind: `stop()` sends SIGTERM, waits, then SIGKILLs stragglers; a launcher that
sees one child fail stops the rest and reports the failed child's exit and its last log lines. Nor does any
outlive its launcher, even one killed with SIGKILL: each child holds the read end of a pipe whose write end
only the launcher holds, and a thread of the child (`_watch_launcher`) waits for its EOF, then ends the child
with SIGTERM (a PS shard checkpoints on it) and LAUNCHER_GONE_GRACE_S later with SIGKILL. (A parent-death
signal, prctl(PR_SET_PDEATHSIG), would not do: a child's parent is the fork server, not the launcher, and the
fork server lives on while any child holds its alive pipe.) With the children gone the fork server and the
resource tracker end too. A child's log is appended to, with a header line at each start, so a restarted
child's log keeps the lines of the one before.

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
import queue
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing import reduction
from multiprocessing.connection import Connection
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
LAUNCHER_GONE_GRACE_S = 3.0  # a child whose launcher died: from its SIGTERM to its SIGKILL


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


def is_stopped(pid: int) -> bool:
    """Process `pid` is stopped (SIGSTOP, SIGTSTP, a debugger) or gone; False where /proc is missing."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            return stat.read().rsplit(b")", 1)[1].split()[0] in (b"T", b"t", b"Z", b"X")
    except FileNotFoundError:
        return os.path.isdir("/proc/self")  # /proc is there: the process is gone
    except (OSError, IndexError):
        return False


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


@dataclass
class _Held:
    """A file descriptor of the launcher that each child holds open for its life (the run dir's lock: an
    flock is released only when every descriptor of it is closed); arrives in the child as its number."""

    fd: int

    def __reduce__(self) -> tuple[Any, ...]:
        return (_held_fd, (reduction.DupFd(self.fd),))


def _held_fd(dup: Any) -> int:
    return dup.detach()


@dataclass
class _ChildSetup:
    """What `_child_main` does before the child's target: its log, and the watch on its launcher."""

    name: str
    log: str | None
    lifeline: Connection  # read end of the launcher's pipe: EOF once the launcher is gone
    launcher: int  # its PID, for the log
    held: int | None = None  # kept open, never used (see _Held)


def _child_main(setup: _ChildSetup, target: Callable[..., Any], args: tuple[Any, ...]) -> None:
    global _entered_at
    _entered_at = time.time()
    if setup.log is not None:
        fd = os.open(setup.log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        sys.stdout = os.fdopen(1, "w", buffering=1)
        sys.stderr = os.fdopen(2, "w", buffering=1)
        print(
            f"==== {setup.name} (pid {os.getpid()}, launcher pid {setup.launcher}) started "
            f"{time.strftime('%Y-%m-%d %H:%M:%S')} ====",
            flush=True,
        )
    threading.Thread(
        target=_watch_launcher, args=(setup.lifeline,), name="launcher-watch", daemon=True
    ).start()
    target(*args)


def _watch_launcher(lifeline: Connection) -> None:
    """Wait for the launcher to go (EOF on the pipe it alone writes to), then end this process: SIGTERM, and
    SIGKILL if it is still there LAUNCHER_GONE_GRACE_S later."""
    with contextlib.suppress(EOFError, OSError):
        lifeline.recv_bytes()  # nothing is ever sent: this returns (or raises) at EOF
    print(f"hetpipe: the launcher is gone; pid {os.getpid()} ends too", file=sys.stderr, flush=True)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(LAUNCHER_GONE_GRACE_S)
    os.kill(os.getpid(), signal.SIGKILL)


def _start_child(
    setup: _ChildSetup, held: int | None, target: Callable[..., Any], args: tuple[Any, ...]
) -> None:
    """The child's entry point: `held` arrives as the child's own descriptor of the launcher's (see _Held)."""
    setup.held = held
    _child_main(setup, target, args)


@dataclass
class Child:
    name: str
    process: BaseProcess
    log: Path | None


class ChildFailed(Exception):
    """`child` ended badly (`how`: its describe_exit unless given); `also`: others that ended with it."""

    def __init__(self, child: Child, how: str | None = None, also: Sequence[Child] = ()) -> None:
        self.child = child
        detail = how or describe_exit(child.process.exitcode)
        last = tail(child.log) if child.log else ""
        text = f"{child.name} (pid {child.process.pid}) {detail}"
        if also:
            text += "; ended with it: " + ", ".join(
                f"{c.name} ({describe_exit(c.process.exitcode)})" for c in also
            )
        if last:
            text += f"; its last log lines ({child.log}):\n{last}"
        super().__init__(text)


class ChildGroup:
    """Children that live and die together (started as `start_method()` says, or as `method` says)."""

    def __init__(
        self, log_dir: Path | None = None, method: str | None = None, hold: int | None = None
    ) -> None:
        """`hold`: a file descriptor every child keeps open for its life (the run dir's lock)."""
        self.ctx = mp.get_context(method or start_method())
        self.log_dir = log_dir
        self.children: list[Child] = []
        self.hold = hold
        # the children's lifeline: this process alone holds the write end, so they see EOF when it is gone
        self._lifeline, self._lifeline_w = self.ctx.Pipe(duplex=False)
        if log_dir is not None:
            log_dir.mkdir(parents=True, exist_ok=True)

    def start(self, name: str, target: Callable[..., Any], *args: Any) -> Child:
        """Start `name`, its output appended to <log_dir>/<name>.log (a restart keeps the earlier lines)."""
        log = self.log_dir / f"{name}.log" if self.log_dir is not None else None
        setup = _ChildSetup(name, str(log) if log else None, self._lifeline, os.getpid())
        held = _Held(self.hold) if self.hold is not None else None
        proc = self.ctx.Process(target=_start_child, args=(setup, held, target, args), name=name)
        proc.start()
        child = Child(name, proc, log)
        self.children.append(child)
        return child

    def start_listening(
        self, name: str, target: Callable[..., Any], job: Any, timeout_s: float = 60
    ) -> tuple[Child, int]:
        """Start a server child `target(job, port_queue)` that puts the port it bound on the queue; returns it
        and the port (ChildFailed when none comes within timeout_s)."""
        port_queue = self.ctx.Queue()
        child = self.start(name, target, job, port_queue)
        try:
            return child, port_queue.get(timeout=timeout_s)
        except queue.Empty:
            raise ChildFailed(child) from None

    def failed(self) -> Child | None:
        """A child that ended with a non-zero exit, if any: the first killed by a signal, else the first."""
        ended = [c for c in self.children if c.process.exitcode not in (None, 0)]
        signalled = [c for c in ended if (c.process.exitcode or 0) < 0]
        return (signalled or ended or [None])[0]

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


def serve_each(
    jobs: Sequence[Any],
    target: Callable[[Any], None],
    name: Callable[[Any], str],
    grace_s: float,
    on_interrupt: str = "",
) -> None:
    """Serve every job with `target`: a single one in this process, several as children stopped together
    when one fails or on Ctrl-C (saying `on_interrupt` then)."""
    if len(jobs) == 1:
        target(jobs[0])
        return
    group = ChildGroup()
    try:
        for job in jobs:
            group.start(name(job), target, job)
        group.wait()
    except KeyboardInterrupt:
        if on_interrupt:
            print(on_interrupt, file=sys.stderr)
    finally:
        group.stop(grace_s=grace_s)
