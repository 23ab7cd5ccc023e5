"""Emulation fidelity: the CPU time of one whole training step of a config's model, run back to back and run
as an emulated GPU runs it (a sleep of slowdown - 1 times the step after each), against the per-layer profile
the planner predicts from (docs/emulation.md#cpu-time-dilation).

Every emulated device, hetpipe's stages and the benchmark peers alike, is dilated on its thread's CPU time, so
whatever makes a step cost more CPU time than the profile says slows them all alike; this says by how much,
for one model: the profile's sum (forward + backward with the optimizer step, layer by layer), the whole step
back to back (what the layer-by-layer profile leaves out or adds), and the whole step with the emulation's
sleeps between steps (cold caches and clocks after each sleep). Steps alternate between the two ways in
rounds, so a drift of the machine's speed hits both.

    python launch/bench/dilation.py [--config launch/clusters/bench-shakespeare.toml] [--set K=V ...]
        [--steps 40] [--rounds 4] [--slowdown S] [--cached-profile] [--out dilation.json]
"""

from __future__ import annotations

import json
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import click
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import peers  # noqa: E402  (launch/bench is not a package)
import throughput  # noqa: E402

from hetpipe.compute.build import dataset_of, model_of  # noqa: E402
from hetpipe.compute.optim import make_optimizer  # noqa: E402
from hetpipe.core.config.files import load_config  # noqa: E402
from hetpipe.core.config.overrides import apply_overrides  # noqa: E402
from hetpipe.core.config.schema import ClusterConfig  # noqa: E402
from hetpipe.core.hardware.emulate import cpu_cores, device_dilator, gpu_speeds, slowdowns  # noqa: E402
from hetpipe.models import build_stage  # noqa: E402

WARMUP = 10  # steps before any is timed


def step_cpu_times(config: ClusterConfig, steps: int, rounds: int, slowdown: float) -> dict[str, list[float]]:
    """CPU seconds of each timed step of the whole model at the config's batch: "back_to_back" and "dilated"
    (each step run in the emulation's own Dilator, which sleeps it up to slowdown x its CPU time), `steps` of
    each per round, alternating."""
    torch.set_num_threads(1)
    spec, data = model_of(config), dataset_of(config)
    t = config.train
    model = build_stage(spec, 0, spec.num_layers, "cpu")
    optimizer = make_optimizer(list(model.parameters()), t.optimizer, t.lr, t.momentum, t.weight_decay)
    x, y = data.train.x[: t.batch_size], data.train.y[: t.batch_size]

    def step() -> None:
        model.zero_grad(set_to_none=True)
        spec.loss(model(x), y).backward()
        optimizer.step()

    def back_to_back() -> float:
        began = time.thread_time()
        step()
        return time.thread_time() - began

    dilator = device_dilator(slowdown)  # what every emulated device on the CPU runs its blocks in

    def dilated() -> float:
        with dilator.compute("step"):
            step()
        assert dilator.last is not None
        return dilator.last.compute_s

    for _ in range(WARMUP):
        step()
    out: dict[str, list[float]] = {"back_to_back": [], "dilated": []}
    for _ in range(rounds):
        out["back_to_back"] += [back_to_back() for _ in range(steps)]
        out["dilated"] += [dilated() for _ in range(steps)]
    return out


def report(profile_s: float, times: dict[str, list[float]], slowdown: float) -> dict[str, Any]:
    """Medians in ms and the ratios the planner's emulated rate misses by: back_to_back / profile (whole step
    against layer by layer), dilated / back_to_back (the sleeps), dilated / profile (both)."""
    back, dilated = statistics.median(times["back_to_back"]), statistics.median(times["dilated"])
    return {
        "slowdown": slowdown,
        "profile_ms": round(1000 * profile_s, 2),
        "back_to_back_ms": round(1000 * back, 2),
        "dilated_ms": round(1000 * dilated, 2),
        "whole_over_profile": round(back / profile_s, 3),
        "dilated_over_whole": round(dilated / back, 3),
        "dilated_over_profile": round(dilated / profile_s, 3),
        "steps": {k: len(v) for k, v in times.items()},
    }


@click.command()
@click.option(
    "--config",
    "config_path",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    default=throughput.DEFAULT_CONFIG,
    show_default=True,
)
@click.option(
    "--set", "overrides", multiple=True, help="Config override SECTION.KEY=VALUE (TOML value), repeatable."
)
@click.option("--steps", default=40, show_default=True, help="Timed steps of each kind per round.")
@click.option(
    "--rounds", default=4, show_default=True, help="Rounds, each back-to-back steps then dilated ones."
)
@click.option(
    "--slowdown",
    type=float,
    default=None,
    help="Dilation to emulate (default: the config's fastest GPU type's, i.e. its time_scale).",
)
@click.option(
    "--profile-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=Path("runs/bench/profiles"),
    show_default=True,
    help="Where the per-layer CPU profile is cached.",
)
@click.option(
    "--cached-profile",
    is_flag=True,
    help="Use the cached profile instead of measuring it again first "
    "(this VM's speed drifts 20-30% between runs: a profile from another time compares poorly).",
)
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), default=None, help="Write JSON here.")
def main(
    config_path: Path,
    overrides: tuple[str, ...],
    steps: int,
    rounds: int,
    slowdown: float | None,
    profile_dir: Path,
    cached_profile: bool,
    out: Path | None,
) -> None:
    torch.set_num_threads(1)
    config = apply_overrides(load_config(config_path), overrides)
    if slowdown is None:
        slowdown = min(slowdowns(gpu_speeds(config), cpu_cores(), config.emulation.time_scale).values())
    profile = peers.model_profile(config, config.train.batch_size, profile_dir, refresh=not cached_profile)
    found = report(profile.step_s, step_cpu_times(config, steps, rounds, slowdown), slowdown)
    print(
        f"{config.name}: {config.model.name} at batch {config.train.batch_size}, {config.train.optimizer}, "
        "one thread; CPU time of one step, median: "
        f"profile (layer by layer) {found['profile_ms']} ms, whole step back to back "
        f"{found['back_to_back_ms']} ms ({found['whole_over_profile']:.2f}x), dilated at {slowdown:g} "
        f"{found['dilated_ms']} ms ({found['dilated_over_whole']:.2f}x that; "
        f"{found['dilated_over_profile']:.2f}x the profile)"
    )
    if out is not None:
        command = "python launch/bench/dilation.py " + shlex.join(sys.argv[1:])
        out.write_text(
            json.dumps(
                {
                    "command": command,
                    "config": str(config_path),
                    "model": config.model.name,
                    "batch": config.train.batch_size,
                    "meta": peers.env_note(),
                    **found,
                },
                indent=1,
            )
        )
        print(f"wrote {out}")


if __name__ == "__main__":
    main()
