"""Tests of hetpipe.core.runs.procs and run_lock against a launcher's death: children (and the fork server and
resource tracker) end with a launcher killed by SIGKILL, a restarted child's log keeps the lines before, and
a run dir is locked by one run (issue 36)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from hetpipe.core.errors import UsageError
from hetpipe.core.runs.procs import ChildGroup
from hetpipe.core.runs.run_lock import lock_run_dir

HAS_PROC = Path("/proc/self/stat").exists()

LAUNCHER = """
import json, multiprocessing.forkserver, multiprocessing.resource_tracker, signal, sys, time
from pathlib import Path
from hetpipe.core.runs.procs import ChildGroup, warm_forkserver


def sleeper(stubborn):
    if stubborn:  # ignores SIGTERM: only the SIGKILL after the grace ends it
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    time.sleep(600)


if __name__ == "__main__":
    warm_forkserver([])
    group = ChildGroup(log_dir=Path(sys.argv[1]))
    queue = group.ctx.Queue()  # starts the resource tracker (the queue's semaphores)
    children = [group.start(f"c{i}", sleeper, i == 1) for i in range(2)]
    helpers = [multiprocessing.forkserver._forkserver._forkserver_pid,
               multiprocessing.resource_tracker._resource_tracker._pid]
    print(json.dumps({"children": [c.process.pid for c in children], "helpers": helpers}), flush=True)
    time.sleep(600)
"""


def gone(pid: int) -> bool:
    """No such process, or a zombie (dead; its new parent has not reaped it yet)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            return stat.read().rsplit(b")", 1)[1].split()[0] == b"Z"
    except (FileNotFoundError, ProcessLookupError):
        return True


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.skipif(not HAS_PROC, reason="needs Linux /proc")
def test_children_and_helpers_end_when_the_launcher_is_killed(tmp_path: Path) -> None:
    """Issue 36: `kill -9` of the launcher left its children, the fork server and the resource tracker
    running. Each child (one that ignores SIGTERM too) must end within seconds of the launcher."""
    script = tmp_path / "launcher.py"
    script.write_text(textwrap.dedent(LAUNCHER))
    launcher = subprocess.Popen(
        [sys.executable, str(script), str(tmp_path / "logs")], stdout=subprocess.PIPE, text=True, cwd=tmp_path
    )
    pids: dict[str, list[int]] = {"children": [], "helpers": []}
    try:
        pids = json.loads(launcher.stdout.readline())
        assert all(not gone(pid) for pid in pids["children"] + pids["helpers"]), pids
        os.kill(launcher.pid, signal.SIGKILL)
        launcher.wait()
        deadline = time.monotonic() + 60  # a hang guard: they end within LAUNCHER_GONE_GRACE_S
        while not all(gone(pid) for pid in pids["children"] + pids["helpers"]):
            left = [pid for pid in pids["children"] + pids["helpers"] if not gone(pid)]
            assert time.monotonic() < deadline, f"left behind by the killed launcher: {left}"
            time.sleep(0.2)
        assert "the launcher is gone" in (tmp_path / "logs" / "c0.log").read_text()
    finally:
        for pid in [launcher.pid, *pids["children"], *pids["helpers"]]:
            if not gone(pid):
                os.kill(pid, signal.SIGKILL)


def _say(text: str) -> None:
    print(text, flush=True)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_restarted_childs_log_keeps_the_lines_of_the_one_before(tmp_path: Path) -> None:
    """Issue 36: a restarted PS shard's log began empty, the lines before its crash lost."""
    with ChildGroup(log_dir=tmp_path / "logs") as group:
        for text in ("before the crash", "after the restart"):
            child = group.start("ps-shard-0", _say, text)
            child.process.join(60)
            assert child.process.exitcode == 0
    lines = (tmp_path / "logs" / "ps-shard-0.log").read_text().splitlines()
    headers = [line for line in lines if line.startswith("==== ps-shard-0 (pid ")]
    assert len(headers) == 2 and "before the crash" in lines and "after the restart" in lines
    assert lines.index("before the crash") < lines.index(headers[1]) < lines.index("after the restart")


def test_a_run_dir_is_locked_by_one_run(tmp_path: Path) -> None:
    """A second lock of a dir a live process holds names the dir and the holder's PID (exit 2); once the
    holder lets go, the dir can be locked again."""
    lock = lock_run_dir(tmp_path)
    holder = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(60)"], pass_fds=(lock.fd,)
    )  # holds the lock with it, as a child does: only the holder's PID is in the file
    try:
        os.pwrite(lock.fd, f"{holder.pid}\n".encode().ljust(16), 0)
        lock.release()
        with pytest.raises(
            UsageError, match=f"{tmp_path} is in use by another .* \\(pid {holder.pid}, holding"
        ):
            lock_run_dir(tmp_path, wait_s=0)
    finally:
        holder.kill()
        holder.wait()
    again = lock_run_dir(tmp_path, wait_s=0)
    assert (tmp_path / "train.lock").read_text().strip() == str(os.getpid())
    again.release()


def _held_by(run_dir: Path, launcher: int, seconds: float) -> subprocess.Popen:
    """A child of `launcher` (its PID written in the lock) holding `run_dir`'s lock for `seconds`."""
    lock = lock_run_dir(run_dir, wait_s=0)
    child = subprocess.Popen(
        [sys.executable, "-c", f"import time; time.sleep({seconds})"], pass_fds=(lock.fd,)
    )
    os.pwrite(lock.fd, f"{launcher}\n".encode().ljust(16), 0)
    lock.release()
    return child


def test_a_dir_held_by_the_children_of_a_dead_launcher_is_waited_for(tmp_path: Path) -> None:
    """The launcher is gone (its PID no longer runs) and its children are ending: a `--resume` right away
    waits for them instead of failing, and says who holds the dir when they do not end."""
    dead = subprocess.Popen(["true"])
    dead.wait()
    child = _held_by(tmp_path, dead.pid, 1.0)
    try:
        lock_run_dir(tmp_path, wait_s=60).release()  # a hang guard: the child ends after 1 s
    finally:
        child.kill()
        child.wait()
    child = _held_by(tmp_path, dead.pid, 60.0)
    try:
        with pytest.raises(
            UsageError, match=f"held by the processes of a `hetpipe train` that died \\(pid {dead.pid}"
        ):
            lock_run_dir(tmp_path, wait_s=0.5)
    finally:
        child.kill()
        child.wait()
