"""Trainer controls study: samples to the MNIST and char-GPT targets with a constant learning rate, with
linear warm-up + cosine decay, and with gradient clipping (docs/convergence.md#trainer-controls).

Measured in the single-process reference, as launch/bench/staleness.py measures (it runs each setting: the
first seed at every learning rate of the task's grid, the other seeds at the best; no timing). A control is a
set of `[train]` overrides applied to the task's config (launch/bench/tta_tasks.py's mnist and shakespeare):

  constant  lr_schedule = "constant" (the config's)
  cosine    lr_schedule = "cosine", warmup_steps = --warmup-waves (a step is a wave: at Nm 1, one minibatch),
            total_steps = 0 (the run's waves: the whole sample budget, staleness.run_setting), min_lr = 0
  clip      clip_grad_norm = --clip (per stage; one stage here: the whole model)

The table gives each control's median samples to the target (min-max over seeds) at its best learning rate,
and the median over the constant rate's.

    python launch/bench/trainer_controls.py [--task mnist,shakespeare] [--settings 1x1/1,2x1/1:wsp:mean]
        [--seeds 0,1,2] [--warmup-waves 20] [--clip 1.0] [--jobs 2] [--out controls.json]
        [--table controls.md]
"""

from __future__ import annotations

import json
import math
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import click
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import goals  # noqa: E402  (launch/bench is not a package)
import staleness  # noqa: E402
import tta_tasks  # noqa: E402

from hetpipe.compute.build import model_of  # noqa: E402
from hetpipe.core.config.files import load_config  # noqa: E402
from hetpipe.core.config.overrides import apply_overrides  # noqa: E402
from hetpipe.core.config.serialize import pack_config  # noqa: E402
from hetpipe.core.planning.convergence import canonical, parse_settings  # noqa: E402

CONTROLS = ("constant", "cosine", "clip")


def control_overrides(control: str, warmup_waves: int, clip: float) -> list[str]:
    """The `[train]` overrides of one control."""
    if control == "cosine":
        return [
            'train.lr_schedule="cosine"',
            f"train.warmup_steps={warmup_waves}",
            "train.total_steps=0",
            "train.min_lr=0",
        ]
    if control == "clip":
        return [f"train.clip_grad_norm={clip}"]
    return ['train.lr_schedule="constant"']


def _median(values: list[float | None]) -> float | None:
    """The median counting a seed that never got there as infinite (None once half did not)."""
    m = statistics.median(math.inf if v is None else v for v in values)
    return None if math.isinf(m) else m


def markdown(rows: list[dict[str, Any]]) -> str:
    """One line per task, setting and control: median samples to target (min-max), the lr, x constant."""
    lines = [
        "| task (target) | setting | control | lr | samples to target, median (min-max) | x constant |",
        "|---|---|---|---:|---:|---:|",
    ]
    for r in rows:
        base = next(
            b["median"]
            for b in rows
            if (b["task"], b["setting"], b["control"]) == (r["task"], r["setting"], "constant")
        )
        reached = [s for s in r["samples"] if s is not None]
        spread = f" ({min(reached):,.0f}-{max(reached):,.0f})" if reached else ""
        median = "not reached" if r["median"] is None else f"{r['median']:,.0f}{spread}"
        ratio = f"{r['median'] / base:.2f}" if r["median"] and base else "-"
        lines.append(
            f"| {r['task']} ({r['target']}) | {r['setting']} | {r['control']} | {r['lr']:g} | {median} | "
            f"{ratio} |"
        )
    return "\n".join(lines)


@click.command()
@click.option("--task", "task_names", default="mnist,shakespeare", show_default=True)
@click.option(
    "--settings",
    "settings_text",
    default="1x1/1,2x1/1:wsp:mean",
    show_default=True,
    help="staleness.py settings (comma list): 1x1/1 is sequential training.",
)
@click.option(
    "--controls", default=",".join(CONTROLS), show_default=True, help="Comma list of " + ", ".join(CONTROLS)
)
@click.option("--seeds", default="0,1,2", show_default=True)
@click.option("--warmup-waves", default=20, show_default=True, help="cosine: waves of linear warm-up.")
@click.option("--clip", default=1.0, show_default=True, help="clip: train.clip_grad_norm.")
@click.option("--jobs", default=2, show_default=True, help="Runs at once, each its own process.")
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), default=None, help="Write JSON here.")
@click.option("--table", "table_path", type=click.Path(dir_okay=False, path_type=Path), default=None)
def main(
    task_names: str,
    settings_text: str,
    controls: str,
    seeds: str,
    warmup_waves: int,
    clip: float,
    jobs: int,
    out: Path | None,
    table_path: Path | None,
) -> None:
    torch.set_num_threads(1)
    seed_list = [int(s) for s in seeds.split(",")]
    wanted = controls.split(",")
    unknown = [c for c in wanted if c not in CONTROLS] + [
        t for t in task_names.split(",") if t not in ("mnist", "shakespeare")
    ]
    if unknown:
        raise click.UsageError(
            f"unknown {unknown}: controls are {', '.join(CONTROLS)}; tasks mnist, shakespeare"
        )
    began = time.time()
    jobs_list, keys = [], []
    for name in task_names.split(","):
        task = tta_tasks.TASKS[name]
        base = apply_overrides(load_config(task.config), list(task.overrides))
        goal = goals.goal_for(model_of(base).task, task.target)
        for setting in parse_settings(settings_text, staleness.defaults_of(base, 0)):
            for control in wanted:
                config = apply_overrides(base, control_overrides(control, warmup_waves, clip))
                label = canonical(setting).label
                jobs_list.append(
                    (
                        pack_config(config),
                        label,
                        seed_list,
                        list(task.lrs),
                        task.sweep_samples,
                        task.score_every,
                        goal.metric,
                        goal.target,
                        True,
                    )
                )
                keys.append((name, task.target, label, control))
    print(f"{len(jobs_list)} settings x controls, {jobs} at once", flush=True)
    results = staleness._run_all(jobs_list, jobs)
    rows = []
    for (name, target, label, control), result in zip(keys, results, strict=True):
        samples = [r["samples_to_target"] for r in result["runs"]]
        rows.append(
            {
                "task": name,
                "target": target,
                "setting": label,
                "control": control,
                "lr": result["lr"],
                "sweep": result["sweep"],
                "samples": samples,
                "median": _median(samples),
                "runs": result["runs"],
            }
        )
    text = markdown(rows)
    print()
    print(text)
    wall = round(time.time() - began, 1)
    print(f"\n{len(rows)} rows in {wall / 60:.1f} min")
    command = "python launch/bench/trainer_controls.py " + shlex.join(sys.argv[1:])
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(
            json.dumps(
                {
                    "command": command,
                    "warmup_waves": warmup_waves,
                    "clip": clip,
                    "wall_s": wall,
                    "rows": rows,
                },
                indent=1,
            )
        )
        print(f"wrote {out}")
    if table_path is not None:
        table_path.write_text(f"    {command}\n\n{text}\n")
        print(f"wrote {table_path}")


if __name__ == "__main__":
    main()
