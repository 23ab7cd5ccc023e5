"""launch/bench/fuzz.py and ps_throughput.py (--auth curve, --durable, --wire) run end to end at a tiny size
(smoke, no timings)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import zmq

pytestmark = pytest.mark.slow

BENCH = Path(__file__).resolve().parents[1] / "launch" / "bench"


def test_fuzz_bench_reports_every_count(tmp_path: Path):
    out = tmp_path / "fuzz.json"
    result = subprocess.run(
        [
            sys.executable,
            str(BENCH / "fuzz.py"),
            "--frames",
            "300",
            "--warmup",
            "100",
            "--seed",
            "3",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(out.read_text())
    assert report["messages"] == 300 and report["crashes"] == 0 and report["unanswered"] == 0
    assert report["unexpected_count"] == 0 and report["state_unchanged"] and report["good_client_served"]
    assert report["replies"] + report["dropped"] + report["parked"] - max(report["parked"] - 1, 0) == 300
    assert report["rss_before"] > 0 and report["rss_after"] > 0 and report["zmq_frames"] >= 300
    assert "messages 300 (" in result.stdout and "crashes 0" in result.stdout


def _ps_throughput(tmp_path: Path, *flags: str) -> tuple[dict, str]:
    """ps_throughput.py on one 2 MB model and one shard with `flags`: its one row and what it printed."""
    out = tmp_path / "ps.json"
    result = subprocess.run(
        [
            sys.executable,
            str(BENCH / "ps_throughput.py"),
            "--sizes",
            "2",
            "--shards",
            "1",
            *flags,
            "--out",
            str(out),
            "--plot",
            str(tmp_path / "ps.png"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    (row,) = json.loads(out.read_text())["rows"]
    return row, result.stdout


@pytest.mark.skipif(not zmq.has("curve"), reason="this libzmq has no CURVE support")
def test_ps_throughput_measures_curve_beside_plain(tmp_path: Path):
    row, printed = _ps_throughput(tmp_path, "--rounds", "1", "--auth", "curve")
    assert {"ps_gbps", "raw_gbps", "ps_curve_gbps", "ratio", "curve_ratio"} <= set(row)
    assert row["ps_curve_gbps"] > 0 and row["curve_ratio"] == pytest.approx(
        row["ps_curve_gbps"] / row["ps_gbps"], 0.01
    )
    assert "curve_gbps" in printed.splitlines()[0]


def test_ps_throughput_measures_the_durable_ps_beside_plain(tmp_path: Path):
    row, _ = _ps_throughput(tmp_path, "--rounds", "2", "--durable", "1")
    assert row["ps_durable_gbps"] > 0 and row["durable_ratio"] == pytest.approx(
        row["ps_durable_gbps"] / row["ps_gbps"], 0.01
    )


def test_ps_throughput_measures_bfloat16_on_the_wire_beside_plain(tmp_path: Path):
    """The bf16 peer's pulled weights pass the bench's own check (within bfloat16 rounding of the
    expected)."""
    row, printed = _ps_throughput(tmp_path, "--rounds", "2", "--wire", "bfloat16")
    assert row["ps_bf16_gbps"] > 0 and row["bf16_ratio"] == pytest.approx(
        row["ps_bf16_gbps"] / row["ps_gbps"], 0.01
    )
    assert "bf16_gbps" in printed.splitlines()[0]
