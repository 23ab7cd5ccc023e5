"""`hetpipe train` under the launcher faults of issue 36: a stage stopped (SIGSTOP) under on_vw_failure =
"evict", the launcher itself killed with SIGKILL (then --resume), a stage killed while its neighbour fails
on the broken connection (docs/recovery.md)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hetpipe.core.runs.metrics import read_jsonl
from hetpipe.worker.snapshot import list_snapshots

from conftest import write_config

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "launch" / "bench"))
import chaos  # noqa: E402  (launch/bench is not a package)

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs /proc"),
]


def _train(path: Path, run_dir: Path | None, *args: str, resume: bool = False) -> subprocess.Popen:
    where = ["--resume", str(run_dir)] if resume else ["--run-dir", str(run_dir)]
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "hetpipe",
            "train",
            *([] if resume else [str(path)]),
            *where,
            "--quiet",
            *args,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _sets(settings: list[str]) -> list[str]:
    return [a for s in settings for a in ("--set", s)]


def _until(check, proc: subprocess.Popen, guard_s: float = 180) -> None:
    """Wait for `check()` while `proc` runs (a hang guard, not a timing)."""
    deadline = time.monotonic() + guard_s
    while not check():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate(timeout=30)
        time.sleep(0.05)


def _pids(run_dir: Path) -> dict[str, int]:
    try:
        return json.loads((run_dir / "pids.json").read_text())
    except (OSError, ValueError):
        return {}


def _events(run_dir: Path, name: str) -> list[dict]:
    try:
        return [e for e in read_jsonl(run_dir / "metrics.jsonl") if e.get("event") == name]
    except (OSError, ValueError):  # not there yet, or a line half written
        return []


def _state(pid: int) -> str | None:
    """The process's state letter (Z: a zombie, dead), None when there is no such process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            return stat.read().rsplit(b")", 1)[1].split()[0].decode()
    except OSError:
        return None


def _alive(pids) -> list[int]:
    return [pid for pid in pids if _state(pid) not in (None, "Z")]


def test_a_stopped_stage_under_evict_is_evicted_killed_and_the_others_finish(tmp_path: Path):
    """Issue 36 item 1: vw1-s1 stopped with SIGSTOP; the PS evicts vw 1 after hung_after_s and vw1-s0 exits 3.
    The launcher used to count the live VWs after that eviction, call vw 1 the last one live and stop the run
    (and leave the stopped stage). Now vw 0 finishes, the audit holds, and the stopped stage is killed."""
    path = write_config(
        tmp_path,
        vws=[["n0:0"], ["n0:1", "n0:2"]],
        nm=2,
        staleness=1,
        waves=14,
        emulation=True,
        time_scale=15.0,
    )
    settings = ["ps.on_vw_failure=evict", "ps.heartbeat_s=0.5", "ps.hung_after_s=3"]
    run = tmp_path / "run"
    proc = _train(path, run, "--audit", *_sets(settings))
    stopped = None
    try:
        _until(lambda: len([e for e in _events(run, "minibatch") if e.get("vw") == 1]) >= 2, proc)
        stopped = _pids(run)["vw1-s1"]
        os.kill(stopped, signal.SIGSTOP)
        _, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
        if stopped is not None and _state(stopped) not in (None, "Z"):
            os.kill(stopped, signal.SIGKILL)
    assert proc.returncode == 0, err
    summary = json.loads((run / "summary.json").read_text())
    assert summary["evicted"] == [1] and summary["audit_final_ledgers_exact"] is True, summary
    assert _state(stopped) in (None, "Z"), "the stopped stage was left behind"
    assert [e["vw"] for e in _events(run, "vw_evicted")] == [1]


def test_a_killed_launchers_children_end_and_the_run_resumes_at_once(tmp_path: Path):
    """Issue 36 item 2: `kill -9` of `hetpipe train` left its stages, PS shard, fork server and resource
    tracker running (the stages trained on to the end, the PS rotated its checkpoints away and an immediate
    --resume failed), and nothing stopped a second run in the same dir. Now a second launcher on the dir exits
    2, every process of the run ends with the launcher, and --resume at once succeeds."""
    path = write_config(
        tmp_path, vws=[["n0:0"], ["n0:1"]], nm=2, staleness=1, waves=16, emulation=True, time_scale=15.0
    )
    settings = ["checkpoint.every=2", "checkpoint.keep=2", 'checkpoint.dir="ps"']
    run = tmp_path / "run"
    first = _train(path, run, *_sets(settings))
    processes: set[int] = set()
    try:
        _until(lambda: all(max(list_snapshots(run, v, 0), default=0) >= 4 for v in range(2)), first)
        processes = chaos.descendants(first.pid)
        assert len(processes) >= 5, processes  # the fork server, the resource tracker, a shard, two stages
        for pid in [first.pid, *processes]:  # frozen, so that it cannot finish while the second one starts
            os.kill(pid, signal.SIGSTOP)
        second = subprocess.run(
            [sys.executable, "-m", "hetpipe", "train", "--resume", str(run), "--quiet"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        for pid in [*processes, first.pid]:
            os.kill(pid, signal.SIGCONT)
        assert second.returncode == 2, second.stderr
        assert f"{run} is in use by another `hetpipe train` (pid {first.pid}" in second.stderr
        os.kill(first.pid, signal.SIGKILL)
        first.communicate(timeout=30)
        deadline = time.monotonic() + 60  # a hang guard: they end within seconds
        while _alive(processes):
            assert time.monotonic() < deadline, f"left behind by the killed launcher: {_alive(processes)}"
            time.sleep(0.2)
    finally:
        for pid in _alive(processes | {first.pid}):
            os.kill(pid, signal.SIGKILL)
    assert not (run / "model.pt").exists()
    resumed = subprocess.run(
        [sys.executable, "-m", "hetpipe", "train", "--resume", str(run), "--quiet"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert resumed.returncode == 0, resumed.stderr
    assert 4 <= json.loads((run / "summary.json").read_text())["resumed_from"] < 16


def test_the_killed_stage_is_named_not_the_neighbour_it_took_down(tmp_path: Path):
    """Issue 36 item 3: after vw0-s1 was SIGKILLed, the error named vw0-s0 ("exited with code 1", gloo's
    "Connection reset by peer"), and "killed by SIGKILL" appeared nowhere, nor in metrics.jsonl."""
    path = write_config(tmp_path, vws=[["n0:0", "n0:1"]], nm=2, staleness=0, waves=40, emulation=True)
    run = tmp_path / "run"
    proc = _train(path, run)
    try:
        _until(lambda: len(_events(run, "minibatch")) >= 2, proc)
        os.kill(_pids(run)["vw0-s1"], signal.SIGKILL)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1, err
    assert "error: vw0-s1 (pid" in err and "killed by SIGKILL" in err.split("its last log lines")[0], err
    exits = _events(run, "child_exit")
    assert exits and exits[-1]["name"] == "vw0-s1" and exits[-1]["how"] == "killed by SIGKILL", exits
