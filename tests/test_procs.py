"""Tests of hetpipe.core.runs.procs start-up: how children start, the fork server's state, process start
times."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from hetpipe.core.errors import UsageError
from hetpipe.core.runs.procs import process_started_at, start_method

HAS_PROC = Path("/proc/self/stat").exists()


def test_start_method_from_the_environment(monkeypatch) -> None:
    monkeypatch.setenv("HETPIPE_START_METHOD", "spawn")
    assert start_method() == "spawn"
    monkeypatch.setenv("HETPIPE_START_METHOD", "fork")
    with pytest.raises(UsageError, match="use forkserver or spawn"):
        start_method()
    monkeypatch.delenv("HETPIPE_START_METHOD")
    assert start_method() in ("forkserver", "spawn")


@pytest.mark.skipif(not HAS_PROC, reason="needs Linux /proc for process start times")
def test_process_started_at_reads_a_childs_start() -> None:
    before = time.time()
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(5)"])
    try:
        after = time.time()
        started = process_started_at(child.pid)
    finally:
        child.kill()
        child.wait()
    assert started is not None and before - 0.05 <= started <= after + 0.05  # /proc counts 10 ms ticks
    assert process_started_at(2**22 + 12345) is None  # no such process


CHILDREN = """
import json, os, sys
from hetpipe.core.runs.procs import ChildGroup, child_entered_at, warm_forkserver


def report(queue):
    parent = os.getppid()
    queue.put({"torch_loaded": "torch" in sys.modules, "threads": len(os.listdir("/proc/self/task")),
               "parent_threads": len(os.listdir(f"/proc/{parent}/task")), \
"entered": child_entered_at() is not None})


if __name__ == "__main__":
    warm_forkserver(["torch", "numpy"])
    group = ChildGroup()
    queue = group.ctx.Queue()
    for i in range(2):
        group.start(f"c{i}", report, queue)
    group.wait()
    print(json.dumps([queue.get(timeout=30) for _ in range(2)]))
"""


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.skipif(
    not HAS_PROC or start_method() != "forkserver", reason="needs a fork server and Linux /proc"
)
def test_children_fork_from_a_server_holding_no_threads(tmp_path: Path) -> None:
    """The fork server imported torch and numpy and started no thread (not even OpenBLAS's): what it forks is
    one thread with torch already loaded, to which the child adds one, the watch on its launcher
    (procs._watch_launcher)."""
    script = tmp_path / "children.py"
    script.write_text(textwrap.dedent(CHILDREN))
    env = {k: v for k, v in os.environ.items() if k not in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS")}
    result = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=100, env=env, cwd=tmp_path
    )
    assert result.returncode == 0, result.stderr
    reports = json.loads(result.stdout.strip().splitlines()[-1])
    assert reports == [{"torch_loaded": True, "threads": 2, "parent_threads": 1, "entered": True}] * 2
