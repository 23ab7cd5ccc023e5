"""Time-to-accuracy benchmark (docs/convergence.md): wall time to a target for hetpipe (the planner's choice,
ranked by predicted time to target) against what users run instead on the same emulated GPUs: DDP over every
GPU that holds the model (ddp-fit), DDP over the fastest type alone (ddp-fastest), DDP over every GPU that
holds the model with ddp-fit's global batch split by speed (ddp-prop, peers.speed_batches: heterogeneity-aware
DDP as LB-BSP and Poplar do; the same update as ddp-fit, each rank's loss weighted by its share), and one
torch.distributed.pipelining pipeline over all GPUs.

Per task (tta_tasks.TASKS: mnist, shakespeare, resnet; a shipped cluster config and `--set` overrides):
1. The learning-rate sweep, the same for every system: in the single-process reference, samples to the target
   for each learning rate of the task (or --lrs), for the setting that trains like the system (hetpipe: the
   planner's plan at that learning rate; DDP over G GPUs and a pipeline of G microbatches: gradient
   accumulation over G minibatches); each system gets its fewest-samples learning rate (or --lr's). No
   timing, so a busy machine cannot bias it. With several batches per GPU (the task's grid or --batches), the
   sweep runs at each, and each system then takes the batch it reaches the target soonest at by its own rule:
   hetpipe by the planner's prediction (each batch's calibration and profile, as `hetpipe plan --batch`), the
   peers by the sweep's samples over their rate measured in a short run at that batch (--rate-probe-s, on the
   same network).
2. Timed runs, every system once per seed (the order rotating), each given --max-seconds of training. Clocks
   start when training starts, after every process is up (hetpipe: its first stage span; the peers: after
   their first barrier). Weights are scored after the run, never during it: hetpipe's PS writes a checkpoint
   every --checkpoint-every clocks (its file time is when the PS held those weights), DDP's rank 0 and every
   pipeline stage keep their weights every --snapshot-every steps. Time to target: the first scored weights at
   or above the target accuracy (at or below the target loss); samples to target: the samples every worker had
   trained by then.

    python launch/bench/time_to_accuracy.py [--task mnist,shakespeare,resnet] [--seeds 0,1,2] [--systems ...]
        [--lrs 0.001,0.002] [--lr hetpipe=0.004] [--batches 16,64] [--max-seconds S] [--set K=V ...]
        [--testbed] [--out tta.json] [--table tta.md]

--out writes JSON: one row per task, system and seed {task, system, seed, target, time_to_target_s,
samples_to_target} (null when not reached) with the learning rate, setting, best score and curve, and a
summary per task (medians, spread, hetpipe over the best DDP, the planner's predicted time against the
measured); a PNG of the metric against wall time per system beside it (or --plot); --table a Markdown table of
medians and spread.

Network: free by default (loopback; no link costs anything). With --testbed every run is in the shaped-network
testbed, as in throughput.py (docs/testbed.md): each node's egress is measured first and recorded with the
scale. The JSON says which ("network").
"""

from __future__ import annotations

import contextlib
import json
import math
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import click
import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import peers  # noqa: E402  (launch/bench is not a package)
import plots  # noqa: E402
import throughput  # noqa: E402
import tta_tasks  # noqa: E402
from goals import Goal, first_reaching, goal_for  # noqa: E402, F401  (goal_for: the scripts' shared entry)
from testbed_options import profile_option, testbed_options  # noqa: E402

from hetpipe.compute.build import dataset_of, model_of  # noqa: E402
from hetpipe.compute.evaluate import evaluate  # noqa: E402
from hetpipe.core.config.files import load_config  # noqa: E402
from hetpipe.core.config.overrides import apply_overrides  # noqa: E402
from hetpipe.core.config.schema import ClusterConfig  # noqa: E402
from hetpipe.core.planning.convergence import Calibration, Setting, setting_of  # noqa: E402
from hetpipe.core.runs.testbed import Topology  # noqa: E402
from hetpipe.core.wsp.state import ShardState  # noqa: E402
from hetpipe.server.checkpoint import list_manifests, read_checkpoint  # noqa: E402

SYSTEMS = ("hetpipe", "ddp-fit", "ddp-fastest", "ddp-prop", "pipeline")


# ---------------------------------------------------------------------------------------------- scoring


def checkpoint_scores(config: ClusterConfig, run_dir: Path, until: float = math.inf) -> list[dict[str, Any]]:
    """Test metrics of every PS checkpoint of a run written by Unix time `until`, with its time; clocks all
    shards wrote, in order."""
    spec, data = model_of(config), dataset_of(config)
    by_clock: dict[int, list[tuple[float, dict[str, np.ndarray]]]] = {}
    shards = sorted((run_dir / "ps").glob("shard-*"))
    for shard in shards:
        for manifest in list_manifests(shard):
            ckpt = read_checkpoint(manifest)
            weights = ShardState.from_state(ckpt.meta["wsp"], ckpt.arrays).read().tensors  # exact or latest
            by_clock.setdefault(ckpt.clock, []).append((ckpt.path.stat().st_mtime, weights))
    out = []
    for clock, parts in sorted(by_clock.items()):
        if len(parts) < len(shards) or max(t for t, _ in parts) > until:
            continue
        state = {k: torch.from_numpy(v) for _, w in parts for k, v in w.items()}
        out.append(
            {
                "t": max(t for t, _ in parts),
                "clock": clock,
                **evaluate(spec, state, data, max_samples=config.train.eval_samples),
            }
        )
    return out


def row(
    task: str,
    system: str,
    seed: int,
    goal: Goal,
    start: float,
    scores: list[dict[str, Any]],
    samples_per_score: dict[str, Any],
    **extra: Any,
) -> dict[str, Any]:
    """One timed run: {task, system, seed, target, time_to_target_s, samples_to_target} (None: not reached),
    the best score, the training seconds scored, the curve; `samples_per_score` = (key in a score, samples per
    unit)."""
    key, unit = samples_per_score["key"], samples_per_score["samples"]
    reached = first_reaching(scores, start, goal)
    at = next((s for s in scores if goal.met(s)), None)
    return {
        "task": task,
        "system": system,
        "seed": seed,
        "target": goal.target,
        "metric": goal.metric,
        "time_to_target_s": None if reached is None else round(reached, 2),
        "samples_to_target": None if at is None else int(at[key] * unit),
        "best": goal.best(scores),
        "trained_s": round(scores[-1]["t"] - start, 1) if scores else 0.0,
        "curve": [
            {"s": round(s["t"] - start, 2), goal.metric: s[goal.metric], "samples": int(s[key] * unit)}
            for s in scores
        ],
        **extra,
    }


# --------------------------------------------------------------------------------------------- hetpipe's plan


def planned(
    config: ClusterConfig,
    profile: Any,
    testbed: Topology | None,
    search_rules: bool = False,
    target: float | None = None,
    calibration_file: Path | None = None,
) -> tuple[throughput.HetpipeSetup, Any, Calibration | None, ClusterConfig]:
    """The planner's best plan for `config` ranked by predicted time to `target` (the calibration of its
    model, batch and optimizer to that target, when there is one; `calibration_file`'s when given, as `hetpipe
    plan --calibration`); with `search_rules`, also over every training rule (aggregation, mitigation) the
    calibration measured, as `hetpipe plan --target` does. (setup, candidate, calibration, the config to
    run)."""
    from hetpipe.app.plan_convergence import plan_calibration, plan_over_rules, rule_of
    from hetpipe.core.planning import planner

    profiles = planner.emulated_profiles(config, profile, peers.cpu_cores())
    ps_gbps, link, network = throughput.planner_links(testbed)
    calibration, note = (
        plan_calibration(config, path=calibration_file)
        if calibration_file is not None
        else plan_calibration(config, target=target)
    )

    def plan(variant: ClusterConfig) -> list[Any]:
        return planner.plan_candidates(
            variant,
            profiles,
            ps_gbps=ps_gbps,
            link_gbps=link,
            ps_network=network,
            slower_but_fewer=calibration is not None,
        )

    candidates, chosen, tried = plan_over_rules(config, calibration, plan, planner.best, search=search_rules)
    top = planner.best(candidates)
    setup = throughput.HetpipeSetup.of_plan(
        top.plan,
        chosen.train.batch_size,
        f"planner: {top.label}, {rule_of(chosen)} (of {tried} rules); {note}",
        top.samples_per_s,
    )
    return setup, top, calibration, chosen


# ---------------------------------------------------------------------------------------------- the systems


class Bench:
    """One task's systems on the emulated cluster: their settings, their sweeps, their timed runs."""

    def __init__(
        self,
        task: tta_tasks.Task,
        config: ClusterConfig,
        goal: Goal,
        work: Path,
        profile: Any,
        max_seconds: float,
        checkpoint_every: int,
        snapshot_every: int,
        testbed: Topology | None,
        hetpipe_settings: tuple[str, ...] = (),
        search_rules: bool = True,
        calibration_file: Path | None = None,
    ) -> None:
        self.task, self.config, self.goal, self.work = task, config, goal, work
        self.calibration_file = calibration_file  # a fine-tuning task's own (tta_tasks.calibrated)
        self.hetpipe_config = apply_overrides(config, [*task.hetpipe, *hetpipe_settings])
        self.search_rules = search_rules
        self.max_seconds, self.checkpoint_every, self.snapshot_every = (
            max_seconds,
            checkpoint_every,
            snapshot_every,
        )
        self.testbed = testbed
        self.batch = config.train.batch_size
        self.devs = peers.devices(config)
        self.profile = profile
        need = peers.whole_model_bytes(self.profile)
        fit, left_out = peers.ddp_members(self.devs, need)
        self.subsets = peers.ddp_subsets(fit)
        for line in peers.describe_members(fit, left_out, need):
            print(line)
        link = 27.0 if testbed is None else testbed.link_gbps
        self.layout = peers.pipeline_layout(self.devs, self.profile, link)
        self._plan: tuple[throughput.HetpipeSetup, Any, Calibration | None] | None = None
        self._capacity: float | None = None

    def members(self, system: str) -> list[peers.Device]:
        members, _ = throughput.ddp_members_of(system.removeprefix("ddp-"), self.subsets)
        return members

    def ddp_batch(self, system: str) -> int | list[int]:
        """A DDP system's batch: this bench's per GPU, or for ddp-prop ddp-fit's global batch (the bench's
        batch x its GPUs) split by speed."""
        if system != "ddp-prop":
            return self.batch
        members = self.members(system)
        return peers.speed_batches(members, self.batch * len(members))

    def plan(self) -> tuple[throughput.HetpipeSetup, Any, Calibration | None]:
        if self._plan is None:
            setup, top, calibration, self.hetpipe_config = planned(
                self.hetpipe_config,
                self.profile,
                self.testbed,
                self.search_rules,
                self.goal.target,
                self.calibration_file,
            )
            self._plan = (setup, top, calibration)
        return self._plan

    def setting(self, system: str) -> Setting:
        """The setting that trains like `system` (hetpipe: the planner's plan)."""
        if system == "hetpipe":
            _, top, _ = self.plan()
            hp = self.hetpipe_config
            found = setting_of(top, hp.ps.aggregation, hp.train.mitigations)
            assert found is not None
            return found
        count = len(self.layout.gpus) if system == "pipeline" else len(self.members(system))
        return Setting(1, max(1, count), 1, "1f1b-flush")

    def describe(self, system: str, lr: float) -> str:
        if system == "hetpipe":
            setup, _, _ = self.plan()
            hp = self.hetpipe_config
            return (
                f"{setup.label}, batch {self.batch}/GPU, aggregation {hp.ps.aggregation}, mitigation "
                f"{hp.train.mitigation}, lr {lr:g} ({setup.source})"
            )
        if system == "pipeline":
            k = len(self.layout.gpus)
            return (
                f"{k} stages {'/'.join(map(str, self.layout.split))}, "
                f"{k} x {self.batch} microbatches, 1f1b, lr {lr:g}"
            )
        members = self.members(system)
        batch = self.ddp_batch(system)
        shared = (
            f"batch {batch}/GPU"
            if isinstance(batch, int)
            else f"global batch {sum(batch)} {peers.SPLIT_BY}: {'/'.join(map(str, batch))}"
        )
        return f"{len(members)} GPUs ({', '.join(d.gpu_type for d in members)}), {shared}, lr {lr:g}"

    def capacity(self) -> float:
        if self._capacity is None:
            solo = peers.run_solo(self.config, self.batch, 10, self.work / "logs")
            self._capacity = solo.rate(3) * sum(1.0 / d.slowdown for d in self.devs)
        return self._capacity

    def probe(self, system: str, lr: float, seconds: float) -> float:
        """A peer's samples/s in a run of `seconds` of training at this batch (0.0: fewer than three
        steps)."""
        logs = self.work / "probe-logs"
        config = apply_overrides(self.config, [f"train.lr={lr}"])
        if system == "pipeline":
            k = len(self.layout.gpus)
            run = peers.run_pipeline(
                config,
                self.layout,
                self.batch,
                k,
                10**6,
                logs,
                lr=lr,
                deadline_s=seconds,
                testbed=self.testbed,
            )
        else:
            run = peers.run_ddp(
                config,
                self.members(system),
                self.ddp_batch(system),
                10**6,
                logs,
                lr=lr,
                deadline_s=seconds,
                testbed=self.testbed,
            )
        return run.rate(1) if len(run.ends) > 2 else 0.0

    def run(self, system: str, lr: float, seed: int) -> dict[str, Any]:
        base = self.hetpipe_config if system == "hetpipe" else self.config
        config = apply_overrides(base, [f"train.lr={lr}", f"seed={seed}"])
        logs = self.work / "logs"
        if system == "hetpipe":
            setup, top, _ = self.plan()
            per_wave = setup.samples_per_wave(self.batch)
            # waves for at least --max-seconds: 1.3x the plan's rate (it predicts 10-20% high), capped by the
            # capacity bound; checkpoints after --max-seconds are not scored, so hetpipe trains as long as the
            # peers
            rate = min(self.capacity(), 1.3 * (setup.predicted or self.capacity()))
            waves = max(5, math.ceil(self.max_seconds * rate / per_wave))
            run_dir = (self.work / f"hetpipe-lr{lr:g}-seed{seed}").resolve()
            extra = [
                f"checkpoint.dir={json.dumps(str(run_dir / 'ps'))}",
                f"checkpoint.every={self.checkpoint_every}",
                "checkpoint.keep=100000",
            ]
            cfg = throughput.hetpipe_config(config, setup, waves, run_dir, extra)
            _, measured_rate = throughput.run_hetpipe(cfg, setup, run_dir, self.testbed)
            start = throughput.trace_start(run_dir)
            scores = checkpoint_scores(cfg, run_dir, until=start + self.max_seconds)
            return row(
                self.task.name,
                system,
                seed,
                self.goal,
                start,
                scores,
                {"key": "clock", "samples": per_wave},
                lr=lr,
                batch=self.batch,
                setting=self.describe(system, lr),
                samples_per_s=round(measured_rate, 1),
                predicted_samples_per_s=round(top.samples_per_s, 1),
                predicted_samples_to_target=top.samples_to_target,
                predicted_time_to_target_s=None
                if top.time_to_target_s is None
                else round(top.time_to_target_s, 2),
                samples_source=top.samples_source,
            )
        if system == "pipeline":
            k = len(self.layout.gpus)
            run = peers.run_pipeline(
                config,
                self.layout,
                self.batch,
                k,
                10**6,
                logs,
                snapshot_every=self.snapshot_every,
                lr=lr,
                deadline_s=self.max_seconds,
                testbed=self.testbed,
            )
        else:
            run = peers.run_ddp(
                config,
                self.members(system),
                self.ddp_batch(system),
                10**6,
                logs,
                snapshot_every=self.snapshot_every,
                lr=lr,
                deadline_s=self.max_seconds,
                testbed=self.testbed,
            )
        rate = run.rate(1) if len(run.ends) > 2 else 0.0
        return row(
            self.task.name,
            system,
            seed,
            self.goal,
            run.start,
            run.evals,
            {"key": "step", "samples": run.samples_per_step},
            lr=lr,
            batch=self.batch,
            setting=self.describe(system, lr),
            samples_per_s=round(rate, 1),
        )


# ---------------------------------------------------------------------------------------------- report


FINAL_SCORES = 5  # a run's final score: the mean of its last this many scores (one alone is noisy)


def final_score(row: dict[str, Any]) -> tuple[float, float]:
    """A run's final score (the mean of its last FINAL_SCORES scores) and the samples it had trained by its
    last."""
    tail = row["curve"][-FINAL_SCORES:]
    return statistics.fmean(p[row["metric"]] for p in tail), tail[-1]["samples"]


def summary(rows: list[dict[str, Any]], systems: list[str]) -> dict[str, Any]:
    """Per system: median and spread of time and samples to target over seeds (a seed that did not get there
    counts as infinite: the median is None once half of them did not), and of the final score; hetpipe over
    the best DDP; predicted vs measured."""

    def med(values: list[float | None]) -> float | None:
        if not values:
            return None
        m = statistics.median(math.inf if v is None else v for v in values)
        return None if math.isinf(m) else m

    out: dict[str, Any] = {"systems": {}}
    for system in systems:
        mine = [r for r in rows if r["system"] == system]
        times = [r["time_to_target_s"] for r in mine]
        reached = [t for t in times if t is not None]
        ends = [final_score(r) for r in mine if r["curve"]]
        out["systems"][system] = {
            "time_to_target_s": {
                "median": med(times),
                "min": min(reached, default=None),
                "max": max(reached, default=None),
                "reached": f"{len(reached)}/{len(times)}",
            },
            "samples_to_target": med([r["samples_to_target"] for r in mine]),
            "samples_per_s": med([r["samples_per_s"] for r in mine]),
            "final": med([score for score, _ in ends]),
            "final_samples": med([samples for _, samples in ends]),
            "lr": mine[0]["lr"] if mine else None,
            "batch": mine[0].get("batch") if mine else None,
            "setting": mine[0]["setting"] if mine else "",
        }
    hp = out["systems"].get("hetpipe", {}).get("time_to_target_s", {}).get("median")
    ddp = [out["systems"][s]["time_to_target_s"]["median"] for s in systems if s.startswith("ddp")]
    ddp = [t for t in ddp if t is not None]
    out["hetpipe_over_best_ddp"] = round(hp / min(ddp), 3) if hp is not None and ddp else None
    mine = [r for r in rows if r["system"] == "hetpipe" and r.get("predicted_time_to_target_s")]
    if mine and hp is not None:
        predicted = statistics.median(r["predicted_time_to_target_s"] for r in mine)
        out["predicted_time_to_target_s"] = predicted
        out["predicted_over_measured"] = round(predicted / hp, 3)
    return out


def markdown(task: tta_tasks.Task, goal: Goal, found: dict[str, Any], network: str) -> str:
    """The README table: one line per system, medians over seeds with min-max."""
    lines = [
        f"**{task.name}** ({goal.metric} {'>=' if goal.higher_is_better else '<='} {goal.target:g}; "
        f"network: {network}; {task.note})",
        "",
        "| system | s to target, median (min-max) | reached | samples to target | samples/s | "
        f"final {goal.metric} (after samples) | lr | setting |",
        "|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for system, s in found["systems"].items():
        t = s["time_to_target_s"]
        time_text = (
            "not reached"
            if t["median"] is None
            else (
                f"{t['median']:.1f} ({t['min']:.1f}-{t['max']:.1f})"
                if t["min"] is not None
                else f"{t['median']:.1f}"
            )
        )
        samples = "-" if s["samples_to_target"] is None else f"{s['samples_to_target']:,.0f}"
        rate = "-" if s["samples_per_s"] is None else f"{s['samples_per_s']:.0f}"
        setting = s["setting"].replace("|", "/")  # a plan's VWs are separated by "|"
        final = "-" if s["final"] is None else f"{s['final']:.4g} ({s['final_samples']:,.0f})"
        lines.append(
            f"| {system} | {time_text} | {t['reached']} | {samples} | {rate} | {final} | {s['lr']:g} | "
            f"{setting} |"
        )
    if found.get("hetpipe_over_best_ddp") is not None:
        lines.append(f"\nhetpipe / best DDP, median time to target: {found['hetpipe_over_best_ddp']:.2f}")
    if found.get("predicted_over_measured") is not None:
        lines.append(
            f"planner's predicted time to target {found['predicted_time_to_target_s']:.1f} s, "
            f"{found['predicted_over_measured']:.2f}x the measured median"
        )
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------- main


@click.command()
@click.option(
    "--task",
    "task_names",
    default="mnist,shakespeare",
    show_default=True,
    help=f"Tasks (comma list of {', '.join(tta_tasks.TASKS)}).",
)
@click.option("--seeds", default="0,1,2", show_default=True, help="Seeds: every system runs once per seed.")
@click.option("--systems", default=",".join(SYSTEMS), show_default=True, help="Systems to run (comma list).")
@click.option(
    "--lrs",
    default=None,
    help="Learning rates to sweep (comma list; default: the task's). One value: no sweep.",
)
@click.option(
    "--lr",
    "fixed_lrs",
    multiple=True,
    metavar="SYSTEM=LR",
    help="Fix SYSTEM's learning rate (no sweep for it), repeatable: e.g. --lr hetpipe=0.004 to compare "
    "hetpipe's tasks at one rate while the peers keep their best.",
)
@click.option(
    "--batches",
    default=None,
    help="Batches per GPU to choose among (comma list; default: the task's). Each system takes its own: "
    "hetpipe by the planner's prediction, the peers by a --rate-probe-s run at each.",
)
@click.option(
    "--rate-probe-s",
    type=float,
    default=30.0,
    show_default=True,
    help="With several batches: training seconds of each peer's rate run per batch.",
)
@click.option(
    "--max-seconds", type=float, default=None, help="Training seconds each run gets (default: the task's)."
)
@click.option(
    "--sweep-samples",
    type=int,
    default=None,
    help="Samples each sweep run trains at most (default: the task's).",
)
@click.option(
    "--checkpoint-every", default=1, show_default=True, help="hetpipe: PS checkpoint every this many clocks."
)
@click.option(
    "--snapshot-every",
    default=4,
    show_default=True,
    help="DDP and pipeline: keep the weights every this many steps.",
)
@click.option(
    "--set",
    "settings",
    multiple=True,
    help="Config override SECTION.KEY=VALUE (TOML value), repeatable; "
    'applied after the task\'s (e.g. ps.aggregation="server").',
)
@click.option(
    "--search-rules/--no-search-rules",
    default=True,
    show_default=True,
    help="hetpipe: let the planner also choose the training rule (schedule, aggregation, mitigation) among "
    "those its calibration measured; --no-search-rules keeps the config's (and --hetpipe-set's).",
)
@click.option(
    "--hetpipe-set",
    "hetpipe_settings",
    multiple=True,
    help="Override for hetpipe's runs only, after the task's (e.g. ps.aggregation=\"mean\"), repeatable.",
)
@testbed_options
@profile_option
@click.option(
    "--work-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=Path("runs/bench/tta"),
    show_default=True,
)
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), default=None, help="Write JSON here.")
@click.option(
    "--plot",
    "plot_path",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="PNG plot (needs matplotlib, the `bench` extra); default: --out with .png (one per task).",
)
@click.option(
    "--table",
    "table_path",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Write the Markdown tables (medians and spread) here.",
)
def main(
    task_names: str,
    seeds: str,
    systems: str,
    lrs: str | None,
    fixed_lrs: tuple[str, ...],
    batches: str | None,
    rate_probe_s: float,
    max_seconds: float | None,
    sweep_samples: int | None,
    checkpoint_every: int,
    snapshot_every: int,
    settings: tuple[str, ...],
    search_rules: bool,
    hetpipe_settings: tuple[str, ...],
    use_testbed: bool,
    testbed_scale: float | None,
    probe_seconds: float,
    cached_profile: bool,
    work_dir: Path,
    out: Path | None,
    plot_path: Path | None,
    table_path: Path | None,
) -> None:
    torch.set_num_threads(1)
    unknown = [t for t in task_names.split(",") if t not in tta_tasks.TASKS]
    bad = [s for s in systems.split(",") if s not in SYSTEMS]
    if unknown or bad:
        raise click.UsageError(
            f"unknown task(s) {unknown} or system(s) {bad}: tasks are {', '.join(tta_tasks.TASKS)}, "
            f"systems {', '.join(SYSTEMS)}"
        )
    fixed = _fixed_lrs(fixed_lrs)
    seed_list = [int(s) for s in seeds.split(",")]
    batch_list = tuple(int(b) for b in batches.split(",")) if batches else ()
    wanted = [s for s in SYSTEMS if s in systems.split(",")]
    began = time.time()
    document: dict[str, Any] = {
        "command": "python launch/bench/time_to_accuracy.py " + shlex.join(sys.argv[1:]),
        "meta": {**peers.env_note()},
        "tasks": {},
        "rows": [],
    }
    tables = []
    for name in task_names.split(","):
        task = tta_tasks.TASKS[name]
        with contextlib.ExitStack() as stack:
            found, rows, png_rows, network = _task(
                task,
                seed_list,
                wanted,
                lrs,
                fixed,
                batch_list,
                rate_probe_s,
                max_seconds,
                sweep_samples,
                checkpoint_every,
                snapshot_every,
                settings,
                hetpipe_settings,
                search_rules,
                use_testbed,
                testbed_scale,
                probe_seconds,
                cached_profile,
                work_dir,
                stack,
            )
        document["tasks"][name] = found
        document["rows"] += rows
        tables.append(markdown(task, Goal(rows[0]["metric"], task.target), found, network) if rows else "")
        print()
        print(tables[-1], flush=True)
        png = plot_path or (out.with_suffix(".png") if out else None)
        if png is not None and rows:
            path = png.with_name(f"{png.stem}-{name}{png.suffix}")
            print(plots.metric_curves(png_rows, rows[0]["metric"], task.target, path))
    document["wall_s"] = round(time.time() - began, 1)
    print(
        f"\nall tasks in {document['wall_s'] / 60:.1f} min; "
        f"load average now {peers.env_note()['loadavg_1_5_15']}"
    )
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(document, indent=1))
        print(f"wrote {out}")
    if table_path is not None:
        table_path.write_text("\n\n".join(tables) + "\n")
        print(f"wrote {table_path}")


def _fixed_lrs(values: tuple[str, ...]) -> dict[str, float]:
    """--lr's SYSTEM=LR pairs as a dict; a usage error names the bad one."""
    fixed: dict[str, float] = {}
    for value in values:
        system, _, lr = value.partition("=")
        try:
            fixed[system] = float(lr)
        except ValueError:
            fixed[system] = math.nan
        if system not in SYSTEMS or not fixed[system] > 0:
            raise click.UsageError(
                f"--lr {value!r}: give SYSTEM=LR with SYSTEM one of {', '.join(SYSTEMS)} and LR a positive "
                "number, e.g. --lr hetpipe=0.004"
            )
    return fixed


def _task(
    task: tta_tasks.Task,
    seeds: list[int],
    systems: list[str],
    lrs: str | None,
    fixed_lrs: dict[str, float],
    batches: tuple[int, ...],
    rate_probe_s: float,
    max_seconds: float | None,
    sweep_samples: int | None,
    checkpoint_every: int,
    snapshot_every: int,
    settings: tuple[str, ...],
    hetpipe_settings: tuple[str, ...],
    search_rules: bool,
    use_testbed: bool,
    testbed_scale: float | None,
    probe_seconds: float,
    cached_profile: bool,
    work_dir: Path,
    stack: contextlib.ExitStack,
) -> tuple[dict[str, Any], list[dict[str, Any]], list[dict[str, Any]], str]:
    if task.pretrain:  # fine-tuning: every system starts from the task's pretrained weights
        init = tta_tasks.pretrained(task, settings, work_dir)
        settings = (*settings, f"model.init={json.dumps(str(init))}")
    config = apply_overrides(load_config(task.config), [*task.overrides, *settings])
    goal = goal_for(model_of(config).task, task.target)
    work = work_dir / task.name / time.strftime("%Y%m%d-%H%M%S")
    print(
        f"== {task.name}: {config.name} with {', '.join(task.overrides)}; target {goal.metric} "
        f"{'>=' if goal.higher_is_better else '<='} {goal.target:g}",
        flush=True,
    )
    profiles_dir = work_dir / "profiles"  # measured afresh (this machine's speed now) unless --cached-profile
    profile = peers.model_profile(config, config.train.batch_size, profiles_dir, refresh=not cached_profile)
    topology, testbed_record = (
        throughput.open_testbed(config, profiles_dir, testbed_scale, probe_seconds, stack)
        if use_testbed
        else (None, None)
    )
    network = "the shaped-network testbed" if topology else "free (loopback; no link costs anything)"
    print(f"network: {network}", flush=True)
    calibration = tta_tasks.calibrated(task, config, goal, work_dir) if task.calibrate else None
    grid = tuple(dict.fromkeys(batches or task.batches or (config.train.batch_size,)))
    benches: dict[int, Bench] = {}
    for b in grid:
        at = config if b == config.train.batch_size else apply_overrides(config, [f"train.batch_size={b}"])
        measured = (
            profile if at is config else peers.model_profile(at, b, profiles_dir, refresh=not cached_profile)
        )
        benches[b] = Bench(
            task,
            at,
            goal,
            work if len(grid) == 1 else work / f"batch{b}",
            measured,
            max_seconds or task.max_seconds,
            checkpoint_every,
            snapshot_every,
            topology,
            hetpipe_settings,
            search_rules,
            calibration,
        )
    swept = [float(v) for v in lrs.split(",")] if lrs else list(task.lrs)
    chosen: dict[str, tuple[int, float]] = {}  # system -> (batch, lr)
    sweeps: dict[str, Any] = {}
    cache: dict[tuple[int, str, tuple[float, ...]], tuple[float, dict[float, float | None], str]] = {}
    for system in systems:
        per_batch: dict[int, dict[str, Any]] = {}
        for b, bench in benches.items():
            if system.startswith("ddp") and not bench.members(system):
                continue
            rates = [fixed_lrs[system]] if system in fixed_lrs else swept
            per_batch[b] = _swept(bench, system, rates, cache, sweep_samples or task.sweep_samples)
        if not per_batch:
            print(f"  {system}: no GPU holds the whole model; left out")
            continue
        batch = next(iter(per_batch))
        if len(per_batch) > 1:
            batch = _choose_batch(system, benches, per_batch, rate_probe_s)
        chosen[system] = (batch, per_batch[batch]["lr"])
        sweeps[system] = {
            **per_batch[batch],
            "batch": batch,
            **({"batches": {str(b): v for b, v in per_batch.items()}} if len(per_batch) > 1 else {}),
        }
    rows = []
    for i, seed in enumerate(seeds):
        order = [s for s in systems if s in chosen]
        order = (
            order[i % len(order) :] + order[: i % len(order)]
        )  # rotate: drift in the machine's speed hits all
        for system in order:
            batch, lr = chosen[system]
            rows.append(benches[batch].run(system, lr, seed))
            r = rows[-1]
            print(
                f"  seed {seed} {system}: {r['time_to_target_s']} s, "
                f"{r['samples_to_target']} samples to target, "
                f"best {r['best']}, {r['samples_per_s']} samples/s",
                flush=True,
            )
    found = {
        "task": task.name,
        "target": goal.target,
        "metric": goal.metric,
        "note": task.note,
        "network": network,
        "sweep": sweeps,
        **summary(rows, [s for s in systems if s in chosen]),
    }
    if testbed_record is not None:
        found["testbed"] = {
            **testbed_record,
            "speed_drift": throughput.speed_drift(config, profiles_dir, testbed_record),
        }
    png_rows = [replace_label(r) for r in rows]
    return found, rows, png_rows, network


def _swept(
    bench: Bench, system: str, swept: list[float], cache: dict[tuple[Any, ...], Any], budget: int
) -> dict[str, Any]:
    """The learning-rate sweep of `system` at the bench's batch (the calibration's own when it ran the same
    grid; settings that train alike share one): its best lr, samples per lr, and its reference samples to
    target (the calibration's 3-seed median when it measured the setting, else the sweep's at the best lr)."""
    setting = bench.setting(system)
    _, _, calibration = bench.plan()
    key = (bench.batch, tta_tasks.sweep_key(setting), tuple(swept))
    measured = calibration.find(setting) if calibration is not None else None
    if key in cache:
        pass
    elif len(swept) == 1:
        cache[key] = (swept[0], {swept[0]: None}, "no sweep")
    elif measured is not None and [lr for lr, _ in measured.sweep] == swept:  # the same sweep, already run
        cache[key] = (measured.lr, dict(measured.sweep), "the calibration's sweep")
    else:
        base = bench.hetpipe_config if system == "hetpipe" else bench.config
        best, found = tta_tasks.sweep_lr(base, setting, swept, bench.goal, budget, bench.task.score_every)
        cache[key] = (best, found, "swept here")
    best, per_lr, source = cache[key]
    samples = measured.median if measured is not None and measured.median is not None else per_lr[best]
    print(
        f"  sweep {system} at batch {bench.batch} ({setting.label}, {source}): "
        + ", ".join(f"lr {k:g} {'-' if v is None else int(v)}" for k, v in per_lr.items())
        + f" samples -> lr {best:g}; {bench.describe(system, best)}",
        flush=True,
    )
    return {
        "lr": best,
        "samples_to_target": {str(k): v for k, v in per_lr.items()},
        "setting": setting.label,
        "source": source,
        "reference_samples": samples,
    }


def _choose_batch(
    system: str, benches: dict[int, Bench], per_batch: dict[int, dict[str, Any]], probe_s: float
) -> int:
    """The batch `system` reaches the target soonest at, by its own rule: hetpipe by the planner's predicted
    time (hetpipe.app.plan_convergence.soonest_batch, as `hetpipe plan --batch`); a peer by its reference
    samples over its rate in a `probe_s` run at that batch. Records each batch's figures in `per_batch`."""
    from hetpipe.app.plan_convergence import soonest_batch

    predicted: dict[int, float | None] = {}
    for b, info in per_batch.items():
        if system == "hetpipe":  # the plan's samples: the calibration's, or its fitted model's
            _, top, _ = benches[b].plan()
            samples, rate, predicted[b] = top.samples_to_target, top.samples_per_s, top.time_to_target_s
        else:
            samples, rate = info["reference_samples"], benches[b].probe(system, info["lr"], probe_s)
            predicted[b] = samples / rate if rate > 0 and samples is not None else None
        info.update(
            priced_samples=samples,
            samples_per_s=round(rate, 1),
            predicted_s=None if predicted[b] is None else round(predicted[b], 1),
        )
    found = soonest_batch(predicted)
    batch = next(iter(per_batch)) if found is None else found
    how = (
        "the planner's prediction"
        if system == "hetpipe"
        else f"reference samples / rate in a {probe_s:g}-s run"
    )
    print(
        f"  batch {system}: "
        + ", ".join(
            f"{b}: {'-' if info['priced_samples'] is None else int(info['priced_samples'])} samples / "
            f"{info['samples_per_s']} samples/s = "
            f"{'-' if info['predicted_s'] is None else info['predicted_s']} s"
            for b, info in per_batch.items()
        )
        + f" -> batch {batch} (by {how})",
        flush=True,
    )
    return batch


def replace_label(r: dict[str, Any]) -> dict[str, Any]:
    return {**r, "label": f"{r['system']} s{r['seed']}"}


if __name__ == "__main__":
    main()
