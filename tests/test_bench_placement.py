"""launch/bench/placement.py: the overrides each placement runs with, and the summary of interleaved
repeats."""

from __future__ import annotations

import sys
from pathlib import Path

from hetpipe.core.config.files import load_config
from hetpipe.core.config.overrides import apply_overrides

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "launch" / "bench"))
import placement  # noqa: E402  (launch/bench is not a package)

VGG = Path(__file__).resolve().parents[1] / "launch" / "clusters" / "bench-vgg.toml"


def test_local_runs_a_shard_per_node_and_balanced_keeps_the_configs_shards() -> None:
    config = load_config(VGG)  # 3 nodes, 1 shard
    local = apply_overrides(config, placement.placement_settings(config, "local"))
    assert (local.ps.placement, local.ps.shards) == ("local", 3)
    assert placement.placement_settings(local, "balanced") == ['ps.placement="balanced"', "ps.shards=1"]
    four = apply_overrides(config, ["ps.shards=4"])
    assert placement.placement_settings(four, "balanced") == ['ps.placement="balanced"', "ps.shards=4"]


def test_summary_takes_medians_and_ratios_within_each_repeat() -> None:
    rows = [
        {"placement": p, "repeat": r, "samples_per_s": v}
        for r, (b, loc) in enumerate([(10.0, 30.0), (20.0, 30.0), (40.0, 20.0)])
        for p, v in (("balanced", b), ("local", loc))
    ]
    result = placement.summarise(rows, {"balanced": 40.0, "local": 15.0})
    assert result["placements"]["balanced"] == {
        "median": 20.0,
        "min": 10.0,
        "max": 40.0,
        "failed": 0,
        "predicted": 40.0,
        "predicted_over_measured": 2.0,
    }
    assert result["placements"]["local"]["median"] == 30.0
    # 3.0, 1.5, 0.5 within the repeats: the median is 1.5, not 30 / 20 of the medians
    assert result["ratio_local_over_balanced"] == {"median": 1.5, "min": 0.5, "max": 3.0}
    setups = {n: placement.throughput.HetpipeSetup((), 1, 0, "x", None) for n in ("balanced", "local")}
    assert "local / balanced, within each repeat: 1.5 (0.5-3.0)" in placement.format_table(result, setups)


def test_a_failed_run_is_counted_and_left_out_of_the_ratios() -> None:
    rows = [
        {"placement": "balanced", "repeat": 0, "samples_per_s": None, "error": "timed out"},
        {"placement": "local", "repeat": 0, "samples_per_s": 80.0},
        {"placement": "balanced", "repeat": 1, "samples_per_s": 20.0},
        {"placement": "local", "repeat": 1, "samples_per_s": 90.0},
    ]
    result = placement.summarise(rows, {"balanced": 70.0, "local": 90.0})
    assert (
        result["placements"]["balanced"]["failed"] == 1 and result["placements"]["balanced"]["median"] == 20.0
    )
    assert result["ratio_local_over_balanced"] == {"median": 4.5, "min": 4.5, "max": 4.5}
    setups = {n: placement.throughput.HetpipeSetup((), 1, 0, "x", None) for n in ("balanced", "local")}
    assert "20.0 (20.0-20.0), 1 failed" in placement.format_table(result, setups)
