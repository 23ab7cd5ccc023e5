"""launch/bench reports: the time-to-target rule for accuracy and loss, the verdict lines, and every PNG figure."""

from __future__ import annotations

import sys
from pathlib import Path

import click
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "launch" / "bench"))
import plots  # noqa: E402  (launch/bench is not a package)
import time_to_accuracy as tta  # noqa: E402

_PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _scores(metric: str, values: list[float]) -> list[dict[str, float]]:
    return [{"t": 100.0 + i, metric: v} for i, v in enumerate(values)]


def test_accuracy_goal_takes_the_first_score_at_or_above_target() -> None:
    goal = tta.goal_for("classification", None)
    assert (goal.metric, goal.target, goal.label) == ("test_accuracy", 0.9, "90%")
    scores = _scores("test_accuracy", [0.5, 0.91, 0.89, 0.95])
    assert tta.first_reaching(scores, 100.0, goal) == 1.0
    assert goal.best(scores) == 0.95
    assert tta.first_reaching(_scores("test_accuracy", [0.5, 0.89]), 100.0, goal) is None


def test_loss_goal_takes_the_first_score_at_or_below_target() -> None:
    goal = tta.goal_for("language", 2.0)
    assert (goal.metric, goal.label) == ("val_loss", "loss 2")
    scores = _scores("val_loss", [3.3, 2.4, 2.0, 1.9])
    assert tta.first_reaching(scores, 99.5, goal) == 2.5
    assert goal.best(scores) == 1.9


def test_a_language_model_needs_an_explicit_target() -> None:
    with pytest.raises(click.UsageError, match="--target"):
        tta.goal_for("language", None)


def test_row_and_verdicts_compare_fastest_runs_and_say_who_never_got_there() -> None:
    goal = tta.goal_for("classification", 0.9)
    hp = [tta.row("hetpipe D=0", "a, lr 0.02", 0.0, [{"t": 10.0, "test_accuracy": 0.5}, {"t": 30.0, "test_accuracy": 0.92}],
                  goal, 1024)]
    fit = tta.row("ddp-fit", "6 GPUs", 0.0, [{"t": 60.0, "test_accuracy": 0.8}], goal, 512)
    fast = tta.row("ddp-speed>=14.9", "2 GPUs", 0.0, [{"t": 20.0, "test_accuracy": 0.9}], goal, 512)
    assert hp[0]["seconds_to_target"] == 30.0 and hp[0]["curve"][1] == {"s": 30.0, "test_accuracy": 0.92}
    assert fit["seconds_to_target"] is None and fit["trained_s"] == 60.0
    lines = tta.verdicts([*hp, fit, fast], goal)
    assert lines == ["hetpipe / ddp-fit wall time to 90%: < 0.50 (ddp-fit did not get there in 60 s)",
                     "hetpipe / ddp-speed>=14.9 wall time to 90%: 1.50"]
    assert "ddp-fit" in tta.table([*hp, fit], goal) and "loss" not in tta.table([*hp, fit], goal)


def test_every_figure_is_a_png_or_says_matplotlib_is_missing(tmp_path: Path) -> None:
    stats = {"median": 100.0, "min": 90.0, "max": 120.0}
    curve_rows = [{"label": "hetpipe Nm=4 D=0, lr 0.02", "curve": [{"s": 1.0, "val_loss": 3.0},
                                                                           {"s": 2.0, "val_loss": 2.5}]}]
    results = {
        "throughput": plots.throughput_bars([{"system": "hetpipe", "samples_per_s": stats},
                                             {"system": "ddp-fit", "samples_per_s": stats}], 150.0,
                                            tmp_path / "throughput.png", "t"),
        "curves": plots.metric_curves(curve_rows, "val_loss", 2.0, tmp_path / "curves.png"),
        "bars": plots.paired_bars(["10 MB", "100 MB"], {"ps": [1.0, 2.0], "raw": [1.5, 2.5]}, "GB/s", "t",
                                  tmp_path / "sub" / "bars.png"),
    }
    if not plots.available():
        assert set(results.values()) == {plots.MISSING}
        assert not list(tmp_path.rglob("*.png"))
        return
    for name, line in results.items():
        path = tmp_path / ("sub/bars.png" if name == "bars" else f"{name}.png")
        assert line == f"wrote {path}"
        assert path.read_bytes()[:8] == _PNG_MAGIC and path.stat().st_size > 5000
