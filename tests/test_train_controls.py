"""[train] lr_schedule, clip_grad_norm, loss and freeze at config load (hetpipe.core.config.sections) and the
losses by name (hetpipe.compute.losses)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_config import MINIMAL, load_text

from hetpipe.compute.build import model_of, vw_layouts
from hetpipe.compute.losses import loss_function
from hetpipe.core.config.schema import TrainConfig
from hetpipe.core.errors import ConfigError, UsageError
from hetpipe.core.pipeline.lr_schedule import LrSchedule

ERRORS = [
    ('lr_schedule = "cos"', "train.lr_schedule: unknown value", 'did you mean "cosine"'),
    (
        'lr_schedule = "cosine"\nwarmup_steps = 20',
        "train.warmup_steps: is 20, not below the run's 20",
        "set warmup_steps below 20",
    ),
    (
        'lr_schedule = "cosine"\ntotal_steps = 5\nwarmup_steps = 5',
        "not below total_steps = 5",
        "raise total_steps",
    ),
    (
        'lr_schedule = "cosine"\nmin_lr = 1.0',
        "train.min_lr: is 1, above lr = 0.05",
        "set min_lr to at most 0.05",
    ),
    (
        'lr_schedule = "step"',
        "train.lr_step_every: required field is missing",
        "add `lr_step_every = <int >= 1>`",
    ),
    ('lr_schedule = "step"\nlr_step_every = 0', "train.lr_step_every: must be >= 1", "under [train]"),
    ('lr_schedule = "step"\nlr_step_every = 2\nlr_step_gamma = 2.0', "each step would raise", "in (0, 1]"),
    (
        "warmup_steps = 3",
        'train.warmup_steps: is a setting of lr_schedule = "cosine"',
        'set lr_schedule = "cosine"',
    ),
    (
        'lr_schedule = "cosine"\nlr_step_every = 3',
        "train.lr_step_every: is a setting of",
        "or remove lr_step_every",
    ),
    ("clip_grad_norm = -1.0", "train.clip_grad_norm: must be >= 0", "under [train]"),
    ('loss = "mae"', 'train.loss: unknown loss "mae"', 'name your own as "package.module:function"'),
    (
        'loss = "no_such_pkg.mod:fn"',
        'train.loss: cannot use "no_such_pkg.mod:fn"',
        'cannot import "no_such_pkg.mod"',
    ),
    ('loss = "math:no_such"', "train.loss: cannot use", '"math" has no function "no_such"'),
    ('loss = "math:pi"', "train.loss: cannot use", 'write it as "package.module:function"'),
    ("freeze = 3", "train.freeze: expected an array of [wave, layers] pairs", "write `freeze = [[10, 2]"),
    ("freeze = [[2]]", "train.freeze: [0] = [2]: write [wave, layers]", "under [train]"),
    ("freeze = [[0, 1]]", "train.freeze: [0]: wave 0 is outside the run's waves 1 ... 19", "write `freeze"),
    ("freeze = [[20, 1]]", "wave 20 is outside", "write `freeze"),
    ("freeze = [[3, 0]]", "train.freeze: [0]: 0 layers frozen: freeze at least 1", "write `freeze"),
    ("freeze = [[5, 2], [3, 4]]", "[1] = [3, 4] after [5, 2]: list the points by wave", "write `freeze"),
    ("freeze = [[3, 2], [5, 2]]", "each freezing more layers than the one before", "write `freeze"),
    ('freeze = [[3, 1]]\nmitigation = "pipemare"', "predicts or corrects", 'set mitigation = "none"'),
    ('freeze = [[3, 1]]\non_nan = "skip"', "a frozen stage no longer receives", 'set on_nan = "stop"'),
]


@pytest.mark.parametrize(("text", "what", "fix"), ERRORS, ids=[e[0].split("\n")[-1] for e in ERRORS])
def test_train_control_errors_name_file_field_and_fix(tmp_path: Path, text: str, what: str, fix: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_text(tmp_path, MINIMAL + "[train]\n" + text)
    message = str(info.value)
    assert message.startswith(f"{tmp_path / 'lab.toml'}: ")
    what_line, fix_line = message.splitlines()
    assert what in what_line and fix in fix_line, message
    assert info.value.exit_code == 2


@pytest.mark.parametrize(
    "setting", ['lr_schedule = "step"\nlr_step_every = 2', "clip_grad_norm = 1.0", "freeze = [[3, 1]]"]
)
def test_controls_of_local_updates_refused_when_the_ps_runs_the_optimizer(
    tmp_path: Path, setting: str
) -> None:
    with pytest.raises(ConfigError) as info:
        load_text(tmp_path, MINIMAL + '[ps]\naggregation = "server"\n[train]\n' + setting)
    assert 'set [ps] aggregation = "sum" or "mean"' in str(info.value)


def test_defaults_and_a_full_setting_round_trip(tmp_path: Path) -> None:
    assert load_text(tmp_path, MINIMAL).train == TrainConfig(out_dir="runs/t")
    text = '[train]\nwaves = 8\nlr = 0.1\nlr_schedule = "cosine"\nwarmup_steps = 2\nmin_lr = 0.01\n'
    train = load_text(tmp_path, MINIMAL + text + 'clip_grad_norm = 1.5\nloss = "math:hypot"').train
    assert (train.clip_grad_norm, train.loss) == (1.5, "math:hypot")
    assert train.schedule_of_lr == LrSchedule("cosine", 0.1, warmup_steps=2, total=8, min_lr=0.01, every=1)
    step = load_text(tmp_path, MINIMAL + '[train]\nlr_schedule = "step"\nlr_step_every = 3').train
    assert step.schedule_of_lr == LrSchedule("step", 0.05, total=20, every=3, gamma=0.1)
    frozen = load_text(tmp_path, MINIMAL + "[train]\nfreeze = [[3, 1], [6, 2]]").train
    assert frozen.freeze == ((3, 1), (6, 2))
    assert [frozen.freeze_schedule.frozen(w) for w in (2, 3, 5, 6)] == [0, 1, 1, 2]


def test_freezing_every_layer_of_the_model_is_refused_where_the_model_is_built(tmp_path: Path) -> None:
    config = load_text(tmp_path, MINIMAL + "[train]\nfreeze = [[3, 6]]")  # the default CNN has 6 layers
    with pytest.raises(UsageError) as info:
        vw_layouts(config, model_of(config))
    message = str(info.value)
    assert "train.freeze freezes 6 layers from wave 3, but model mnist-cnn has 6" in message
    assert "freeze at most 5 (one layer stays trainable)" in message
    config = load_text(tmp_path, MINIMAL + "[train]\nfreeze = [[3, 5]]")
    assert vw_layouts(config, model_of(config))


def test_losses_by_name() -> None:
    logits = torch.tensor([[2.0, 0.0, -1.0], [0.5, 0.5, 0.0]])
    target = torch.tensor([0, 2])
    # mse against one-hot targets: ((2-1)^2 + 0 + 1 + 0.25 + 0.25 + 1) / 6 = 3.5 / 6
    assert loss_function("mse")(logits, target).item() == pytest.approx(3.5 / 6)
    # nll of log-probabilities is -mean(log p[target]); of raw values, -mean(value[target]) = -(2 + 0) / 2
    assert loss_function("nll")(logits, target).item() == -1.0
    ce = loss_function("cross_entropy")(logits, target)
    assert torch.equal(ce, torch.nn.functional.cross_entropy(logits, target))
    assert loss_function("math:hypot") is __import__("math").hypot
