"""Staleness study: how many samples each way of training needs to reach a target, over seeds, and the
calibration the planner reads (hetpipe.core.planning.convergence, docs/convergence.md).

Measured in the single-process reference (hetpipe.compute.reference: the runtime's arithmetic bit for bit,
with `exact` pulls), so the answer has no timing and, for one seed, no noise: it is the sample-efficiency
half of time to accuracy, the throughput half being throughput.py's.
A setting `VxN/S[:SCHEDULE][:AGGREGATION][:MITIGATION]
[:D<n>]` trains V virtual workers of S stages each (layers split as the runtime splits a VW without `layers`:
evenly by parameters) with N minibatches in flight; parts not given come from the config (D from --staleness).
The global weights are scored every --score-every samples (on train.eval_samples held-out samples); a seed
stops at the first score that meets the target (--full runs every seed to --samples, for curves). Each setting
runs once per seed (`seed = N` for data order, shards and initial weights); the median over seeds counts a
seed that never got there as infinitely many samples. With --lrs every setting gets its own learning rate: the
first seed tries each (in the order given; a run stops once it has trained as many samples as the best so far
needed, since it cannot win), the one with the fewest samples to the target is kept and the other seeds run at
it; when no rate gets the first seed there within --samples, the setting is "not reached" and the other seeds
are not run. Settings that train the same weights bit for bit (the same canonical setting,
hetpipe.core.planning.convergence.canonical: gpipe is 1f1b-flush, flushes ignore the stage count, ...) run
once.

    python launch/bench/staleness.py [--config launch/clusters/bench.toml]
        [--settings 1x1/1,2x4/3:1f1b-flush:mean]
        [--seeds 0,1,2] [--lrs 0.002,0.004,0.001] [--samples 100000] [--score-every 2048] [--target 0.9]
        [--set train.lr=0.02 ...] [--jobs 2] [--calibrate [PATH]] [--out FILE.json]

--calibrate writes (or merges into) the calibration file beside the shipped profiles,
hetpipe/calibrations/<model>-<digest>-b<batch>-<optimizer>.json, that `hetpipe plan` reads; measured with
trainer controls other than the defaults (`--set train.lr_schedule="cosine"`, clipping, a loss), the file
says which (`...-adam-cosine.json`) and `hetpipe plan` reads it for configs with those controls. Each run is
--samples long (train.waves): a cosine schedule with `total_steps = 0` decays over the whole budget, whether
the run stops at the target or, in the learning-rate sweep, once it cannot win.
"""

from __future__ import annotations

import contextlib
import json
import math
import multiprocessing
import shlex
import sys
import time
from pathlib import Path
from typing import Any

import click
import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import goals  # noqa: E402
import plots  # noqa: E402  (launch/bench is not a package)
import throughput  # noqa: E402

from hetpipe.compute.build import dataset_of, model_of  # noqa: E402
from hetpipe.compute.evaluate import evaluate  # noqa: E402
from hetpipe.compute.profiler import options_digest  # noqa: E402
from hetpipe.compute.reference import run_reference  # noqa: E402
from hetpipe.core.config.files import load_config  # noqa: E402
from hetpipe.core.config.overrides import apply_overrides  # noqa: E402
from hetpipe.core.config.schema import ClusterConfig  # noqa: E402
from hetpipe.core.config.serialize import pack_config, unpack_config  # noqa: E402
from hetpipe.core.planning.convergence import (  # noqa: E402
    Calibration,
    Measurement,
    Setting,
    calibration_name,
    canonical,
    controls_of,
    describe_fit,
    fit_model,
    parse_settings,
)
from hetpipe.models import even_split, param_counts  # noqa: E402

CALIBRATION_DIR = Path(__file__).resolve().parents[2] / "hetpipe" / "calibrations"


class _Reached(Exception):
    """Raised from the scoring callback to stop a run at the target."""


def defaults_of(config: ClusterConfig, staleness: int) -> Setting:
    """The setting parts a settings list does not name: the config's schedule, aggregation, mitigation; D
    given."""
    return Setting(1, 1, 1, config.train.schedule, config.ps.aggregation, config.train.mitigations, staleness)


def run_setting(
    config: ClusterConfig,
    setting: Setting,
    samples: int,
    score_every: int,
    goal: goals.Goal | None = None,
    stop_at: int | None = None,
) -> list[dict[str, Any]]:
    """Train one setting in the reference; the global weights' metrics about every `score_every` samples (at
    least once, at the end), each with the samples all VWs had trained by then. The run is `samples` long
    (train.waves: what `total_steps = 0` of a cosine schedule decays over); with `goal`, it stops at the first
    score that meets it, and with `stop_at` once it has trained that many samples (scored there)."""
    batch = config.train.batch_size
    per_wave = setting.vws * setting.nm * batch
    waves = max(1, math.ceil(samples / per_wave))
    last = waves if stop_at is None else min(waves, max(1, math.ceil(stop_at / per_wave)))
    cfg = apply_overrides(config, [*setting.overrides(), f"train.waves={waves}"])
    spec, data = model_of(cfg), dataset_of(cfg)
    every = max(1, round(score_every / per_wave))
    out: list[dict[str, Any]] = []

    def score(version: int, weights: dict[str, np.ndarray]) -> None:
        if version % every == 0 or version == last:
            state = {k: torch.from_numpy(v) for k, v in weights.items()}
            out.append(
                {"t": version * per_wave, **evaluate(spec, state, data, max_samples=cfg.train.eval_samples)}
            )
            if goal is not None and goal.met(out[-1]):
                raise _Reached
        if version == last:
            raise _Reached

    split = tuple(
        even_split(param_counts(spec), setting.stages)
    )  # what the runtime does for a VW without `layers`
    with contextlib.suppress(_Reached):
        run_reference(cfg, [split] * setting.vws, on_version=score)
    return out


def _seed_run(
    config: ClusterConfig,
    setting: Setting,
    seed: int,
    lr: float,
    samples: int,
    score_every: int,
    goal: goals.Goal,
    stop: bool,
    stop_at: int | None = None,
) -> dict[str, Any]:
    cfg = apply_overrides(config, [f"seed={seed}", f"train.lr={lr}"])
    began = time.time()
    curve = run_setting(cfg, setting, samples, score_every, goal if stop else None, stop_at)
    return {
        "setting": setting.label,
        "seed": seed,
        "lr": lr,
        "samples_to_target": goals.first_reaching(curve, 0.0, goal),
        "best": goal.best(curve),
        "curve": [{"s": c["t"], goal.metric: c[goal.metric]} for c in curve],
        "seconds": round(time.time() - began, 1),
    }


def measure(
    packed: bytes,
    label: str,
    seeds: list[int],
    lrs: list[float],
    samples: int,
    score_every: int,
    metric: str,
    target: float,
    stop: bool,
) -> dict[str, Any]:
    """One setting: the first seed at every learning rate (each stopped once it has trained as many samples as
    the best so far needed), the others at the best one; {setting, lr, sweep, runs}. Also a --jobs worker's
    body."""
    torch.set_num_threads(1)
    config, goal, setting = unpack_config(packed), goals.Goal(metric, target), parse_settings(label)[0]
    sweep: list[tuple[float, float | None]] = []
    first: dict[float, dict[str, Any]] = {}
    best_lr, best_n = lrs[0], math.inf
    for lr in lrs:
        limit = samples if math.isinf(best_n) else int(min(samples, best_n))
        first[lr] = _seed_run(
            config, setting, seeds[0], lr, samples, score_every, goal, stop or len(lrs) > 1, limit
        )
        n = first[lr]["samples_to_target"]
        sweep.append((lr, n))
        if len(lrs) > 1:
            print(f"  {label} seed {seeds[0]} lr {lr:g}: {'-' if n is None else int(n)} samples", flush=True)
        if n is not None and n < best_n:
            best_lr, best_n = lr, n
    if (
        math.isinf(best_n) and len(lrs) > 1
    ):  # no rate got there: keep the one that came closest, skip other seeds
        best_lr = max(lrs, key=lambda lr: first[lr]["best"] if goal.higher_is_better else -first[lr]["best"])
        runs = [first[best_lr]] + [
            {
                "setting": label,
                "seed": seed,
                "lr": best_lr,
                "samples_to_target": None,
                "best": None,
                "curve": [],
                "seconds": 0.0,
                "skipped": True,
            }
            for seed in seeds[1:]
        ]
    else:
        runs = [first[best_lr]] + [
            _seed_run(config, setting, seed, best_lr, samples, score_every, goal, stop) for seed in seeds[1:]
        ]
    for r in runs:
        _say(r)
    return {"setting": label, "lr": best_lr, "sweep": sweep, "runs": runs}


def _run_all(tasks: list[tuple], jobs: int) -> list[dict[str, Any]]:
    if jobs <= 1:
        return [measure(*task) for task in tasks]
    with multiprocessing.get_context("spawn").Pool(jobs) as pool:
        results = [pool.apply_async(measure, task) for task in tasks]
        return [r.get() for r in results]


def _say(r: dict[str, Any]) -> None:
    if r.get("skipped"):
        print(f"  {r['setting']} seed {r['seed']}: not run (the first seed got there at no rate)", flush=True)
        return
    reached = "-" if r["samples_to_target"] is None else int(r["samples_to_target"])
    print(
        f"  {r['setting']} seed {r['seed']} lr {r['lr']:g}: {reached} samples to target, best {r['best']} "
        f"({r['seconds']:.0f} s)",
        flush=True,
    )


def measurements(
    results: list[dict[str, Any]], settings: list[Setting], seeds: list[int], samples: int
) -> list[Measurement]:
    out = []
    for s in settings:
        result = next(r for r in results if r["setting"] == canonical(s).label)
        mine = {r["seed"]: r for r in result["runs"]}
        out.append(
            Measurement(
                s,
                tuple(mine[k]["samples_to_target"] for k in seeds),
                tuple(mine[k]["best"] for k in seeds),
                samples,
                result["lr"],
                tuple(result["sweep"]),
            )
        )
    return out


def table(found: list[Measurement], seeds: list[int], label: str) -> str:
    seq = next((m for m in found if m.setting.sequential and m.median), None)
    lines = [
        f"{'setting':<40} {'lr':>7} {'median':>8} {'x seq':>6}  per seed ({', '.join(map(str, seeds))}); best"
    ]
    for m in found:
        med = "-" if m.median is None else str(int(m.median))
        ratio = f"{m.median / seq.median:.2f}" if m.median and seq else "-"
        per = ", ".join("-" if s is None else str(int(s)) for s in m.samples)
        best = ", ".join("-" if b is None else f"{b:.3f}" for b in m.best)
        lines.append(f"{m.setting.label:<40} {m.lr:>7g} {med:>8} {ratio:>6}  {per}; {best}")
    return f"samples to {label}\n" + "\n".join(lines)


@click.command()
@click.option(
    "--config",
    "config_path",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    default=throughput.DEFAULT_CONFIG,
    show_default=True,
)
@click.option(
    "--settings",
    "settings_text",
    default="1x1/1,2x1/3,1x4/3,2x4/3",
    show_default=True,
    help="VWSxNM/STAGES[:SCHEDULE][:AGGREGATION][:MITIGATION][:D<n>] per run (comma list).",
)
@click.option("--staleness", default=0, show_default=True, help="D for settings that do not name one.")
@click.option(
    "--seeds",
    default="0",
    show_default=True,
    help="Config seeds, one run of every setting each (comma list).",
)
@click.option(
    "--lrs",
    default=None,
    help="Learning rates each setting tries with the first seed (comma list, in order); "
    "default: the config's only.",
)
@click.option(
    "--samples", default=100_000, show_default=True, help="Samples each run trains at most, over all its VWs."
)
@click.option(
    "--score-every", default=2048, show_default=True, help="Samples between scores of the global weights."
)
@click.option("--full", is_flag=True, help="Train every run to --samples (curves), not only to the target.")
@click.option(
    "--target",
    type=float,
    default=None,
    help="Test accuracy to reach (default 0.9), or for a language model the validation loss (required).",
)
@click.option(
    "--set", "overrides", multiple=True, help="Config override SECTION.KEY=VALUE (TOML value), repeatable."
)
@click.option(
    "--jobs", default=1, show_default=True, help="Runs at once, each its own process (one thread each)."
)
@click.option(
    "--calibrate",
    "calibrate",
    is_flag=False,
    flag_value="",
    default=None,
    help="Write (merge into) the planner's calibration file: beside the shipped profiles (as "
    "<model>-<digest>-b<batch>-<optimizer>-to<target>.json when the default file is another target's), "
    "or PATH.",
)
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), default=None, help="Write JSON here.")
@click.option(
    "--plot",
    "plot_path",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="PNG plot (needs matplotlib, the `bench` extra); default: --out with .png.",
)
def main(
    config_path: Path,
    settings_text: str,
    staleness: int,
    seeds: str,
    lrs: str | None,
    samples: int,
    score_every: int,
    full: bool,
    target: float | None,
    overrides: tuple[str, ...],
    jobs: int,
    calibrate: str | None,
    out: Path | None,
    plot_path: Path | None,
) -> None:
    torch.set_num_threads(1)
    config = apply_overrides(load_config(config_path), overrides)
    spec = model_of(config)
    goal = goals.goal_for(spec.task, target)
    t = config.train
    seed_list = [int(s) for s in seeds.split(",") if s.strip()]
    lr_list = [float(v) for v in lrs.split(",")] if lrs else [t.lr]
    settings = parse_settings(settings_text, defaults_of(config, staleness))
    print(
        f"{config.name}: model {config.model.name}, batch {t.batch_size}, {t.optimizer} lr {lr_list}; "
        f"seeds {seed_list}; target {goal.metric} {'>=' if goal.higher_is_better else '<='} {goal.target}",
        flush=True,
    )
    packed = pack_config(config)
    unique = list(
        dict.fromkeys(canonical(s).label for s in settings)
    )  # settings that train the same weights run once
    tasks = [
        (packed, label, seed_list, lr_list, samples, score_every, goal.metric, goal.target, not full)
        for label in unique
    ]
    results = _run_all(tasks, jobs)
    runs = [r for result in results for r in result["runs"]]
    found = measurements(results, settings, seed_list, samples)
    print()
    print(table(found, seed_list, goal.label))
    command = "python launch/bench/staleness.py " + shlex.join(sys.argv[1:])  # pastes back into a shell
    if calibrate is not None:
        controls = controls_of(t.lr_schedule, t.clip_grad_norm, t.loss)
        named = (spec.name, options_digest(spec), t.batch_size, t.optimizer)
        path = Path(calibrate) if calibrate else CALIBRATION_DIR / calibration_name(*named, None, controls)
        if not calibrate and path.is_file() and not math.isclose(Calibration.load(path).target, goal.target):
            path = path.with_name(
                calibration_name(*named, goal.target, controls)
            )  # the default file is another target's
        made = Calibration(
            spec.name,
            options_digest(spec),
            t.batch_size,
            t.optimizer,
            tuple(lr_list),
            goal.metric,
            goal.target,
            tuple(seed_list),
            tuple(found),
            command,
            controls=controls,
        )
        if path.is_file():
            old = Calibration.load(path)
            if (old.metric, old.target) != (goal.metric, goal.target):
                raise click.UsageError(
                    f"{path} holds {old.metric} {old.target}; this run {goal.metric} {goal.target}: "
                    "give another --calibrate PATH or remove it"
                )
            try:
                made = old.merged(made)
            except ValueError as exc:
                raise click.UsageError(f"{path}: {exc}; give another --calibrate PATH") from None
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(made.to_json())
        print(
            f"wrote calibration {path} ({len(made.measurements)} settings); {describe_fit(fit_model(made))}"
        )
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        document = {
            "config": str(config_path),
            "command": command,
            "metric": goal.metric,
            "target": goal.target,
            "samples": samples,
            "optimizer": t.optimizer,
            "lrs": lr_list,
            "batch": t.batch_size,
            "seeds": seed_list,
            "measurements": [m.to_json() for m in found],
            "runs": runs,
        }
        out.write_text(json.dumps(document, indent=1))
        print(f"wrote {out}")
    png = plot_path or (out.with_suffix(".png") if out else None)
    if png is not None:
        rows = [
            {"label": f"{r['setting']} s{r['seed']}", "curve": r["curve"]}
            for r in runs
            if r["seed"] == seed_list[0]
        ]
        print(plots.metric_curves(rows, goal.metric, goal.target, png, x_label="samples trained (all VWs)"))


if __name__ == "__main__":
    main()
