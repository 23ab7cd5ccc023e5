"""The memory model against the peak a stage really reaches (launch/bench/memory.py): within 10% on three
models and three schedules."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "launch" / "bench"))
import memory  # noqa: E402

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc mallinfo2"),
]


@pytest.mark.parametrize(
    "case", [memory.CASES[0], memory.CASES[3], memory.CASES[4]], ids=lambda c: f"{c.model}-{c.schedule}"
)
def test_predicted_peak_within_ten_percent_of_measured(case: memory.Case) -> None:
    row = memory.measure(case)
    assert row["measured"] > 10 * 2**20  # a real workload, not noise
    assert abs(row["error"]) <= 0.10, row
