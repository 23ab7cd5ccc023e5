"""`hetpipe train`: start the PS and every stage of every virtual worker locally, watch them, and finish
the run (final model from the PS, evaluation, summary, merged trace). Also `hetpipe worker` for one VW.

The launcher owns every child: on Ctrl-C or when any child fails it stops them all within seconds and
names the one that failed, with why and its last log lines.
"""

from __future__ import annotations

import json
import os
import queue as queue_mod
import socket
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from hetpipe.config import ClusterConfig, WspConfig
from hetpipe.emulate import cpu_cores, slowdowns
from hetpipe.errors import HetpipeError, UsageError
from hetpipe.evaluate import evaluate
from hetpipe.metrics import MetricsWriter, VwProgress, format_progress, merge_traces
from hetpipe.models import even_split, param_counts
from hetpipe.procs import ChildFailed, ChildGroup
from hetpipe.server.checkpoint import list_manifests
from hetpipe.server.launch import serve_settings
from hetpipe.server.shard import ShardSettings
from hetpipe.worker.ps_client import PSClient
from hetpipe.worker.stage import StageJob, dataset_of, model_of, run_stage

__all__ = ["TrainOptions", "VwLayout", "free_port", "layouts", "train"]


@dataclass(frozen=True)
class VwLayout:
    gpus: tuple[str, ...]
    split: tuple[int, ...]


@dataclass(frozen=True)
class TrainOptions:
    run_dir: Path | None = None  # default: <train.out_dir>/run-<timestamp>
    progress: bool = True
    dump_weights: bool = False
    layouts: tuple[VwLayout, ...] | None = None  # from a plan; default: the config's VWs
    audit: bool = False  # check guarantees L and G at every forward with a tagged-update ledger
    wsp: WspConfig | None = None  # Nm, D and pull mode to run with (a plan's); default: the config's [wsp]


def emulated_slowdowns(config: ClusterConfig, vws: tuple[VwLayout, ...]) -> tuple[dict[str, float], float]:
    """Each GPU's slowdown under emulation (empty when off) and the time scale (the fastest GPU's slowdown)."""
    if not config.emulation.enabled:
        return {}, 1.0
    speeds = {g: config.gpu(g).speed for lay in vws for g in lay.gpus}
    slow = slowdowns(speeds, cpu_cores(), config.emulation.time_scale)
    return slow, min(slow.values())


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def layouts(config: ClusterConfig, spec) -> tuple[VwLayout, ...]:
    """The config's virtual workers with their splits (given, or balanced by parameter count)."""
    if config.allocation.policy != "explicit":
        from hetpipe.cluster import allocate

        groups = [tuple(str(g) for g in vw) for vw in allocate(config, config.allocation.policy)]
        specs = [(g, None) for g in groups]
    else:
        specs = [(tuple(str(g) for g in vw.gpus), vw.layers) for vw in config.virtual_workers]
    counts = param_counts(spec)
    out = []
    for i, (gpus, split) in enumerate(specs):
        if split is not None and sum(split) != spec.num_layers:
            raise UsageError(
                f"{config.path}: virtual_workers[{i}].layers sums to {sum(split)} but model "
                f"{spec.name} has {spec.num_layers} layers: make the counts add up"
            )
        out.append(VwLayout(gpus, tuple(split) if split else tuple(even_split(counts, len(gpus)))))
    if not out:
        raise UsageError(f"{config.path}: no virtual workers: list [[virtual_workers]] or set [allocation] policy")
    return tuple(out)


@dataclass
class Progress:
    """The launcher's view of every VW, fed by the stages' events."""

    layouts: tuple[VwLayout, ...]
    waves: dict[int, int] = field(default_factory=dict)
    loss: dict[int, float] = field(default_factory=dict)
    speed: dict[int, float] = field(default_factory=dict)
    gate_wait: dict[tuple[int, int], float] = field(default_factory=dict)
    pushed: dict[tuple[int, int], int] = field(default_factory=dict)
    audit_checks: int = 0
    max_lead: int = 0
    steps: int = 0  # minibatches finished, over all VWs
    first_step: float | None = None  # when the first and the last of them finished (the stages' clock)
    last_step: float | None = None

    def update(self, event: dict[str, Any]) -> None:
        vw = event.get("vw")
        if event["event"] == "minibatch":
            self.steps += 1
            self.first_step = event["time"] if self.first_step is None else min(self.first_step, event["time"])
            self.last_step = event["time"] if self.last_step is None else max(self.last_step, event["time"])
        if event["event"] == "stage_done":
            self.audit_checks += event.get("audit_checks", 0)
        if event["event"] == "minibatch":
            self.loss[vw] = event["loss"]
            self.speed[vw] = event["samples_per_s"]
        elif event["event"] == "push":
            self.pushed[(vw, event["stage"])] = event["wave"] + 1
            self.gate_wait[(vw, event["stage"])] = event["gate_wait_s"]
            done = [self.completed(v) for v in range(len(self.layouts))]
            self.max_lead = max(self.max_lead, max(done) - min(done))

    def completed(self, vw: int) -> int:
        return min(self.pushed.get((vw, s), 0) for s in range(len(self.layouts[vw].split)))

    def rows(self) -> list[VwProgress]:
        c_global = min(self.completed(v) for v in range(len(self.layouts)))
        return [
            VwProgress(
                vw=v, gpus=",".join(lay.gpus), wave=self.completed(v), loss=self.loss.get(v),
                samples_per_s=self.speed.get(v, 0.0), lead=self.completed(v) - c_global,
                gate_wait_s=max((w for (vv, _), w in self.gate_wait.items() if vv == v), default=0.0),
            )
            for v, lay in enumerate(self.layouts)
        ]


class ProgressView:
    """Redraws the progress block in place on a terminal; prints it every few seconds otherwise."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.tty = sys.stderr.isatty()
        self.lines = 0
        self.last = 0.0

    def show(self, text: str, force: bool = False) -> None:
        now = time.monotonic()
        if not self.enabled or (not force and now - self.last < (0.5 if self.tty else 10.0)):
            return
        self.last = now
        if self.tty and self.lines:
            sys.stderr.write(f"\x1b[{self.lines}F\x1b[J")
        sys.stderr.write(text + "\n")
        sys.stderr.flush()
        self.lines = text.count("\n") + 1


def _start_ps(group: ChildGroup, config: ClusterConfig, run_dir: Path) -> list[str]:
    endpoints = []
    for shard in range(config.ps.shards):
        settings = ShardSettings(
            run=config.name, shard=shard, endpoint=f"tcp://{config.ps.host}:0", staleness=config.wsp.staleness,
            pull_mode=config.wsp.pull, checkpoint_dir=run_dir / "ps" / f"shard-{shard}" if config.checkpoint.enabled else None,
            checkpoint_every=config.checkpoint.every, checkpoint_keep=config.checkpoint.keep,
        )
        port_queue = group.ctx.Queue()
        child = group.start(f"ps-shard-{shard}", serve_settings, settings, port_queue)
        try:
            port = port_queue.get(timeout=60)
        except queue_mod.Empty:
            raise ChildFailed(child) from None
        endpoints.append(f"tcp://{config.ps.host}:{port}")
    return endpoints


def _refuse_earlier_checkpoints(config: ClusterConfig, run_dir: Path) -> None:
    """A run dir that holds PS checkpoints would make the PS resume from them while the stages start at wave 0
    (stages do not resume yet), and every pull would be refused: say so before starting anything."""
    if not config.checkpoint.enabled:
        return
    found = [m for shard in range(config.ps.shards) for m in list_manifests(run_dir / "ps" / f"shard-{shard}")]
    if found:
        raise UsageError(
            f"{run_dir} already holds PS checkpoints of an earlier run ({found[-1]}); a new run would resume the "
            "PS from them while its stages start from wave 0: give a new --run-dir, or remove "
            f"{run_dir / 'ps'} to train from scratch there"
        )


def _device(config: ClusterConfig, gpu: str) -> str:
    if not config.emulation.enabled and torch.cuda.is_available():
        return f"cuda:{int(gpu.split(':')[1]) % torch.cuda.device_count()}"
    return "cpu"


def train(config: ClusterConfig, options: TrainOptions = TrainOptions()) -> dict[str, Any]:
    """Run a whole training job locally; returns the summary."""
    if options.wsp is not None:
        config = replace(config, wsp=options.wsp)
    spec = model_of(config)
    vws = options.layouts or layouts(config, spec)
    run_dir = options.run_dir or Path(config.train.out_dir) / time.strftime("run-%Y%m%d-%H%M%S")
    _refuse_earlier_checkpoints(config, run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    slow, time_scale = emulated_slowdowns(config, vws)
    progress = Progress(vws)
    view = ProgressView(options.progress)
    say = (lambda m: print(m, file=sys.stderr, flush=True)) if options.progress else (lambda m: None)
    say(f"hetpipe train: {config.name}: {len(vws)} virtual workers, model {spec.name}, "
        f"{config.train.waves} waves x nm={config.wsp.nm}, D={config.wsp.staleness}, pull={config.wsp.pull}; run dir {run_dir}")
    for i, lay in enumerate(vws):
        parts = [f"{g} ({config.gpu(g).name}, x{slow.get(g, 1.0):.2f} slower)" if slow else g for g in lay.gpus]
        say(f"  vw{i}: {' -> '.join(parts)}  layers per stage {list(lay.split)}")
    started = time.monotonic()
    group = ChildGroup(log_dir=run_dir / "logs")
    events = group.ctx.Queue()
    failures: dict[str, dict[str, Any]] = {}
    try:
        with MetricsWriter(run_dir / "metrics.jsonl") as metrics:
            endpoints = _start_ps(group, config, run_dir)
            stages = []
            for v, lay in enumerate(vws):
                port = free_port()
                for s in range(len(lay.split)):
                    job = StageJob(
                        config_path=str(config.path), run_dir=str(run_dir), vw=v, stage=s, num_vws=len(vws),
                        gpus=lay.gpus, split=lay.split, ps_endpoints=tuple(endpoints), p2p_port=port,
                        slowdown=slow.get(lay.gpus[s], 1.0), device=_device(config, lay.gpus[s]),
                        dump_weights=options.dump_weights, audit=options.audit, time_scale=time_scale,
                        wsp=config.wsp,
                    )
                    stages.append(group.start(f"vw{v}-s{s}", run_stage, job, events))
            (run_dir / "pids.json").write_text(json.dumps({c.name: c.process.pid for c in group.children}, indent=1))

            def pump() -> None:
                while True:
                    try:
                        event = events.get_nowait()
                    except queue_mod.Empty:
                        break
                    metrics.write(event["event"], **{k: v for k, v in event.items() if k != "event"})
                    if event["event"] == "stage_failed":
                        failures[f"vw{event['vw']}-s{event['stage']}"] = event
                    progress.update(event)
                view.show(format_progress(progress.rows(), config.train.waves, elapsed_s=time.monotonic() - started))

            while any(c.process.exitcode is None for c in stages):
                pump()
                bad = group.failed()
                if bad is not None:
                    raise ChildFailed(bad)
                time.sleep(0.2)
            pump()
            bad = group.failed()
            if bad is not None:
                raise ChildFailed(bad)
            view.show(format_progress(progress.rows(), config.train.waves, elapsed_s=time.monotonic() - started), force=True)
            finished = time.monotonic()
            wall = finished - started
            training = (progress.last_step or 0.0) - (progress.first_step or 0.0)
            with PSClient(endpoints, config.name, 0, 0, len(vws), 1, {}, timeout_s=60, retry_s=5) as admin:
                final = admin.read()
    except ChildFailed as exc:
        group.stop()
        name = exc.child.name
        why = failures.get(name, {}).get("error")
        raise HetpipeError(f"{exc}" + (f"\n{name} failed with {why}" if why else "")) from None
    except KeyboardInterrupt:
        group.stop()
        raise HetpipeError("interrupted: stopped the PS and every stage") from None
    finally:
        group.stop(grace_s=30.0)
    return _finish(config, spec, run_dir, final, wall, training, progress, vws)


def _finish(config, spec, run_dir: Path, final, wall: float, training: float, progress: Progress, vws) -> dict[str, Any]:
    ledgers = {k: v for k, v in final.items() if k.startswith("audit/")}
    state = {k: torch.from_numpy(v.copy()) for k, v in final.items() if not k.startswith("audit/")}
    torch.save(state, run_dir / "model.pt")
    traces = sorted((run_dir / "trace").glob("vw*-s*.json"))
    if traces:
        merge_traces(traces, run_dir / "trace.json")
    dataset = dataset_of(config)
    samples = config.train.waves * config.wsp.nm * config.train.batch_size * len(vws)
    summary: dict[str, Any] = {
        "config": str(config.path), "run_dir": str(run_dir), "model": spec.name, "virtual_workers": len(vws),
        "waves": config.train.waves, "nm": config.wsp.nm, "staleness": config.wsp.staleness,
        "pull": config.wsp.pull, "samples": samples, "wall_s": round(wall, 2),
        # speed over the training itself: the minibatches finished after the first one, over the time from
        # the first to the last (process start-up, data loading, registration and shutdown excluded)
        "train_s": round(training, 2),
        "samples_per_s": round((progress.steps - 1) * config.train.batch_size / max(training, 1e-9), 2),
        "max_lead_waves": progress.max_lead,
        "gate_wait_s": {str(v): round(max((w for (vv, _), w in progress.gate_wait.items() if vv == v), default=0.0), 3)
                        for v in range(len(vws))},
        "final_train_loss": {str(v): progress.loss.get(v) for v in range(len(vws))},
    }
    if ledgers:  # every (vw, minibatch) update must sit in the final weights exactly once
        summary["audit_checks"] = progress.audit_checks
        summary["audit_final_ledgers_exact"] = all(bool((v == 1.0).all()) for v in ledgers.values())
    summary.update(evaluate(spec, state, dataset, batch_size=256))
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=1, sort_keys=True))
    latest = Path(config.train.out_dir) / "latest"
    try:
        if latest.is_symlink() or latest.exists():
            latest.unlink()
        os.symlink(run_dir.resolve(), latest)
    except OSError:
        pass
    return summary


def plan_layouts(config: ClusterConfig, plan_path: Path) -> tuple[tuple[VwLayout, ...], WspConfig]:
    """The VWs, splits, Nm and D of a plan file written by `hetpipe plan --out`."""
    from hetpipe.plan import Plan

    try:
        plan = Plan.from_json(plan_path.read_text())
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise UsageError(f"{plan_path}: not a readable plan file ({exc}); write one with `hetpipe plan --out`") from None
    known = {str(g) for g in config.all_gpus()}
    layers = model_of(config).num_layers
    for vw in plan.vws:
        unknown = [g for g in vw.gpus if g not in known]
        if unknown:
            raise UsageError(f"{plan_path}: GPU {unknown[0]} is not in {config.path}; plan again for this cluster")
        if sum(vw.split) != layers:
            raise UsageError(f"{plan_path}: a split of {sum(vw.split)} layers, but {config.model.name} has {layers}: "
                             "plan again for this config")
    nms = {vw.nm for vw in plan.vws}
    if len(nms) != 1:
        raise UsageError(f"{plan_path}: VWs with different Nm {sorted(nms)}; the runtime runs one Nm for all VWs")
    wsp = replace(config.wsp, nm=nms.pop(), staleness=plan.staleness)
    return tuple(VwLayout(vw.gpus, vw.split) for vw in plan.vws), wsp


def worker_jobs(config: ClusterConfig, vw: int, run_dir: Path) -> list[StageJob]:
    """The stage jobs of VW `vw` for a multi-machine run: the PS at [ps] host:port+i, the VW's P2P
    rendezvous on its first GPU's node at ps.port + 100 + vw (open these ports between the machines)."""
    spec = model_of(config)
    vws = layouts(config, spec)
    if not 0 <= vw < len(vws):
        raise UsageError(f"--vw {vw} is out of range: {config.path} has {len(vws)} virtual workers (0..{len(vws) - 1})")
    lay = vws[vw]
    slow, time_scale = emulated_slowdowns(config, vws)
    return [
        StageJob(
            config_path=str(config.path), run_dir=str(run_dir), vw=vw, stage=s, num_vws=len(vws), gpus=lay.gpus,
            split=lay.split, ps_endpoints=tuple(config.ps_endpoints()), p2p_port=config.ps.port + 100 + vw,
            slowdown=slow.get(lay.gpus[s], 1.0), device=_device(config, lay.gpus[s]),
            p2p_host=config.node(lay.gpus[0].split(":")[0]).host, time_scale=time_scale,
            wsp=config.wsp,
        )
        for s in range(len(lay.split))
    ]


def run_worker(config: ClusterConfig, vw: int, stage: int | None, run_dir: Path) -> None:
    """Run one VW's stages (or one stage) against a running `hetpipe server`; owned children, logs in run_dir."""
    jobs = worker_jobs(config, vw, run_dir)
    if stage is not None:
        if not 0 <= stage < len(jobs):
            raise UsageError(f"--stage {stage} is out of range: vw {vw} has {len(jobs)} stages (0..{len(jobs) - 1})")
        jobs = [jobs[stage]]
    group = ChildGroup(log_dir=run_dir / "logs")
    names = ", ".join(f"vw{job.vw}-s{job.stage}" for job in jobs)
    print(f"hetpipe worker: starting {names} against the PS at {', '.join(config.ps_endpoints())}; "
          f"logs in {run_dir / 'logs'}", file=sys.stderr, flush=True)
    try:
        for job in jobs:
            group.start(f"vw{job.vw}-s{job.stage}", run_stage, job, None)
        group.wait()
        print(f"hetpipe worker: {names} finished {config.train.waves} waves", file=sys.stderr, flush=True)
    except ChildFailed as exc:
        raise HetpipeError(str(exc)) from None
    except KeyboardInterrupt:
        raise HetpipeError("interrupted: stopped this worker's stages") from None
    finally:
        group.stop()
