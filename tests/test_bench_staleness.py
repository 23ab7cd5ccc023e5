"""launch/bench/staleness.py: settings, refused splits, and scores along a reference run on a tiny model."""

from __future__ import annotations

import sys
from pathlib import Path

import click
import pytest

from hetpipe.core.config import load_config
from hetpipe.core.errors import UsageError

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "launch" / "bench"))
import staleness  # noqa: E402  (launch/bench is not a package)

_TINY = """name = "staleness-test"
seed = 3
[gpu_types.g]
speed = 1.0
memory_gib = 1.0
[[nodes]]
name = "n0"
gpus = ["g", "g", "g", "g"]
[model]
name = "mlp"
options = { image_size = 8, hidden = [16, 16] }
[data]
name = "synthetic"
options = { input_shape = [1, 8, 8], num_classes = 4, n = 512 }
[train]
batch_size = 8
optimizer = "sgd"
lr = 0.05
"""


def test_settings_parse_and_reject_with_the_form_to_use() -> None:
    assert staleness.parse_settings("2x4/3, 1x1/1") == [(2, 4, 3), (1, 1, 1)]
    for bad in ("2x4", "0x1/1", "2*4/3"):
        with pytest.raises(click.BadParameter, match="VWSxNM/STAGES"):
            staleness.parse_settings(bad)


def test_a_setting_with_more_stages_than_layers_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "tiny.toml"
    path.write_text(_TINY)
    with pytest.raises(UsageError, match="between 1 and 4 stages"):
        staleness.run_setting(load_config(path), vws=1, nm=1, stages=5, staleness=0, samples=64, scores=1)


def test_scores_follow_the_global_versions_with_their_sample_counts(tmp_path: Path) -> None:
    path = tmp_path / "tiny.toml"
    path.write_text(_TINY)
    config = load_config(path)
    curve = staleness.run_setting(config, vws=2, nm=2, stages=2, staleness=0, samples=640, scores=4)
    per_wave = 2 * 2 * 8
    assert [c["t"] for c in curve] == [v * per_wave for v in (5, 10, 15, 20)]  # 20 waves, every 5th version
    assert all(0.0 <= c["test_accuracy"] <= 1.0 and c["test_loss"] > 0 for c in curve)
    one = staleness.run_setting(config, vws=1, nm=1, stages=1, staleness=0, samples=640, scores=4)
    assert one[-1]["t"] == 640 and one != curve  # same samples, other staleness, other weights
