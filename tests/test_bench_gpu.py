"""launch/bench/gpu.py on the CPU: every system of the issue's table runs and gives a complete row."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "launch" / "bench"))
import gpu  # noqa: E402  (launch/bench is not a package)

pytestmark = pytest.mark.slow

FIELDS = {"system", "model", "precision", "nm", "vws", "stages", "samples_per_s", "ratio_to_plain"}


def test_smoke_run_on_the_cpu_gives_every_row(tmp_path: Path):
    out = tmp_path / "gpu.json"
    result = CliRunner().invoke(gpu.main, ["--device", "cpu", "--quick", "--model", "char-gpt", "--precision",
                                           "fp32", "--repeats", "1", "--minibatches", "12", "--warmup", "2",
                                           "--out", str(out)])
    assert result.exit_code == 0, result.output
    rows = json.loads(out.read_text())
    assert [(r["system"], r["vws"], r["stages"], r["nm"]) for r in rows] == [
        ("plain", 1, 1, 1), ("hetpipe", 1, 1, 1), ("hetpipe", 1, 1, 4), ("hetpipe", 2, 1, 1), ("hetpipe", 1, 2, 4)]
    for row in rows:
        assert set(row) >= FIELDS and row["samples_per_s"] > 0
    for row in rows[1:]:
        assert set(row["wave_breakdown_ms"]["0"]) >= {"compute", "d2h", "push", "gate_wait", "pull", "h2d"}
        assert row["tail_s"] < 10  # `hetpipe train` returns within 10 s of its last minibatch (issue 11)
    assert abs(rows[-1]["loss_vs_one_stage"]) < 0.05
