"""The time-to-accuracy tasks (a shipped cluster config, the `--set` overrides that make its model, the
target) and the learning-rate sweep every system gets: samples to the target in the single-process reference
(launch/bench/staleness.py's run_setting: no timing, so no noise from a busy machine), per learning rate, for
the setting that trains like the system (hetpipe.core.planning.convergence.setting_of: DDP over G GPUs and a
flushed pipeline of G microbatches train like gradient accumulation over G minibatches)."""

from __future__ import annotations

import hashlib
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import goals  # noqa: E402  (launch/bench is not a package)
import staleness  # noqa: E402

from hetpipe.core.config.overrides import apply_overrides  # noqa: E402
from hetpipe.core.config.schema import ClusterConfig  # noqa: E402
from hetpipe.core.planning.convergence import Setting, canonical  # noqa: E402

__all__ = ["TASKS", "Task", "sweep_lr"]

CLUSTERS = Path(__file__).resolve().parents[1] / "clusters"


@dataclass(frozen=True)
class Task:
    """One benchmark task: `config` with `overrides`, the target, the learning rates swept (in order; the grid
    the task's calibration used, so that its sweeps are reused), the training time each timed run gets, the
    reference budget of the sweep (samples) and how often it scores; `hetpipe`: overrides for hetpipe's runs
    only (its schedule, aggregation, mitigation: what the staleness study found best); `batches`: the batches
    per GPU every system chooses among (empty: the config's alone); `pretrain`: a fine-tuning task's
    pretraining (pretrained())."""

    name: str
    config: Path
    overrides: tuple[str, ...]
    target: float
    lrs: tuple[float, ...]
    max_seconds: float
    sweep_samples: int
    score_every: int
    note: str
    hetpipe: tuple[str, ...] = ()
    batches: tuple[int, ...] = ()
    # fine-tuning: the overrides of a run that trains the weights every system then starts from ([model] init)
    pretrain: tuple[str, ...] = ()
    # fine-tuning: the settings (staleness.py's) of the calibration made for it first, which hetpipe's planner
    # then ranks by (the shipped calibrations measure training from scratch)
    calibrate: tuple[str, ...] = ()


TASKS = {
    "mnist": Task(
        "mnist",
        CLUSTERS / "bench.toml",
        (
            'model.name="mnist-cnn"',
            "model.options={ channels = [16, 32], hidden = 64 }",
            "train.batch_size=128",
            'train.optimizer="adam"',
            "train.lr=0.002",
        ),
        0.97,
        (0.008, 0.004, 0.016, 0.002),
        90.0,
        100_000,
        1024,
        "MNIST-5k, a CNN of 16 and 32 channels (every GPU holds it at batch 128, so DDP over the GPUs that "
        "fit is DDP over all six), Adam; target 97% test accuracy (near this data's ceiling: sequential Adam "
        "needs 11k to 58k samples over 3 seeds), ranked by the calibration to 97% "
        "(hetpipe/calibrations/*-to0.97.json)",
    ),
    "shakespeare": Task(
        "shakespeare",
        CLUSTERS / "bench-shakespeare.toml",
        ("train.eval_samples=2048",),
        2.0,
        (0.002, 0.004, 0.008),
        330.0,
        100_000,
        4096,
        "char-level GPT (4 blocks, 64 wide, 32 characters of context), Adam; target validation loss 2.0 nats "
        "(unigram 3.29), scored on 2048 held-out windows; each system at batch 64 or 16 per GPU, its own "
        "choice",
        batches=(64, 16),
    ),
    "resnet": Task(
        "resnet",
        CLUSTERS / "bench.toml",
        (
            'model.name="resnet18"',
            "model.options={ width = 8, in_channels = 1, num_classes = 10, image_size = 28 }",
            "train.batch_size=64",
            'train.optimizer="adam"',
            "train.lr=0.002",
        ),
        0.95,
        (0.002, 0.004, 0.008),
        180.0,
        60_000,
        1024,
        "MNIST-5k, ResNet-18 with BatchNorm at width 8 (0.18 M weights), Adam; BatchNorm statistics averaged "
        "at the PS; target 95% test accuracy",
    ),
}


_FINE_TUNE = (
    'model.name="mnist-cnn"',
    "model.options={ channels = [16, 32], hidden = 64 }",
    "train.batch_size=128",
    'train.optimizer="adam"',
    "train.lr=0.002",
    "data.options={ classes = [5, 6, 7, 8, 9] }",
)
_PRETRAIN = (
    "data.options={ classes = [0, 1, 2, 3, 4] }",
    "train.waves=120",
    "train.freeze=[]",
    "train.autofreeze_every=0",
    "seed=100",
)
_FINE_TUNE_NOTE = (
    "MNIST-5k digits 5-9, the mnist task's CNN and Adam, fine-tuned from its training on digits 0-4 (120 "
    "waves of one VW in the single-process reference, made first: model.init); target 95% test accuracy "
    "on 5-9"
)


# what hetpipe's planner chooses among on bench.toml, at the fine-tuning tasks' aggregation (mean), and the
# settings that train like the peers (DDP over 2 and over 6 GPUs)
_CALIBRATE = (
    "1x1/1",
    "1x2/1:1f1b-flush",
    "1x6/1:1f1b-flush",
    "1x2/2",
    "2x1/1:wsp:mean",
    "2x2/1:pipedream:mean",
    "2x4/1:pipedream:mean",
    "2x1/1:wsp:mean:none:D1",
    "4x1/1:wsp:mean",
)


def _fine_tune(name: str, frozen: tuple[str, ...], note: str) -> Task:
    """A fine-tuning task: _FINE_TUNE (and `frozen`'s freeze points) from _PRETRAIN's weights, hetpipe at
    aggregation mean."""
    return Task(
        name,
        CLUSTERS / "bench.toml",
        (*_FINE_TUNE, *frozen),
        0.95,
        (0.004, 0.002, 0.008),
        60.0,
        60_000,
        512,
        f"{_FINE_TUNE_NOTE}; {note}",
        # the frozen layers' outputs kept by sample (AutoCache; `finetune` freezes nothing: no effect)
        hetpipe=('ps.aggregation="mean"', "train.freeze_cache_mib=256"),
        pretrain=_PRETRAIN,
        calibrate=_CALIBRATE,
    )


TASKS["finetune"] = _fine_tune("finetune", (), "every layer trains")
TASKS["finetune-freeze"] = _fine_tune(
    "finetune-freeze",
    ("train.freeze=[[1, 4]]",),
    "both convolutions frozen (hetpipe from wave 1, the peers from their first step)",
)
TASKS["finetune-autofreeze"] = _fine_tune(
    "finetune-autofreeze",
    ("train.autofreeze_every=5",),
    "hetpipe freezes by the adaptive rule, deciding every 5 waves (docs/wsp.md#adaptive-freezing); the peers "
    "have no such rule and train every layer",
)


def pretrained(task: Task, settings: Sequence[str], work_dir: Path) -> Path:
    """A fine-tuning task's starting weights: its config with its pretraining overrides trained by one
    process (the single-process reference, one VW of the whole model: no timing, nothing to emulate), the
    same for every seed and system, made once per work dir and overrides; returns the state's file."""
    import torch

    from hetpipe.compute.build import dataset_of, model_of
    from hetpipe.compute.evaluate import evaluate
    from hetpipe.compute.reference import run_reference
    from hetpipe.core.config.files import load_config
    from hetpipe.core.config.serialize import config_toml

    config = apply_overrides(load_config(task.config), [*task.overrides, *settings, *task.pretrain])
    key = hashlib.sha256(config_toml(config).encode()).hexdigest()[:12]  # one per pretraining config
    path = work_dir / "pretrained" / f"{key}.pt"
    if not path.exists():
        print(f"pretraining into {path} ({', '.join(task.pretrain)})", flush=True)
        spec = model_of(config)
        work = [(config.wsp.nm, config.train.batch_size)]
        weights = run_reference(config, [(spec.num_layers,)], work=work).ps_weights
        state = {k: torch.from_numpy(v.copy()) for k, v in weights.items()}
        scores = evaluate(spec, state, dataset_of(config), max_samples=0)
        print(f"  pretrained: {scores}", flush=True)
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(state, path)
    return path.resolve()


def calibrated(
    task: Task, config: ClusterConfig, goal: goals.Goal, work_dir: Path, seeds: str = "0,1,2"
) -> Path:
    """A fine-tuning task's calibration (task.calibrate's settings, `seeds`, the task's learning rates and
    sweep budget) for `config` (its overrides and model.init applied) to `goal`: launch/bench/staleness.py
    run once per work dir, config and settings; returns the calibration's file."""
    import subprocess

    from hetpipe.core.config.serialize import config_toml

    text = "\n".join(
        [config_toml(config), ",".join(task.calibrate), seeds, repr(task.lrs), f"{goal.target:g}"]
    )
    key = hashlib.sha256(text.encode()).hexdigest()[:12]
    path = work_dir / "calibrations" / f"{task.name}-{key}.json"
    if path.is_file():
        return path.resolve()
    path.parent.mkdir(parents=True, exist_ok=True)
    config_file = path.with_suffix(".toml")
    config_file.write_text(config_toml(config))
    command = [
        sys.executable,
        str(Path(__file__).resolve().parent / "staleness.py"),
        "--config",
        str(config_file),
        "--target",
        f"{goal.target:g}",
        "--seeds",
        seeds,
        "--lrs",
        ",".join(f"{v:g}" for v in task.lrs),
        "--samples",
        str(task.sweep_samples),
        "--score-every",
        str(task.score_every),
        "--settings",
        ",".join(task.calibrate),
        "--jobs",
        "2",
        "--calibrate",
        str(path),
    ]
    print(f"calibrating {task.name} (fine-tuning) into {path}: {len(task.calibrate)} settings", flush=True)
    subprocess.run(command, check=True)
    return path.resolve()


def sweep_lr(
    config: ClusterConfig,
    setting: Setting,
    lrs: Sequence[float],
    goal: goals.Goal,
    samples: int,
    score_every: int,
    seed: int = 0,
) -> tuple[float, dict[float, float | None]]:
    """(the learning rate with the fewest samples to the goal, samples per learning rate), by staleness.py's
    rule: the rates in the order given, each run stopped once it has trained as many samples as the best so
    far needed (it cannot win: None), ties to the first listed."""
    found: dict[float, float | None] = {}
    best_lr, best_n = lrs[0], math.inf
    for lr in lrs:
        cfg = apply_overrides(config, [f"train.lr={lr}", f"seed={seed}"])
        limit = samples if math.isinf(best_n) else int(min(samples, best_n))
        found[lr] = goals.first_reaching(
            staleness.run_setting(cfg, setting, samples, score_every, goal, stop_at=limit), 0.0, goal
        )
        if found[lr] is not None and found[lr] < best_n:
            best_lr, best_n = lr, found[lr]
    return best_lr, found


def sweep_key(setting: Setting) -> str:
    """Settings that train the same weights share one sweep."""
    return canonical(setting).label
