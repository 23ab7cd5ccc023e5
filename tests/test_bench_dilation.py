"""launch/bench/dilation.py: the ratios it reports, and its two kinds of timed steps on a tiny model."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from test_bench_staleness import _TINY

from hetpipe.core.config.files import load_config

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "launch" / "bench"))
import dilation  # noqa: E402  (launch/bench is not a package)


def test_report_gives_the_medians_and_the_ratios_the_planner_misses_by() -> None:
    found = dilation.report(
        0.010, {"back_to_back": [0.011, 0.012, 0.013], "dilated": [0.015, 0.0135, 0.014]}, 10.0
    )
    assert (found["profile_ms"], found["back_to_back_ms"], found["dilated_ms"]) == (10.0, 12.0, 14.0)
    assert found["whole_over_profile"] == 1.2 and found["dilated_over_profile"] == 1.4
    assert found["dilated_over_whole"] == pytest.approx(14 / 12, abs=1e-3)
    assert found["steps"] == {"back_to_back": 3, "dilated": 3}


def test_both_kinds_of_steps_are_timed_in_every_round(tmp_path: Path) -> None:
    path = tmp_path / "tiny.toml"
    path.write_text(_TINY)
    times = dilation.step_cpu_times(load_config(path), steps=3, rounds=2, slowdown=2.0)
    assert {k: len(v) for k, v in times.items()} == {"back_to_back": 6, "dilated": 6}
    assert all(t > 0 for v in times.values() for t in v)
