"""launch/bench reports: the time-to-target rule for accuracy and loss, the verdict lines, every PNG figure,
the scores time_to_accuracy.py reads from a run's PS checkpoints, and throughput.py's wave breakdown."""

from __future__ import annotations

import sys
from pathlib import Path

import click
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "launch" / "bench"))
import plots  # noqa: E402  (launch/bench is not a package)
import throughput  # noqa: E402
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


def test_rows_summary_and_table_give_medians_spread_and_who_never_got_there() -> None:
    goal = tta.goal_for("classification", 0.9)
    scores = [{"t": 10.0, "clock": 1, "test_accuracy": 0.5}, {"t": 30.0, "clock": 3, "test_accuracy": 0.92}]
    unit = {"key": "clock", "samples": 1024}
    hp = [
        tta.row(
            "mnist",
            "hetpipe",
            seed,
            goal,
            start,
            scores,
            unit,
            lr=0.002,
            setting="2 VWs a | b",
            samples_per_s=100.0,
            predicted_time_to_target_s=24.0,
        )
        for seed, start in ((0, 0.0), (1, 5.0), (2, 10.0))
    ]
    assert hp[0]["time_to_target_s"] == 30.0 and hp[0]["samples_to_target"] == 3072
    assert hp[0]["curve"][1] == {"s": 30.0, "test_accuracy": 0.92, "samples": 3072}
    ddp = [
        tta.row(
            "mnist",
            "ddp-fit",
            seed,
            goal,
            0.0,
            [{"t": 40.0, "step": 8, "test_accuracy": value}],
            {"key": "step", "samples": 512},
            lr=0.004,
            setting="6 GPUs",
            samples_per_s=90.0,
        )
        for seed, value in ((0, 0.95), (1, 0.8), (2, 0.91))
    ]
    assert ddp[1]["time_to_target_s"] is None and ddp[1]["samples_to_target"] is None
    found = tta.summary([*hp, *ddp], ["hetpipe", "ddp-fit"])
    assert found["systems"]["hetpipe"]["time_to_target_s"] == {
        "median": 25.0,
        "min": 20.0,
        "max": 30.0,
        "reached": "3/3",
    }
    assert found["systems"]["ddp-fit"]["time_to_target_s"]["median"] == 40.0  # 40, 40 and one not reached
    # the final score: each run's mean of its last scores (up to FINAL_SCORES), then the median over seeds
    assert found["systems"]["hetpipe"]["final"] == pytest.approx((0.5 + 0.92) / 2)
    assert found["systems"]["hetpipe"]["final_samples"] == 3072
    ddp_fit = found["systems"]["ddp-fit"]
    assert (ddp_fit["final"], ddp_fit["final_samples"]) == (0.91, 4096)  # step 8 x 512
    assert found["hetpipe_over_best_ddp"] == 0.625 and found["predicted_over_measured"] == 0.96
    assert tta.summary(ddp[1:2], ["ddp-fit"])["systems"]["ddp-fit"]["time_to_target_s"]["median"] is None
    text = tta.markdown(tta.tta_tasks.TASKS["mnist"], goal, found, "free")
    assert "| hetpipe | 25.0 (20.0-30.0) | 3/3 | 3,072 | 100 | 0.71 (3,072) | 0.002 | 2 VWs a / b |" in text
    assert "hetpipe / best DDP, median time to target: 0.62" in text


def test_a_fixed_learning_rate_names_its_system_and_rate_or_refuses_with_the_form() -> None:
    assert tta._fixed_lrs(("hetpipe=0.004", "ddp-fit=1e-3")) == {"hetpipe": 0.004, "ddp-fit": 0.001}
    for bad in ("hetpipe", "hetpipe=fast", "hetpipe=-1", "horovod=0.1"):
        with pytest.raises(click.UsageError, match="SYSTEM=LR"):
            tta._fixed_lrs((bad,))


def test_each_system_takes_the_batch_it_reaches_the_target_soonest_at_by_its_own_rule(capsys) -> None:
    from types import SimpleNamespace

    class FakeBench:  # the planner predicts hetpipe's time; a peer's rate comes from a short run at the batch
        def __init__(self, predicted_s: float | None, plan_rate: float, probe_rate: float) -> None:
            self.predicted_s, self.plan_rate, self.probe_rate, self.probed = (
                predicted_s,
                plan_rate,
                probe_rate,
                [],
            )

        def plan(self):
            samples = None if self.predicted_s is None else self.predicted_s * self.plan_rate
            return (
                None,
                SimpleNamespace(
                    samples_per_s=self.plan_rate, time_to_target_s=self.predicted_s, samples_to_target=samples
                ),
                None,
            )

        def probe(self, system: str, lr: float, seconds: float) -> float:
            self.probed.append((system, lr, seconds))
            return self.probe_rate

    benches = {64: FakeBench(200.0, 230.0, 160.0), 16: FakeBench(150.0, 140.0, 60.0)}
    info = {
        64: {"lr": 0.002, "reference_samples": 48_000.0},
        16: {"lr": 0.004, "reference_samples": 24_000.0},
    }
    assert tta._choose_batch("hetpipe", benches, info, 30.0) == 16  # 150 s predicted against 200
    assert info[16]["predicted_s"] == 150.0 and not benches[16].probed  # the planner's word, no run
    assert "16: 21000 samples / 140.0 samples/s = 150.0 s" in capsys.readouterr().out  # the plan's samples
    # DDP: 48,000 / 160 = 300 s at 64 against 24,000 / 60 = 400 s at 16, each probed at its own lr
    assert tta._choose_batch("ddp-fastest", benches, info, 30.0) == 64
    assert benches[16].probed == [("ddp-fastest", 0.004, 30.0)] and info[64]["predicted_s"] == 300.0
    assert "64: 48000 samples / 160.0 samples/s = 300.0 s" in capsys.readouterr().out
    # a batch that made no step in its run, or never reached the target in the sweep, is not chosen
    benches[64].probe_rate = 0.0
    assert tta._choose_batch("ddp-fit", benches, info, 30.0) == 16 and info[64]["predicted_s"] is None
    info[16]["reference_samples"] = None
    assert tta._choose_batch("ddp-fit", benches, info, 30.0) == 64  # nothing priced: the first batch listed


def test_every_figure_is_a_png_or_says_matplotlib_is_missing(tmp_path: Path) -> None:
    stats = {"median": 100.0, "min": 90.0, "max": 120.0}
    curve_rows = [
        {
            "label": "hetpipe Nm=4 D=0, lr 0.02",
            "curve": [{"s": 1.0, "val_loss": 3.0}, {"s": 2.0, "val_loss": 2.5}],
        }
    ]
    results = {
        "throughput": plots.throughput_bars(
            [{"system": "hetpipe", "samples_per_s": stats}, {"system": "ddp-fit", "samples_per_s": stats}],
            150.0,
            tmp_path / "throughput.png",
            "t",
        ),
        "curves": plots.metric_curves(curve_rows, "val_loss", 2.0, tmp_path / "curves.png"),
        "bars": plots.paired_bars(
            ["10 MB", "100 MB"],
            {"ps": [1.0, 2.0], "raw": [1.5, 2.5]},
            "GB/s",
            "t",
            tmp_path / "sub" / "bars.png",
        ),
    }
    if not plots.available():
        assert set(results.values()) == {plots.MISSING}
        assert not list(tmp_path.rglob("*.png"))
        return
    for name, line in results.items():
        path = tmp_path / ("sub/bars.png" if name == "bars" else f"{name}.png")
        assert line == f"wrote {path}"
        assert path.read_bytes()[:8] == _PNG_MAGIC and path.stat().st_size > 5000


@pytest.mark.parametrize("mode", ["exact", "latest"])
def test_checkpoint_scores_read_the_weights_of_exact_and_latest_shards(tmp_path: Path, mode: str) -> None:
    """An exact shard keeps versions W_t, a latest one running weights: both checkpoints score as the
    model."""
    import numpy as np
    import torch

    from hetpipe.compute.build import dataset_of, model_of
    from hetpipe.compute.evaluate import evaluate
    from hetpipe.core.config.files import default_config_path, load_config
    from hetpipe.core.config.overrides import apply_overrides
    from hetpipe.core.runs.checkpoint import write_checkpoint
    from hetpipe.core.wsp.state import ShardState
    from hetpipe.models import build_stage

    config = apply_overrides(load_config(default_config_path()), ["train.eval_samples=256"])
    spec = model_of(config)
    model = build_stage(spec, 0, spec.num_layers, "cpu")
    weights = {k: v.detach().numpy().copy() for k, v in model.state_dict().items() if v.is_floating_point()}
    shard = ShardState(0, mode)
    shard.register(0, 0, 1, 1, weights)
    delta = {k: np.full_like(v, 0.01) for k, v in weights.items()}
    shard.push(0, 0, 0, delta)
    meta, arrays = shard.to_state()
    write_checkpoint(
        tmp_path / "ps" / "shard-0", shard.c_global, {"run": "r", "shard": 0, "wsp": meta}, arrays, 3
    )
    (score,) = tta.checkpoint_scores(config, tmp_path)
    pushed = {k: torch.from_numpy(v + delta[k]) for k, v in weights.items()}
    expected = evaluate(spec, pushed, dataset_of(config), max_samples=256)
    assert score["clock"] == 1 and score["test_accuracy"] == expected["test_accuracy"]
    assert score["test_loss"] == expected["test_loss"]


def test_the_wave_breakdown_shows_each_stages_median_parts_and_the_rest() -> None:
    def run(compute: float, recv: float) -> dict:
        return {
            "stage_breakdown_ms": {
                "vw0-s0": {
                    "compute": compute,
                    "recv": 0.2,
                    "send": 10.0,
                    "push": 30.0,
                    "pull": 40.0,
                    "parked": 5.0,
                    "train": 1000.0,
                },
                "vw0-s1": {"compute": 300.0, "recv": recv, "gate_wait": 100.0, "train": 1000.0},
            }
        }

    text = throughput.format_breakdown([run(800.0, 500.0), run(900.0, 700.0), run(700.0, 600.0)])
    assert text.splitlines() == [
        "hetpipe: where each stage's waves went (ms per wave, median of the repeats)",
        "  vw0-s0: wave 1000 = compute 800, send 10, other 190; "
        "PS thread: push 30, pull 40 (parked at the gate 5)",
        "  vw0-s1: wave 1000 = compute 300, recv 600, gate_wait 100, other 0; "
        "PS thread: push 0, pull 0 (parked at the gate 0)",
    ]
    assert throughput.format_breakdown([]) == "hetpipe: no wave breakdown (no run)"


def test_the_throughput_bench_runs_the_plan_with_the_planners_schedule() -> None:
    """hetpipe_setup once dropped the plan's schedule, so a plan chosen as 1f1b-flush or pipedream ran as the
    config's wsp."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from test_planner import cluster, toy_profile

    config = cluster([["fast", "fast"], ["slow", "slow"]], {"fast": (2.0, 8.0), "slow": (1.0, 8.0)}, nm=4)
    setup = throughput.hetpipe_setup(config, toy_profile("cpu", 1.0), True, None, None, None)
    chosen = setup.source.split()[2]  # "planner: POLICY SCHEDULE D=d"
    assert setup.schedule == chosen and setup.label.endswith(f", {chosen}")
    override = throughput.hetpipe_config(config, setup, 3, Path("unused"))
    assert override.train.schedule == chosen
