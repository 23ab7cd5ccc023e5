"""Staleness study: how many more samples hetpipe's stale weights cost to reach a target, by VWs, Nm and stages.

Measured in the single-process reference (hetpipe.compute.reference: the runtime's arithmetic bit for bit, with
`exact` pulls), so the answer has no timing and no noise: it is the sample-efficiency half of time to
accuracy, the throughput half being throughput.py's. A setting VxN/S trains V virtual workers of S stages
each (layers split as the runtime splits a VW without `layers`: evenly by parameters) with N minibatches in flight, D from --staleness; the global weights are scored
--scores times along the way.

    python launch/bench/staleness.py [--config launch/clusters/bench.toml] [--settings 1x1/1,2x1/3,1x4/3,2x4/3]
        [--samples 100000] [--target 0.9] [--set train.lr=0.02 ...] [--out FILE.json]
"""

from __future__ import annotations

import json
import math
import re
import sys
import time
from pathlib import Path
from typing import Any

import click
import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import plots  # noqa: E402  (launch/bench is not a package)
import throughput  # noqa: E402
import time_to_accuracy as tta  # noqa: E402

from hetpipe.compute.build import dataset_of, model_of  # noqa: E402
from hetpipe.compute.evaluate import evaluate  # noqa: E402
from hetpipe.compute.reference import run_reference  # noqa: E402
from hetpipe.core.config import ClusterConfig, apply_overrides, load_config  # noqa: E402
from hetpipe.models import even_split, param_counts  # noqa: E402

_SETTING = re.compile(r"^(\d+)x(\d+)/(\d+)$")


def parse_settings(text: str) -> list[tuple[int, int, int]]:
    """"2x4/3,1x1/1" -> [(2, 4, 3), (1, 1, 1)]: (VWs, Nm, stages per VW)."""
    out = []
    for item in text.split(","):
        match = _SETTING.match(item.strip())
        if not match or min(int(g) for g in match.groups()) < 1:
            raise click.BadParameter(f"{item!r}: write VWSxNM/STAGES with positive integers, e.g. 2x4/3")
        out.append(tuple(int(g) for g in match.groups()))
    return out


def run_setting(config: ClusterConfig, vws: int, nm: int, stages: int, staleness: int, samples: int,
                scores: int) -> list[dict[str, Any]]:
    """Train one setting in the reference; the global weights' metrics at about `scores` evenly spaced waves,
    each with the samples all VWs had trained by then."""
    batch = config.train.batch_size
    per_wave = vws * nm * batch
    waves = max(1, math.ceil(samples / per_wave))
    cfg = apply_overrides(config, [f"wsp.nm={nm}", f"wsp.staleness={staleness}", f"train.waves={waves}"])
    spec, data = model_of(cfg), dataset_of(cfg)
    every = max(1, waves // scores)
    out: list[dict[str, Any]] = []

    def score(version: int, weights: dict[str, np.ndarray]) -> None:
        if version % every == 0 or version == waves:
            state = {k: torch.from_numpy(v) for k, v in weights.items()}
            out.append({"t": version * per_wave, **evaluate(spec, state, data)})

    split = tuple(even_split(param_counts(spec), stages))  # what the runtime does for a VW without `layers`
    run_reference(cfg, [split] * vws, on_version=score)
    return out


@click.command()
@click.option("--config", "config_path", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              default=throughput.DEFAULT_CONFIG, show_default=True)
@click.option("--settings", "settings_text", default="1x1/1,2x1/3,1x4/3,2x4/3", show_default=True,
              help="VWSxNM/STAGES per run (comma list): VWs, minibatches in flight, stages per VW.")
@click.option("--staleness", default=0, show_default=True, help="D for every run.")
@click.option("--samples", default=100_000, show_default=True, help="Samples each run trains, over all its VWs.")
@click.option("--scores", default=12, show_default=True, help="Times the global weights are scored along a run.")
@click.option("--target", type=float, default=None,
              help="Test accuracy to reach (default 0.9), or for a language model the validation loss (required).")
@click.option("--set", "overrides", multiple=True, help="Config override SECTION.KEY=VALUE (TOML value), repeatable.")
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), default=None, help="Write JSON here.")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="PNG plot (needs matplotlib, the `bench` extra); default: --out with .png.")
def main(config_path: Path, settings_text: str, staleness: int, samples: int, scores: int, target: float | None,
         overrides: tuple[str, ...], out: Path | None, plot_path: Path | None) -> None:
    torch.set_num_threads(1)
    config = apply_overrides(load_config(config_path), overrides)
    goal = tta.goal_for(model_of(config).task, target)
    t = config.train
    print(f"{config.name}: model {config.model.name}, batch {t.batch_size}, {t.optimizer} lr {t.lr}, D {staleness}; "
          f"target {goal.metric} {'>=' if goal.higher_is_better else '<='} {goal.target}", flush=True)
    rows = []
    for vws, nm, stages in parse_settings(settings_text):
        name = f"{vws}x{nm}/{stages}"
        began = time.time()
        curve = run_setting(config, vws, nm, stages, staleness, samples, scores)
        reached = tta.first_reaching(curve, 0.0, goal)
        rows.append({"system": name, "label": f"{vws} VWs x {stages} stages, Nm {nm}", "samples_to_target": reached,
                     "best": goal.best(curve), "curve": [{"s": c["t"], goal.metric: c[goal.metric]} for c in curve]})
        print(f"  {name}: {'-' if reached is None else int(reached)} samples to target, best {rows[-1]['best']}, "
              f"last {curve[-1][goal.metric]} ({time.time() - began:.0f} s)", flush=True)
    print()
    print(f"{'setting':<10} {'samples to ' + goal.label:>18} {'best':>7} {'last':>7}  x samples of {rows[0]['system']}")
    first = rows[0]["samples_to_target"]
    for r in rows:
        reached = r["samples_to_target"]
        ratio = f"{reached / first:.2f}" if reached and first else "-"
        shown = "-" if reached is None else str(int(reached))
        print(f"{r['system']:<10} {shown:>18} {r['best']:>7.3f} {r['curve'][-1][goal.metric]:>7.3f}  {ratio}")
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        document = {"config": str(config_path), "metric": goal.metric, "target": goal.target, "staleness": staleness,
                    "samples": samples, "optimizer": t.optimizer, "lr": t.lr, "batch": t.batch_size,
                    "rows": rows}
        out.write_text(json.dumps(document, indent=1))
        print(f"wrote {out}")
    png = plot_path or (out.with_suffix(".png") if out else None)
    if png is not None:
        print(plots.metric_curves(rows, goal.metric, goal.target, png, x_label="samples trained (all VWs)"))


if __name__ == "__main__":
    main()
