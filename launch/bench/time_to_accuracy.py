"""Time-to-accuracy benchmark: wall time for hetpipe (D = 0 and a larger D) and for DDP to reach the same
MNIST-5k test accuracy on the same emulated cluster (launch/clusters/bench.toml by default).

Clocks start when training starts, after every process is up (hetpipe: its first stage span; DDP: the
step loop), so process start-up, which the emulation makes slow, counts for neither. Weights are scored
after the run, never during it: hetpipe's PS writes a checkpoint every --checkpoint-every clocks (its
file time is when the PS held those weights), DDP's rank 0 copies its weights every --snapshot-every
steps. The time to target is that of the first scored weights at or above --target.

    python launch/bench/time_to_accuracy.py [--target 0.9] [--staleness 0,4] [--ddp fastest@256]
        [--ddp-lr 0.001,0.002] [--max-seconds 90] [--out FILE.json]

Shakespeare with char-gpt (issue 5) is not covered yet: a run of char-gpt at a useful validation loss
takes far longer than the 5 minutes this shared 2-core machine allows a benchmark.
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import click
import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import peers  # noqa: E402  (launch/bench is not a package)
import throughput  # noqa: E402

from hetpipe.config import ClusterConfig, load_config  # noqa: E402
from hetpipe.evaluate import evaluate  # noqa: E402
from hetpipe.server.checkpoint import (
    list_manifests,  # noqa: E402
    read_checkpoint,  # noqa: E402
)
from hetpipe.worker.stage import dataset_of, model_of  # noqa: E402


def checkpoint_scores(config: ClusterConfig, run_dir: Path) -> list[dict[str, Any]]:
    """Test metrics of every PS checkpoint of a run, with its Unix time; clocks all shards wrote, in order."""
    spec, data = model_of(config), dataset_of(config)
    by_clock: dict[int, list[tuple[float, dict[str, np.ndarray]]]] = {}
    shards = sorted((run_dir / "ps").glob("shard-*"))
    for shard in shards:
        for manifest in list_manifests(shard):
            ckpt = read_checkpoint(manifest)
            weights = {k[2:]: v for k, v in ckpt.arrays.items() if k.startswith("w/")}
            by_clock.setdefault(ckpt.clock, []).append((ckpt.path.stat().st_mtime, weights))
    out = []
    for clock, parts in sorted(by_clock.items()):
        if len(parts) < len(shards):
            continue
        state = {k: torch.from_numpy(v) for _, w in parts for k, v in w.items()}
        out.append({"t": max(t for t, _ in parts), "clock": clock, **evaluate(spec, state, data)})
    return out


def first_reaching(scores: list[dict[str, Any]], start: float, target: float) -> float | None:
    """Seconds from start to the first score with test_accuracy >= target; None if none reached it."""
    return next((s["t"] - start for s in scores if s["test_accuracy"] >= target), None)


def run_hetpipe_tta(config: ClusterConfig, setup: throughput.HetpipeSetup, staleness: int, waves: int,
                    every: int, run_dir: Path) -> tuple[float, list[dict[str, Any]]]:
    """One hetpipe run with checkpoints every `every` clocks; (training start, scored checkpoints)."""
    from hetpipe.worker.launcher import TrainOptions, train

    setup = throughput.HetpipeSetup(setup.vws, setup.nm, staleness, setup.source, setup.predicted)
    extra = {"checkpoint": {"dir": str(run_dir / "ps"), "every": every, "keep": 100000}}
    cfg = throughput.hetpipe_config(config, setup, waves, run_dir / "config.toml", extra)
    train(cfg, TrainOptions(run_dir=run_dir, progress=False))
    return throughput.trace_start(run_dir), checkpoint_scores(cfg, run_dir)


def row(system: str, setting: str, start: float, scores: list[dict[str, Any]], target: float,
        samples_per_score: float) -> dict[str, Any]:
    reached = first_reaching(scores, start, target)
    best = max((s["test_accuracy"] for s in scores), default=float("nan"))
    trained_s = scores[-1]["t"] - start if scores else float("nan")
    return {"system": system, "setting": setting, "seconds_to_target": None if reached is None else round(reached, 1),
            "best_accuracy": best, "trained_s": round(trained_s, 1),
            "curve": [{"s": round(s["t"] - start, 2), "acc": s["test_accuracy"], "loss": s["test_loss"]} for s in scores],
            "samples_per_score": samples_per_score}


def table(rows: list[dict[str, Any]], target: float) -> str:
    lines = [f"{'system':<16} {'s to ' + format(target, '.0%'):>9} {'best acc':>8} {'trained s':>9}  setting"]
    for r in rows:
        t = "-" if r["seconds_to_target"] is None else f"{r['seconds_to_target']:.1f}"
        lines.append(f"{r['system']:<16} {t:>9} {r['best_accuracy']:>8.3f} {r['trained_s']:>9.1f}  {r['setting']}")
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], target: float, path: Path) -> bool:
    import importlib.util

    if importlib.util.find_spec("matplotlib") is None:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5))
    for r in rows:
        ax.plot([p["s"] for p in r["curve"]], [p["acc"] for p in r["curve"]], marker=".", label=r["system"])
    ax.axhline(target, color="gray", linestyle="--", label="target")
    ax.set_xlabel("training wall time (s)")
    ax.set_ylabel("test accuracy")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


@click.command()
@click.option("--config", "config_path", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              default=throughput.DEFAULT_CONFIG, show_default=True)
@click.option("--target", default=0.9, show_default=True, help="Test accuracy every system must reach.")
@click.option("--staleness", default="0,4", show_default=True, help="hetpipe D values, one run each ('' for none).")
@click.option("--ddp", "ddp_spec", default="fastest@256", show_default=True,
              help="DDP rows, SET@BATCH[/BATCH..] as in throughput.py; each batch is its own row here ('' for none).")
@click.option("--ddp-lr", default=None, help="DDP learning rates, one row each (comma list); default: the config's.")
@click.option("--max-seconds", default=90.0, show_default=True, help="Training time each run is given at most.")
@click.option("--checkpoint-every", default=2, show_default=True, help="hetpipe: PS checkpoint every this many clocks.")
@click.option("--snapshot-every", default=4, show_default=True, help="DDP: keep the weights every this many steps.")
@click.option("--planner/--no-planner", default=True, show_default=True)
@click.option("--set", "settings", multiple=True, help="Config override SECTION.KEY=VALUE (TOML value), repeatable.")
@click.option("--work-dir", type=click.Path(file_okay=False, path_type=Path), default=Path("runs/bench/tta"),
              show_default=True)
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), default=None, help="Write JSON here.")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="PNG plot (needs matplotlib); default: --out with .png.")
def main(config_path: Path, target: float, staleness: str, ddp_spec: str, ddp_lr: str | None, max_seconds: float,
         checkpoint_every: int, snapshot_every: int, planner: bool, settings: tuple[str, ...], work_dir: Path,
         out: Path | None, plot_path: Path | None) -> None:
    torch.set_num_threads(1)
    work = work_dir / time.strftime("%Y%m%d-%H%M%S")
    config = throughput.with_settings(load_config(config_path), settings, work / "config.toml")
    load_before = peers.env_note()["loadavg_1_5_15"]
    batch = config.train.batch_size
    devs = peers.devices(config)
    profile = peers.model_profile(config, batch, work_dir.parent / "throughput" / "profiles")
    need = peers.whole_model_bytes(profile)
    fit, left_out = peers.ddp_members(devs, need)
    subsets = peers.ddp_subsets(fit)
    for line in peers.describe_members(fit, left_out, need):
        print(line)
    setup = throughput.hetpipe_setup(config, profile, planner)
    print(f"hetpipe: {setup.label} ({setup.source}); target test accuracy {target}", flush=True)

    solo = peers.run_solo(config, batch, 10, work / "logs")
    capacity = solo.rate(3) * sum(1.0 / d.slowdown for d in devs)
    rows = []
    per_wave = setup.nm * batch * len(setup.vws)
    waves = max(5, math.ceil(max_seconds * 0.6 * capacity / per_wave))
    for d in (int(v) for v in staleness.split(",") if v.strip()):
        start, scores = run_hetpipe_tta(config, setup, d, waves, checkpoint_every, work / f"hetpipe-D{d}")
        rows.append(row(f"hetpipe D={d}", f"{setup.label.rsplit(', D=', 1)[0]}, D={d}, lr {config.train.lr}",
                        start, scores, target, checkpoint_every * per_wave))
        print(f"  hetpipe D={d}: {rows[-1]['seconds_to_target']} s to target, best {rows[-1]['best_accuracy']}", flush=True)
    lrs = [float(v) for v in ddp_lr.split(",")] if ddp_lr else [config.train.lr]
    for name, batches in throughput.parse_ddp(ddp_spec, batch) if ddp_spec else []:
        members = subsets["fit"] if name == "fit" else subsets[next((k for k in subsets if k != "fit"), "fit")]
        for b in batches:
            for lr in lrs:
                run = peers.run_ddp(config, members, b, 10**6, work / "logs", snapshot_every=snapshot_every, lr=lr,
                                    deadline_s=max_seconds)
                rows.append(row(f"ddp-{name}", f"{len(members)} GPUs, batch {b}/GPU, lr {lr}", run.start, run.evals,
                                target, snapshot_every * b * len(members)))
                print(f"  ddp-{name} b{b} lr{lr}: {rows[-1]['seconds_to_target']} s to target, "
                      f"best {rows[-1]['best_accuracy']}", flush=True)
    print()
    print(table(rows, target))
    hp = [r["seconds_to_target"] for r in rows if r["system"].startswith("hetpipe") and r["seconds_to_target"]]
    dd = [r["seconds_to_target"] for r in rows if r["system"].startswith("ddp") and r["seconds_to_target"]]
    if hp and dd:
        print(f"fastest hetpipe / fastest DDP wall time to {target:.0%}: {min(hp) / min(dd):.2f}")
    note = peers.env_note()
    print(f"load average (1, 5, 15 min) before {load_before}, after {note['loadavg_1_5_15']}, {note['cores']} cores")
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"config": str(config_path), "target": target, "meta": {**note, "loadavg_before": load_before},
                                   "rows": rows}, indent=1))
        print(f"wrote {out}")
    png = plot_path or (out.with_suffix(".png") if out else None)
    if png is not None:
        print(f"wrote {png}" if plot(rows, target, png) else "no plot: matplotlib is not installed")


if __name__ == "__main__":
    main()
