"""launch/bench/chaos.py with a few kills, and ps_throughput.py --durable, end to end (smoke, no timings)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

BENCH = Path(__file__).resolve().parents[1] / "launch" / "bench"


def test_chaos_kills_a_shard_and_a_stage_and_the_ledger_holds(tmp_path: Path):
    out = tmp_path / "chaos.json"
    result = subprocess.run(
        [
            sys.executable,
            str(BENCH / "chaos.py"),
            "--kills",
            "2",
            "--stages",
            "--seed",
            "1",
            "--waves",
            "60",
            "--jitter",
            "0.3",
            "--set",
            "emulation.time_scale=20",  # chaos.py's 50 took 72-112 s; 20 still rejoins
            "--run-dir",
            str(tmp_path / "run"),
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(out.read_text())
    assert report["kills"] == 2 and report["kills_ps"] >= 1 and report["completed"] is True
    assert report["lost"] == report["duplicated"] == report["stray"] == 0 and report["ledger_slots"] > 0
    assert report["ps_restarts"] == report["kills_ps"]
    assert "lost 0, duplicated 0, stray 0" in result.stdout
