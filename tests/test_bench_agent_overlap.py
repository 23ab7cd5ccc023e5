"""launch/bench/ps_agent_overlap.py runs its three peers side by side and reports each against no pushes."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "launch" / "bench"))
import ps_agent_overlap  # noqa: E402  (launch/bench is not a package)

pytestmark = pytest.mark.slow


def test_smoke_run_measures_every_peer(tmp_path: Path):
    out = tmp_path / "overlap.json"
    result = CliRunner().invoke(
        ps_agent_overlap.main,
        ["--blocks", "1", "--minibatches", "4", "--every", "2", "--no-pin", "--out", str(out)],
    )
    assert result.exit_code == 0, result.output
    got = json.loads(out.read_text())
    assert [r["peer"] for r in got["rows"]] == ["none", "thread", "process"]
    assert got["push_mb"] == 101.5 and not got["pinned"]
    for row in got["rows"]:
        assert row["ms_per_minibatch"] > 0 and row["min"] <= row["ms_per_minibatch"] <= row["max"]
    assert got["rows"][0]["x_none"] == 1.0
