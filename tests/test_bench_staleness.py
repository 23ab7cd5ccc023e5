"""launch/bench/staleness.py: refused splits, scores along a reference run on a tiny model, stopping at the
target, the calibration file."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from hetpipe.compute.build import model_of
from hetpipe.compute.reference import run_reference
from hetpipe.core.config.files import load_config
from hetpipe.core.config.overrides import apply_overrides
from hetpipe.core.errors import UsageError
from hetpipe.core.planning.convergence import Calibration, Setting, canonical, parse_setting
from hetpipe.models import even_split, param_counts

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "launch" / "bench"))
import goals  # noqa: E402
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


def test_a_setting_with_more_stages_than_layers_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "tiny.toml"
    path.write_text(_TINY)
    with pytest.raises(UsageError, match="between 1 and 4 stages"):
        staleness.run_setting(load_config(path), Setting(1, 1, 5), samples=64, score_every=64)


def test_scores_follow_the_global_versions_with_their_sample_counts(tmp_path: Path) -> None:
    path = tmp_path / "tiny.toml"
    path.write_text(_TINY)
    config = load_config(path)
    curve = staleness.run_setting(config, Setting(2, 2, 2), samples=640, score_every=160)
    per_wave = 2 * 2 * 8
    assert [c["t"] for c in curve] == [v * per_wave for v in (5, 10, 15, 20)]  # 20 waves, every 5th version
    assert all(0.0 <= c["test_accuracy"] <= 1.0 and c["test_loss"] > 0 for c in curve)
    one = staleness.run_setting(config, Setting(1, 1, 1), samples=640, score_every=160)
    assert one[-1]["t"] == 640 and one != curve  # same samples, other staleness, other weights


def test_a_run_stops_at_the_first_score_that_meets_the_goal(tmp_path: Path) -> None:
    path = tmp_path / "tiny.toml"
    path.write_text(_TINY)
    config = load_config(path)
    full = staleness.run_setting(config, Setting(1, 1, 1), samples=640, score_every=64)
    goal = goals.Goal("test_accuracy", sorted(c["test_accuracy"] for c in full)[len(full) // 2])
    stopped = staleness.run_setting(config, Setting(1, 1, 1), samples=640, score_every=64, goal=goal)
    first = next(i for i, c in enumerate(full) if goal.met(c))
    assert stopped == full[: first + 1]


def test_the_command_writes_a_calibration_the_planner_reads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "tiny.toml"
    path.write_text(_TINY)
    cal = tmp_path / "cal.json"
    args = [
        "--config",
        str(path),
        "--settings",
        "1x1/1,2x2/2:1f1b-flush:mean",
        "--seeds",
        "0,1",
        "--samples",
        "256",
        "--score-every",
        "64",
        "--target",
        "0.3",
        "--lrs",
        "0.05,0.2",
        "--set",
        'train.optimizer="sgd"',
        "--calibrate",
        str(cal),
    ]
    monkeypatch.setattr(sys, "argv", ["staleness.py", *args])
    result = CliRunner().invoke(staleness.main, args)
    assert result.exit_code == 0, result.output
    made = Calibration.load(cal)
    assert shlex.split(made.command)[2:] == args  # the recorded command pastes back into a shell as it ran
    assert [m.setting.label for m in made.measurements] == [
        "1x1/1:wsp:sum:none:D0",
        "2x2/2:1f1b-flush:mean:none:D0",
    ]
    assert made.seeds == (0, 1) and all(len(m.samples) == 2 for m in made.measurements)
    assert made.sequential is made.measurements[0] and made.lrs == (0.05, 0.2)
    for m in made.measurements:  # the first seed tried both rates; the kept one needed the fewest samples
        tried = dict(m.sweep)
        assert list(tried) == [0.05, 0.2] and tried[m.lr] == m.samples[0]
        assert all(v is None or v >= m.samples[0] for v in tried.values())


def test_calibrate_to_another_target_writes_beside_the_default_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "tiny.toml"
    path.write_text(_TINY)
    monkeypatch.setattr(staleness, "CALIBRATION_DIR", tmp_path / "cals")
    for target in ("0.3", "0.2", "0.3"):
        args = [
            "--config",
            str(path),
            "--settings",
            "1x1/1",
            "--samples",
            "128",
            "--score-every",
            "64",
            "--target",
            target,
            "--set",
            'train.optimizer="sgd"',
            "--calibrate",
        ]
        monkeypatch.setattr(sys, "argv", ["staleness.py", *args])
        result = CliRunner().invoke(staleness.main, args)
        assert result.exit_code == 0, result.output
    files = sorted((p.name for p in (tmp_path / "cals").iterdir()), key=len)
    assert len(files) == 2 and files[0].endswith("-sgd.json") and files[1].endswith("-sgd-to0.2.json")
    default, other = (Calibration.load(tmp_path / "cals" / f) for f in files)
    assert (default.target, other.target) == (0.3, 0.2)
    assert default.command.count("--target 0.3") == 2  # the third run merged into the default file


@pytest.mark.parametrize(
    "group",
    [
        ["2x2/2:wsp:server", "2x2/1:1f1b-flush:server", "2x2/2:pipedream-2bw:server", "2x2/3:gpipe:server"],
        ["2x2/2:gpipe:sum", "2x2/1:1f1b-flush:sum", "2x2/3:1f1b-flush:sum:spectrain"],
        ["1x2/2:wsp:mean:warmup:D1", "1x2/2:wsp:sum"],
        ["1x1/2:pipedream-2bw:mean:spectrain", "1x1/1:wsp:sum"],
        ["2x1/1:pipedream:sum", "2x1/1:wsp:sum"],
        ["2x2/2:pipedream:mean:pipemare:D1", "2x2/2:wsp:mean:pipemare:D1"],
        [
            "2x1/1:wsp:mean:warmup",
            "2x1/2:1f1b-flush:mean:warmup",
            "2x1/3:gpipe:mean:warmup",
            "2x1/2:pipedream:mean:warmup",
        ],
    ],
)
def test_settings_with_one_canonical_form_train_the_same_weights(tmp_path: Path, group: list[str]) -> None:
    """hetpipe.core.planning.convergence.canonical's claims, checked in the reference: one run stands for each
    group."""
    path = tmp_path / "tiny.toml"
    path.write_text(_TINY)
    config = apply_overrides(load_config(path), ['train.optimizer="adam"', "train.lr=0.01"])
    settings = [parse_setting(s) for s in group]
    assert len({canonical(s) for s in settings}) == 1
    spec = model_of(config)
    finals = []
    for s in settings:
        cfg = apply_overrides(config, [*s.overrides(), "train.waves=4"])
        split = tuple(even_split(param_counts(spec), s.stages))
        finals.append(run_reference(cfg, [split] * s.vws).ps_weights)
    for other in finals[1:]:
        assert all(np.array_equal(finals[0][k], other[k]) for k in finals[0])  # bit for bit
