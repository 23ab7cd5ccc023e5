"""Time-to-accuracy benchmark: wall time for hetpipe (D = 0 and a larger D) and for DDP to reach the same
test accuracy on MNIST-5k (launch/clusters/bench.toml, the default) or the same validation loss on
Shakespeare (launch/clusters/bench-shakespeare.toml: the same emulated cluster, a small char-level GPT).

Clocks start when training starts, after every process is up (hetpipe: its first stage span; DDP: the
step loop), so process start-up, which the emulation makes slow, counts for neither. Weights are scored
after the run, never during it: hetpipe's PS writes a checkpoint every --checkpoint-every clocks (its
file time is when the PS held those weights), DDP's rank 0 copies its weights every --snapshot-every
steps. The time to target is that of the first scored weights at or above the target accuracy (at or
below the target loss, for a language model).

    python launch/bench/time_to_accuracy.py [--config CLUSTER.toml] [--target 0.9] [--staleness 0,4]
        [--nm 4] [--lr 0.02] [--ddp fit,fastest@256] [--ddp-lr 0.02,0.05] [--max-seconds 90] [--out FILE.json]
        [--testbed [--testbed-scale S]]

Network: free by default (loopback; no link costs anything). With --testbed every run is in the shaped-network
testbed, as in throughput.py (docs/testbed.md): each node's egress is measured first and recorded with the scale.
"""

from __future__ import annotations

import contextlib
import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click
import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import peers  # noqa: E402  (launch/bench is not a package)
import plots  # noqa: E402
import throughput  # noqa: E402

from hetpipe.compute.build import dataset_of, model_of  # noqa: E402
from hetpipe.compute.evaluate import evaluate  # noqa: E402
from hetpipe.core.config import ClusterConfig, apply_overrides, load_config  # noqa: E402
from hetpipe.core.testbed import Topology  # noqa: E402
from hetpipe.server.checkpoint import (
    list_manifests,  # noqa: E402
    read_checkpoint,  # noqa: E402
)


def checkpoint_scores(config: ClusterConfig, run_dir: Path, until: float = math.inf) -> list[dict[str, Any]]:
    """Test metrics of every PS checkpoint of a run written by Unix time `until`, with its time; clocks all
    shards wrote, in order."""
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
        if len(parts) < len(shards) or max(t for t, _ in parts) > until:
            continue
        state = {k: torch.from_numpy(v) for _, w in parts for k, v in w.items()}
        out.append({"t": max(t for t, _ in parts), "clock": clock, **evaluate(spec, state, data)})
    return out


@dataclass(frozen=True)
class Goal:
    """What every system must reach: `metric` of the scored weights at or above (accuracy) or at or below
    (loss) `target`."""

    metric: str
    target: float

    @property
    def higher_is_better(self) -> bool:
        return self.metric.endswith("accuracy")

    def met(self, score: dict[str, Any]) -> bool:
        value = score[self.metric]
        return value >= self.target if self.higher_is_better else value <= self.target

    def best(self, scores: list[dict[str, Any]]) -> float:
        values = [s[self.metric] for s in scores]
        return (max if self.higher_is_better else min)(values, default=float("nan"))

    @property
    def label(self) -> str:
        return f"{self.target:.0%}" if self.higher_is_better else f"loss {self.target:g}"


def goal_for(task: str, target: float | None) -> Goal:
    """Test accuracy for a classifier (0.9 unless given), validation loss in nats for a language model."""
    if task == "classification":
        return Goal("test_accuracy", 0.9 if target is None else target)
    if target is None:
        raise click.UsageError("this model is a language model: give --target, the validation loss to reach in nats "
                               "per token (e.g. --target 2.0; a unigram guess scores ~3.3 on Shakespeare)")
    return Goal("val_loss", target)


def first_reaching(scores: list[dict[str, Any]], start: float, goal: Goal) -> float | None:
    """Seconds from start to the first score that meets the goal; None if none did."""
    return next((s["t"] - start for s in scores if goal.met(s)), None)


def run_hetpipe_tta(config: ClusterConfig, setup: throughput.HetpipeSetup, staleness: int, waves: int,
                    every: int, run_dir: Path, seconds: float,
                    testbed: Topology | None = None) -> tuple[float, list[dict[str, Any]]]:
    """One hetpipe run with checkpoints every `every` clocks; (training start, the checkpoints of its first
    `seconds` of training, scored). In a testbed: `hetpipe server` + `hetpipe worker`s in the nodes' namespaces."""
    setup = throughput.HetpipeSetup(setup.vws, setup.nm, staleness, setup.source, setup.predicted)
    run_dir = run_dir.resolve()  # the testbed's processes read the config from elsewhere: absolute paths
    extra = [f"checkpoint.dir={json.dumps(str(run_dir / 'ps'))}", f"checkpoint.every={every}", "checkpoint.keep=100000"]
    cfg = throughput.hetpipe_config(config, setup, waves, run_dir, extra)
    throughput.run_hetpipe(cfg, setup, run_dir, testbed)
    start = throughput.trace_start(run_dir)
    return start, checkpoint_scores(cfg, run_dir, until=start + seconds)


def row(system: str, setting: str, start: float, scores: list[dict[str, Any]], goal: Goal,
        samples_per_score: float) -> dict[str, Any]:
    """A system's result: seconds to the goal (None: not reached), best score, its curve, a label for plots."""
    reached = first_reaching(scores, start, goal)
    trained_s = scores[-1]["t"] - start if scores else float("nan")
    return {"system": system, "setting": setting, "label": f"{system}, {setting.split(', ')[-1]}",
            "seconds_to_target": None if reached is None else round(reached, 1),
            "best": goal.best(scores), "trained_s": round(trained_s, 1),
            "curve": [{"s": round(s["t"] - start, 2), goal.metric: s[goal.metric]} for s in scores],
            "samples_per_score": samples_per_score}


def table(rows: list[dict[str, Any]], goal: Goal) -> str:
    best = "best acc" if goal.higher_is_better else "best loss"
    lines = [f"{'system':<16} {'s to ' + goal.label:>11} {best:>9} {'trained s':>9}  setting"]
    for r in rows:
        t = "-" if r["seconds_to_target"] is None else f"{r['seconds_to_target']:.1f}"
        lines.append(f"{r['system']:<16} {t:>11} {r['best']:>9.3f} {r['trained_s']:>9.1f}  {r['setting']}")
    return "\n".join(lines)


def comma_floats(text: str | None, default: float) -> list[float]:
    return [float(v) for v in text.split(",")] if text else [default]


@click.command()
@click.option("--config", "config_path", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              default=throughput.DEFAULT_CONFIG, show_default=True)
@click.option("--target", type=float, default=None,
              help="Test accuracy to reach (default 0.9), or for a language model the validation loss (required).")
@click.option("--staleness", default="0,4", show_default=True, help="hetpipe D values, one run each ('' for none).")
@click.option("--nm", default="", help="hetpipe Nm caps, one run each with every D (comma list; default: the plan's).")
@click.option("--lr", "hetpipe_lr", default=None, help="hetpipe learning rates, one run each (comma list); default: the config's.")
@click.option("--ddp", "ddp_spec", default="fit,fastest", show_default=True,
              help="DDP rows, SET@BATCH[/BATCH..] as in throughput.py; each batch is its own row here ('' for none).")
@click.option("--ddp-lr", default=None, help="DDP learning rates, one row each (comma list); default: the config's.")
@click.option("--max-seconds", default=90.0, show_default=True, help="Training time each run is given at most.")
@click.option("--checkpoint-every", default=2, show_default=True, help="hetpipe: PS checkpoint every this many clocks.")
@click.option("--snapshot-every", default=4, show_default=True, help="DDP: keep the weights every this many steps.")
@click.option("--planner/--no-planner", default=True, show_default=True)
@click.option("--set", "settings", multiple=True, help="Config override SECTION.KEY=VALUE (TOML value), repeatable.")
@click.option("--testbed", "use_testbed", is_flag=True,
              help="Run every system in the shaped-network testbed (root; docs/testbed.md) instead of on a free network.")
@click.option("--testbed-scale", type=click.FloatRange(min=0, min_open=True), default=None,
              help="Link scale in the testbed: links at inter_node_gbps x this (default: derived, docs/testbed.md).")
@click.option("--probe-seconds", type=click.FloatRange(min=0.5), default=1.5, show_default=True,
              help="Testbed: seconds each node's egress is measured for, before the systems run.")
@click.option("--work-dir", type=click.Path(file_okay=False, path_type=Path), default=Path("runs/bench/tta"),
              show_default=True)
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), default=None, help="Write JSON here.")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="PNG plot (needs matplotlib, the `bench` extra); default: --out with .png.")
def main(config_path: Path, target: float | None, staleness: str, nm: str, hetpipe_lr: str | None, ddp_spec: str,
         ddp_lr: str | None, max_seconds: float, checkpoint_every: int, snapshot_every: int, planner: bool,
         settings: tuple[str, ...], use_testbed: bool, testbed_scale: float | None, probe_seconds: float,
         work_dir: Path, out: Path | None, plot_path: Path | None) -> None:
    with contextlib.ExitStack() as stack:
        _main(config_path, target, staleness, nm, hetpipe_lr, ddp_spec, ddp_lr, max_seconds, checkpoint_every,
              snapshot_every, planner, settings, use_testbed, testbed_scale, probe_seconds, work_dir, out, plot_path,
              stack)


def _main(config_path: Path, target: float | None, staleness: str, nm: str, hetpipe_lr: str | None, ddp_spec: str,
          ddp_lr: str | None, max_seconds: float, checkpoint_every: int, snapshot_every: int, planner: bool,
          settings: tuple[str, ...], use_testbed: bool, testbed_scale: float | None, probe_seconds: float,
          work_dir: Path, out: Path | None, plot_path: Path | None, stack: contextlib.ExitStack) -> None:
    torch.set_num_threads(1)
    work = work_dir / time.strftime("%Y%m%d-%H%M%S")
    config = apply_overrides(load_config(config_path), settings)
    goal = goal_for(model_of(config).task, target)
    ddp_sets = throughput.parse_ddp(ddp_spec, config.train.batch_size) if ddp_spec else []
    load_before = peers.env_note()["loadavg_1_5_15"]
    batch = config.train.batch_size
    devs = peers.devices(config)
    cache = work_dir.parent / "throughput" / "profiles"
    profile = peers.model_profile(config, batch, cache)
    need = peers.whole_model_bytes(profile)
    fit, left_out = peers.ddp_members(devs, need)
    subsets = peers.ddp_subsets(fit)
    for line in peers.describe_members(fit, left_out, need):
        print(line)
    topology, testbed_record = (throughput.open_testbed(config, cache, testbed_scale, probe_seconds, stack)
                                if use_testbed else (None, None))
    print("network: " + ("the testbed's shaped links" if topology else "free (loopback; no link costs anything)"))
    setups = [throughput.hetpipe_setup(config, profile, planner, nm=cap, testbed=topology)
              for cap in (throughput.parse_ints(nm, "Nm caps") if nm else [None])]
    for setup in setups:
        print(f"hetpipe: {setup.label} ({setup.source})", flush=True)
    print(f"target: {goal.metric} {'>=' if goal.higher_is_better else '<='} {goal.target}", flush=True)

    solo = peers.run_solo(config, batch, 10, work / "logs")
    capacity = solo.rate(3) * sum(1.0 / d.slowdown for d in devs)
    rows = []
    for setup in setups:
        per_wave = setup.nm * batch * len(setup.vws)
        # Enough waves to train at least --max-seconds: 1.3x the planner's prediction (it predicts 10-20% high),
        # capped by the capacity bound, which no system beats. Checkpoints after --max-seconds are not scored,
        # so hetpipe gets the same training time as DDP, no more, no less.
        rate = capacity if setup.predicted is None else min(capacity, 1.3 * setup.predicted)
        waves = max(5, math.ceil(max_seconds * rate / per_wave))
        for lr in comma_floats(hetpipe_lr, config.train.lr):
            run_config = apply_overrides(config, [f"train.lr={lr}"])
            for d in (int(v) for v in staleness.split(",") if v.strip()):
                run_dir = work / f"hetpipe-nm{setup.nm}-lr{lr}-D{d}"
                start, scores = run_hetpipe_tta(run_config, setup, d, waves, checkpoint_every, run_dir, max_seconds,
                                                topology)
                setting = f"{setup.label.rsplit(', D=', 1)[0]}, D={d}, lr {lr}"
                rows.append(row(f"hetpipe Nm={setup.nm} D={d}", setting, start, scores, goal,
                                checkpoint_every * per_wave))
                print(f"  hetpipe Nm={setup.nm} D={d} lr {lr}: {rows[-1]['seconds_to_target']} s to target, "
                      f"best {rows[-1]['best']}", flush=True)
    for name, batches in ddp_sets:
        members = subsets["fit"] if name == "fit" else subsets[next((k for k in subsets if k != "fit"), "fit")]
        for b in batches:
            for lr in comma_floats(ddp_lr, config.train.lr):
                run = peers.run_ddp(config, members, b, 10**6, work / "logs", snapshot_every=snapshot_every, lr=lr,
                                    deadline_s=max_seconds, testbed=topology)
                rows.append(row(f"ddp-{name}", f"{len(members)} GPUs, batch {b}/GPU, lr {lr}", run.start, run.evals,
                                goal, snapshot_every * b * len(members)))
                print(f"  ddp-{name} b{b} lr {lr}: {rows[-1]['seconds_to_target']} s to target, "
                      f"best {rows[-1]['best']}", flush=True)
    print()
    print(table(rows, goal))
    for line in verdicts(rows, goal):
        print(line)
    note = peers.env_note()
    print(f"load average (1, 5, 15 min) before {load_before}, after {note['loadavg_1_5_15']}, {note['cores']} cores")
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        document = {"config": str(config_path), "metric": goal.metric, "target": goal.target,
                    "meta": {**note, "loadavg_before": load_before}, "rows": rows,
                    "network": "testbed" if topology else "free"}
        if testbed_record is not None:
            document["testbed"] = testbed_record
        out.write_text(json.dumps(document, indent=1))
        print(f"wrote {out}")
    png = plot_path or (out.with_suffix(".png") if out else None)
    if png is not None:
        print(plots.metric_curves(rows, goal.metric, goal.target, png))


def verdicts(rows: list[dict[str, Any]], goal: Goal) -> list[str]:
    """hetpipe's fastest time to target over each DDP set's fastest, or who never got there."""
    def fastest(prefix: str) -> float | None:
        times = [r["seconds_to_target"] for r in rows if r["system"].startswith(prefix) and r["seconds_to_target"]]
        return min(times) if times else None

    hp = fastest("hetpipe")
    lines = []
    for system in dict.fromkeys(r["system"] for r in rows if r["system"].startswith("ddp")):
        dd = fastest(system)
        trained = max(r["trained_s"] for r in rows if r["system"] == system)
        if hp is not None and dd is not None:
            lines.append(f"hetpipe / {system} wall time to {goal.label}: {hp / dd:.2f}")
        elif hp is not None:
            lines.append(f"hetpipe / {system} wall time to {goal.label}: < {hp / trained:.2f} ({system} did not get "
                         f"there in {trained:.0f} s)")
        elif dd is not None:
            lines.append(f"hetpipe did not reach {goal.label}; {system} did in {dd:.1f} s")
    return lines


if __name__ == "__main__":
    main()
