"""`hetpipe train`: start the PS and every stage of every virtual worker locally, watch them, and finish
the run (final model from the PS, evaluation, summary, merged trace, start-up timeline).

The launcher owns every child: on Ctrl-C or when the run cannot go on it stops them all within seconds and
names the one that failed, with why and its last log lines. A PS shard that dies is restarted from its
checkpoint and a failed VW may be evicted (hetpipe.app.supervise, docs/recovery.md); `--resume RUN_DIR`
continues a stopped run from the newest wave the PS and every stage checkpointed. Before starting anything it
checks that every stage fits its GPU's memory (hetpipe.core.planning.fit) and that the run dir is writable;
with [ps] auth = "curve" it makes (or reads) the run's keys and gives each stage its own VW's key pair only.
Children fork from a fork server that imported torch and the stage code once (hetpipe.core.runs.procs), so
they start in milliseconds.
"""

from __future__ import annotations

import json
import os
import queue as queue_mod
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from hetpipe.app.board import EVAL_METRICS, Board
from hetpipe.app.live_eval import LiveEvaluator
from hetpipe.app.progress import Progress, ProgressView
from hetpipe.app.startup import PRELOAD, format_timeline, startup_timeline
from hetpipe.app.supervise import Supervisor
from hetpipe.compute.build import VwLayout, dataset_of, model_of, vw_layouts
from hetpipe.compute.evaluate import evaluate
from hetpipe.compute.sizes import model_sizes
from hetpipe.core.config import ClusterConfig, apply_overrides, config_toml
from hetpipe.core.errors import ConfigError, HetpipeError, UsageError
from hetpipe.core.hardware.devices import stage_device
from hetpipe.core.pipeline.profile_window import ProfileWindow
from hetpipe.core.pipeline.resume import common_cut
from hetpipe.core.planning.fit import memory_error, stage_needs
from hetpipe.core.planning.memory import MemoryRule
from hetpipe.core.protocol.keys import (
    ADMIN,
    ClientKeys,
    ServerKeys,
    client_keys,
    key_users,
    server_keys,
    vw_user,
    write_keys,
)
from hetpipe.core.runs.metrics import MetricsWriter, format_progress, merge_traces
from hetpipe.core.runs.procs import ChildFailed, ChildGroup, free_port, warm_forkserver
from hetpipe.core.wsp.audit import expected_ledger
from hetpipe.models import ModelSpec
from hetpipe.server.checkpoint import list_clocks, list_manifests
from hetpipe.server.launch import serve_settings, shard_settings
from hetpipe.server.shard import ShardSettings
from hetpipe.worker.jobs import cuda_devices, emulated_slowdowns, stage_jobs
from hetpipe.worker.ps_client import PSClient
from hetpipe.worker.snapshot import list_snapshots
from hetpipe.worker.stage import run_stage

__all__ = [
    "RunKeys",
    "TrainOptions",
    "apply_plan",
    "check_memory",
    "check_writable_dir",
    "resume_point",
    "run_keys",
    "train",
]


@dataclass(frozen=True)
class TrainOptions:
    run_dir: Path | None = None  # default: <train.out_dir>/run-<timestamp>
    progress: bool = True
    dump_weights: bool = False
    layouts: tuple[VwLayout, ...] | None = None  # from a plan; default: the config's VWs
    audit: bool = False  # check guarantees L and G at every forward with a tagged-update ledger
    tensorboard: Path | None = None  # also write TensorBoard event files here (the tensorboard extra)
    started_at: float | None = (
        None  # Unix time `hetpipe train` started (the timeline's zero); default: train()'s call
    )
    resume: bool = (
        False  # continue the run in run_dir from its newest wave checkpointed by the PS and every stage
    )
    profile: ProfileWindow | None = (
        None  # every stage runs torch.profiler over these minibatches (<run dir>/profile)
    )


@dataclass(frozen=True)
class RunKeys:
    """The CURVE keys of one run: the shards', each VW's (index = VW) and the launcher's admin pair."""

    server: ServerKeys
    vws: tuple[ClientKeys, ...]
    admin: ClientKeys


def run_keys(config: ClusterConfig, run_dir: Path, num_vws: int) -> RunKeys | None:
    """None for auth = "none"; else the keys of [ps] keys_dir, or a fresh set in <run dir>/keys
    when it is ""."""
    if config.ps.auth == "none":
        return None
    if config.ps.keys_dir:
        directory = Path(config.ps.keys_dir)
    else:
        directory = run_dir / "keys"
        write_keys(directory, key_users(num_vws), force=True)  # this run's own set; an earlier run's is spent
    return RunKeys(
        server=server_keys(directory, num_vws),
        vws=tuple(client_keys(directory, vw_user(v)) for v in range(num_vws)),
        admin=client_keys(directory, ADMIN),
    )


def check_writable_dir(directory: Path, label: str) -> None:
    """Create `directory` if needed and write a probe file in it; UsageError names the path and why not."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=directory):
            pass
    except OSError as exc:
        blocker = next((p for p in (directory, *directory.parents) if p.exists() and not p.is_dir()), None)
        why = f"{blocker} is a file, not a directory" if blocker else (exc.strerror or str(exc))
        raise UsageError(
            f"{label} {directory}: cannot write there ({why}); choose a writable directory"
        ) from None


def check_memory(config: ClusterConfig, spec: ModelSpec, vws: tuple[VwLayout, ...]) -> None:
    """ConfigError when a stage of a VW needs more memory than its GPU type's memory_gib (emulated GPUs
    too)."""
    sizes = model_sizes(spec, config.train.batch_size, config.train.optimizer)
    memory = {g: (config.gpu(g).name, int(config.gpu(g).memory_gib * 2**30)) for lay in vws for g in lay.gpus}
    rule = MemoryRule.of(config, len(vws))
    needs = stage_needs(sizes, [(lay.gpus, lay.split) for lay in vws], memory, rule)
    problem = memory_error(needs, model=spec.name, batch_size=config.train.batch_size, rule=rule)
    if problem:
        raise ConfigError(f"{config.path}: {problem}")


def _non_finite_stop(failures: dict[str, dict[str, Any]], log_dir: Path) -> HetpipeError | None:
    """The error that ends a run whose stage stopped on a NaN or inf loss, or whose update the PS refused as
    non-finite (no traceback: the cause is known)."""
    for name, event in failures.items():
        error = str(event.get("error", ""))
        if error.startswith("NonFiniteLoss") or "non_finite:" in error:
            wave = f" in wave {event['wave']}" if "wave" in event else ""
            fix = (
                ""
                if "on_nan" in error
                else (
                    '; lower train.lr or check the data, or set train.on_nan = "skip" '
                    "to skip such minibatches"
                )
            )
            return HetpipeError(
                f"stage {event['stage']} of virtual worker {event['vw']} ({name}) stopped the run"
                f"{wave}: {error}\n  its log: {log_dir / (name + '.log')}{fix}"
            )
    return None


def _collect_failures(events: Any, failures: dict[str, dict[str, Any]]) -> None:
    """Stage failures still queued when a child's exit was seen first."""
    while True:
        try:
            event = events.get(timeout=0.5)
        except (queue_mod.Empty, OSError, ValueError):
            return
        if event.get("event") == "stage_failed":
            failures[f"vw{event['vw']}-s{event['stage']}"] = event


def _start_ps(
    group: ChildGroup,
    config: ClusterConfig,
    run_dir: Path,
    keys: RunKeys | None,
    resume_clock: int | None = None,
) -> tuple[list[str], list[ShardSettings], list[Any]]:
    endpoints, settings_list, children = [], [], []
    for shard in range(config.ps.shards):
        settings = shard_settings(
            config,
            shard,
            port=0,
            checkpoint_root=run_dir / "ps",
            keys=keys.server if keys else None,
            resume_clock=resume_clock,
        )
        port_queue = group.ctx.Queue()
        child = group.start(f"ps-shard-{shard}", serve_settings, settings, port_queue)
        try:
            port = port_queue.get(timeout=60)
        except queue_mod.Empty:
            raise ChildFailed(child) from None
        endpoint = f"tcp://{config.shard_host(shard)}:{port}"
        endpoints.append(endpoint)
        settings_list.append(replace(settings, endpoint=endpoint))  # a restart listens on the same port
        children.append(child)
    return endpoints, settings_list, children


# After the last wave, how long `hetpipe train` keeps the PS up for the stages of a VW that rejoined through
# `hetpipe worker --join` (not its children) to learn by heartbeat that their last pushes are in a checkpoint.
REJOINED_GRACE_S = 3.0

# Mitigations whose StageCompute state (beyond the optimizer's) stage snapshots do not save
# (worker/snapshot.py).
STATEFUL_MITIGATIONS = ("pipemare", "spectrain")


def resume_point(config: ClusterConfig, run_dir: Path, vws: tuple[VwLayout, ...]) -> int:
    """The newest wave every PS shard and every stage checkpointed in `run_dir`; UsageError saying what is
    missing when there is none."""
    if not config.checkpoint.enabled or config.checkpoint.every < 1 or not config.checkpoint.stages:
        raise UsageError(
            f"--resume {run_dir}: a run can be resumed with [checkpoint] dir not empty, every >= 1 and "
            f"stages = true (this config: dir = {config.checkpoint.dir!r}, every = "
            f"{config.checkpoint.every}, stages = {str(config.checkpoint.stages).lower()})"
        )
    stateful = [m for m in config.train.mitigations if m in STATEFUL_MITIGATIONS]
    if stateful:
        raise UsageError(
            f"--resume {run_dir}: train.mitigation {'+'.join(stateful)} keeps state that stage snapshots "
            "do not hold yet (PipeMare's moving average, SpecTrain's last step or pull), so the run would "
            "not continue as it was; start the run again without --resume"
        )
    ps = [list_clocks(run_dir / "ps" / f"shard-{s}") for s in range(config.ps.shards)]
    stages = {
        (v, j): list_snapshots(run_dir, v, j) for v, lay in enumerate(vws) for j in range(len(lay.split))
    }
    cut = common_cut(ps, list(stages.values()))
    if cut is None:
        shown = "; ".join(
            [f"PS shard {s}: clocks {c or 'none'}" for s, c in enumerate(ps)]
            + [f"vw{v}-s{j}: waves {w or 'none'}" for (v, j), w in stages.items()]
        )
        raise UsageError(
            f"--resume {run_dir}: no wave was checkpointed by every PS shard and every stage ({shown}); "
            "start a new run instead"
        )
    if cut >= config.train.waves:
        raise UsageError(f"--resume {run_dir}: the run finished all {config.train.waves} waves already")
    return cut


def _refuse_earlier_checkpoints(config: ClusterConfig, run_dir: Path) -> None:
    """A run dir that holds PS checkpoints would make the PS resume from them while the stages start at wave 0
    (stages do not resume yet), and every pull would be refused: say so before starting anything."""
    if not config.checkpoint.enabled:
        return
    found = [
        m for shard in range(config.ps.shards) for m in list_manifests(run_dir / "ps" / f"shard-{shard}")
    ]
    if found:
        raise UsageError(
            f"{run_dir} already holds PS checkpoints of an earlier run ({found[-1]}); a new run would "
            "resume the PS from them while its stages start from wave 0: continue that run with --resume, "
            "give a new "
            f"--run-dir, or remove {run_dir / 'ps'} to train from scratch there"
        )


def train(config: ClusterConfig, options: TrainOptions = TrainOptions()) -> dict[str, Any]:
    """Run a whole training job locally (or continue one, options.resume); returns the summary."""
    launcher = {"launcher_ready": time.time()}
    started_at = options.started_at or launcher["launcher_ready"]
    warm_forkserver(PRELOAD)  # the CLI started it already; a no-op then
    spec = model_of(config)
    run_dir = options.run_dir or Path(config.train.out_dir) / time.strftime("run-%Y%m%d-%H%M%S")
    vws = options.layouts or _saved_layouts(run_dir, options.resume) or vw_layouts(config, spec)
    check_memory(config, spec, vws)
    cut = resume_point(config, run_dir, vws) if options.resume else None
    if cut is None:
        _refuse_earlier_checkpoints(config, run_dir)
    if options.audit and config.ps.aggregation == "server":
        raise UsageError(
            '--audit proves the additive rules: ps.aggregation "server" applies no local updates '
            'to tag; audit with aggregation "sum" or "mean"'
        )
    if options.audit and cut is not None and config.wsp.pull == "latest":
        raise UsageError(
            '--resume with --audit needs wsp.pull = "exact": a latest-pull PS cannot forget the updates '
            "of waves after the resume wave, which the VWs that were ahead then compute again"
        )
    if options.profile is not None:
        options.profile.check_fits(config.train.waves, config.wsp.nm)
    check_writable_dir(
        run_dir, "--run-dir" if options.run_dir else f"the run dir (train.out_dir of {config.path})"
    )
    if cut is None:
        (run_dir / "config.toml").write_text(
            config_toml(config)
        )  # the effective config: `hetpipe export` reads it
        (run_dir / "layouts.json").write_text(json.dumps([[list(lay.gpus), list(lay.split)] for lay in vws]))
    keys = (
        run_keys(config, run_dir, len(vws))
        if cut is None or config.ps.keys_dir
        else _saved_keys(config, run_dir, len(vws))
    )
    slow, time_scale = emulated_slowdowns(config, vws)
    eval_device = stage_device(config, vws[0].gpus[0], cuda_devices())
    progress = Progress(vws)
    view = ProgressView(options.progress)
    say = (lambda m: print(m, file=sys.stderr, flush=True)) if options.progress else (lambda m: None)
    say(
        f"hetpipe train: {config.name}: {len(vws)} virtual workers, model {spec.name}, "
        f"{config.train.waves} waves x nm={config.wsp.nm}, D={config.wsp.staleness}, "
        f"pull={config.wsp.pull}; run dir {run_dir}"
        + (f"; resuming from wave {cut}" if cut is not None else "")
    )
    for i, lay in enumerate(vws):
        parts = [
            f"{g} ({config.gpu(g).name}, x{slow.get(g, 1.0):.2f} slower)" if slow else g for g in lay.gpus
        ]
        say(f"  vw{i}: {' -> '.join(parts)}  layers per stage {list(lay.split)}")
    board = Board(options.tensorboard) if options.tensorboard else None
    threads = torch.get_num_threads()
    if torch.device(eval_device).type == "cpu":
        torch.set_num_threads(1)  # live evaluations share the CPU with the stages: one thread, as each stage
    started = time.monotonic()
    group = ChildGroup(log_dir=run_dir / "logs")
    events = group.ctx.Queue()
    failures: dict[str, dict[str, Any]] = {}
    snapshots = config.checkpoint.enabled and config.checkpoint.every >= 1
    trained = False
    try:
        with MetricsWriter(run_dir / "metrics.jsonl") as metrics:
            metrics.write(
                "run_start", at=started_at, config=str(config.path), run_dir=str(run_dir), resumed_from=cut
            )
            launcher["checks_done"] = time.time()
            endpoints, settings, shards = _start_ps(group, config, run_dir, keys, resume_clock=cut)
            launcher["ps_ready"] = time.time()
            (run_dir / "ps.json").write_text(
                json.dumps({"endpoints": endpoints, "run": config.name, "audit": options.audit})
            )  # for `hetpipe worker --join`
            stages = {}
            for v in range(len(vws)):
                jobs = stage_jobs(
                    config,
                    vws,
                    v,
                    run_dir=run_dir,
                    ps_endpoints=tuple(endpoints),
                    p2p_host="127.0.0.1",
                    p2p_port=free_port(),
                    audit=options.audit,
                    dump_weights=options.dump_weights,
                    ps_keys=keys.vws[v] if keys else None,
                    resume_wave=cut or 0,
                    snapshots=snapshots,
                    profile=options.profile,
                )
                stages.update(
                    {
                        (v, job.stage): group.start(f"vw{v}-s{job.stage}", run_stage, job, events)
                        for job in jobs
                    }
                )
            launcher["stages_started"] = time.time()

            def admin() -> PSClient:
                return PSClient(
                    endpoints,
                    config.name,
                    0,
                    0,
                    len(vws),
                    1,
                    {},
                    timeout_s=60,
                    retry_s=1,
                    curve=keys.admin if keys else None,
                )

            def record(event: str, **fields: Any) -> None:
                metrics.write(event, **fields)

            supervisor = Supervisor(
                config, group, run_dir, settings, shards, stages, admin, say=say, record=record
            )
            supervisor.write_pids()
            live = LiveEvaluator(config, spec, endpoints, len(vws), eval_device, keys.admin if keys else None)

            def pump() -> None:
                for source in (events, live.results):
                    while True:
                        try:
                            event = source.get_nowait()
                        except queue_mod.Empty:
                            break
                        fields = {k: v for k, v in event.items() if k not in ("event", "time")}
                        metrics.write(event["event"], at=event.get("time"), **fields)
                        if event["event"] == "stage_failed":
                            failures[f"vw{event['vw']}-s{event['stage']}"] = event
                        progress.update(event)
                        if board is not None:
                            board.write(event, progress)
                        live.wave_done(
                            progress.c_global()
                        )  # per event: every due point is seen, however late
                progress.evicted = set(supervisor.evicted)
                view.show(
                    format_progress(progress.rows(), config.train.waves, elapsed_s=time.monotonic() - started)
                )

            while supervisor.stages_running() or not supervisor.all_live_done(config.train.waves):
                pump()
                supervisor.tick()
                time.sleep(0.2)
            if supervisor.evicted:
                time.sleep(REJOINED_GRACE_S)  # a rejoined worker's stages hear "in a checkpoint" by heartbeat
            pump()
            supervisor.tick()
            view.show(
                format_progress(progress.rows(), config.train.waves, elapsed_s=time.monotonic() - started),
                force=True,
            )
            finished = time.monotonic()
            wall = finished - started
            training = (progress.last_step or 0.0) - (progress.first_step or 0.0)
            with admin() as ps:
                final, infos = ps.read_each()
            live.join()
            pump()
            trained = True
    except ChildFailed as exc:
        group.stop()
        _collect_failures(events, failures)
        stopped = _non_finite_stop(failures, run_dir / "logs")
        if stopped is not None:
            raise stopped from None
        name = exc.child.name
        why = failures.get(name, {}).get("error")
        raise HetpipeError(f"{exc}" + (f"\n{name} failed with {why}" if why else "")) from None
    except KeyboardInterrupt:
        group.stop()
        raise HetpipeError("interrupted: stopped the PS and every stage") from None
    finally:
        group.stop(grace_s=30.0)
        torch.set_num_threads(threads)
        if board is not None and not trained:
            board.close()
    timeline = startup_timeline(started_at, launcher, progress.startup.values(), progress.first_step)
    say(format_timeline(timeline))
    summary = _finish(config, spec, run_dir, final, infos, wall, training, progress, vws, eval_device)
    summary.update(
        startup_s=timeline,
        ps_restarts=sum(supervisor.restarts),
        evicted=sorted(supervisor.evicted),
        resumed_from=cut,
    )
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=1, sort_keys=True))
    final_eval = {k: summary[k] for k in (*EVAL_METRICS, "eval_samples") if k in summary}
    with MetricsWriter(run_dir / "metrics.jsonl") as metrics:
        metrics.write("eval", wave=config.train.waves, final=True, **final_eval)
    if board is not None:
        board.write({"event": "eval", "wave": config.train.waves, **final_eval}, progress)
        board.close()
    return summary


def _saved_layouts(run_dir: Path, resume: bool) -> tuple[VwLayout, ...] | None:
    path = run_dir / "layouts.json"
    if not resume or not path.exists():
        return None
    return tuple(VwLayout(tuple(gpus), tuple(split)) for gpus, split in json.loads(path.read_text()))


def _saved_keys(config: ClusterConfig, run_dir: Path, num_vws: int) -> RunKeys | None:
    """A resumed run with auth = "curve" and no keys_dir reuses the keys it made in <run dir>/keys."""
    if config.ps.auth == "none":
        return None
    directory = run_dir / "keys"
    return RunKeys(
        server=server_keys(directory, num_vws),
        vws=tuple(client_keys(directory, vw_user(v)) for v in range(num_vws)),
        admin=client_keys(directory, ADMIN),
    )


def _finish(
    config,
    spec,
    run_dir: Path,
    final,
    infos,
    wall: float,
    training: float,
    progress: Progress,
    vws,
    eval_device: str,
) -> dict[str, Any]:
    state = {
        k: torch.from_numpy(v.copy())
        for tensors in final
        for k, v in tensors.items()
        if not k.startswith("audit/")
    }
    torch.save(state, run_dir / "model.pt")
    traces = sorted((run_dir / "trace").glob("vw*-s*.json"))
    if traces:
        merge_traces(traces, run_dir / "trace.json")
    dataset = dataset_of(config)
    samples = config.train.waves * config.wsp.nm * config.train.batch_size * len(vws)
    summary: dict[str, Any] = {
        "config": str(config.path),
        "run_dir": str(run_dir),
        "model": spec.name,
        "virtual_workers": len(vws),
        "waves": config.train.waves,
        "nm": config.wsp.nm,
        "staleness": config.wsp.staleness,
        "pull": config.wsp.pull,
        "samples": samples,
        "wall_s": round(wall, 2),
        # speed over the training itself: the minibatches finished after the first one, over the time from
        # the first to the last (process start-up, data loading, registration and shutdown excluded)
        "train_s": round(training, 2),
        "samples_per_s": round((progress.steps - 1) * config.train.batch_size / max(training, 1e-9), 2),
        "max_lead_waves": progress.max_lead,
        "gate_wait_s": {
            str(v): round(max((w for (vv, _), w in progress.gate_wait.items() if vv == v), default=0.0), 3)
            for v in range(len(vws))
        },
        "final_train_loss": {str(v): progress.loss.get(v) for v in range(len(vws))},
        # where each VW's waves went, ms per wave (its slowest stage in each part; see docs/architecture.md)
        "wave_breakdown_ms": progress.breakdown_ms(config.train.waves),
        "evals": progress.evals,
    }
    audit = _audit_ledgers(final, infos, config.wsp.nm)
    if audit is not None:  # every (vw, minibatch) update must sit in the final weights exactly once
        summary["audit_checks"] = progress.audit_checks
        summary["audit_final_ledgers_exact"] = audit["lost"] == audit["duplicated"] == audit["stray"] == 0
        summary["audit_ledger"] = audit
    summary.update(
        evaluate(
            spec, state, dataset, batch_size=256, device=eval_device, max_samples=config.train.eval_samples
        )
    )
    latest = Path(config.train.out_dir) / "latest"
    try:
        if latest.is_symlink() or latest.exists():
            latest.unlink()
        os.symlink(run_dir.resolve(), latest)
    except OSError:
        pass
    return summary


def _audit_ledgers(
    final: list[dict[str, Any]], infos: list[dict[str, Any]], nm: int
) -> dict[str, int] | None:
    """Each shard's final ledgers against what its clock and its VWs' gaps say they must hold: every update of
    a wave a VW contributed exactly once (lost: missing; duplicated: more than once; stray: in a gap)."""
    counts = {"slots": 0, "lost": 0, "duplicated": 0, "stray": 0}
    found = False
    for tensors, info in zip(final, infos, strict=True):
        for key, ledger in tensors.items():
            if not key.startswith("audit/"):
                continue
            found = True
            want = expected_ledger(ledger.shape, nm, info.get("gaps", []), info["c_global"])
            counts["slots"] += ledger.size
            counts["lost"] += int(((want == 1.0) & (ledger < 1.0)).sum())
            counts["duplicated"] += int((ledger > 1.0).sum())
            counts["stray"] += int(((want == 0.0) & (ledger > 0.0) & (ledger <= 1.0)).sum())
    return counts if found else None


def apply_plan(config: ClusterConfig, plan_path: Path) -> tuple[ClusterConfig, tuple[VwLayout, ...]]:
    """The config with a plan's Nm, D, schedule, minibatch size and training rule (aggregation, mitigation),
    and the plan's VWs and splits (a file from `hetpipe plan --out`)."""
    from hetpipe.core.planning.plan import Plan

    try:
        plan = Plan.from_json(plan_path.read_text())
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise UsageError(
            f"{plan_path}: not a readable plan file ({exc}); write one with `hetpipe plan --out`"
        ) from None
    known = {str(g) for g in config.all_gpus()}
    layers = model_of(config).num_layers
    for vw in plan.vws:
        unknown = [g for g in vw.gpus if g not in known]
        if unknown:
            raise UsageError(
                f"{plan_path}: GPU {unknown[0]} is not in {config.path}; plan again for this cluster"
            )
        if sum(vw.split) != layers:
            raise UsageError(
                f"{plan_path}: a split of {sum(vw.split)} layers, but {config.model.name} has {layers}: "
                "plan again for this config"
            )
    nms = {vw.nm for vw in plan.vws}
    if len(nms) != 1:
        raise UsageError(
            f"{plan_path}: VWs with different Nm {sorted(nms)}; the runtime runs one Nm for all VWs"
        )
    config = replace(
        config,
        wsp=replace(config.wsp, nm=nms.pop(), staleness=plan.staleness),
        train=replace(
            config.train,
            schedule=plan.schedule,
            recompute=plan.recompute,
            batch_size=plan.batch_size or config.train.batch_size,
        ),
    )
    rule = []
    if plan.aggregation:
        rule.append(f'ps.aggregation="{plan.aggregation}"')
    if plan.mitigation:
        rule.append(f'train.mitigation="{plan.mitigation}"')
    try:
        config = apply_overrides(config, rule)
    except ConfigError as exc:
        raise UsageError(
            f"{plan_path}: its training rule ({', '.join(rule)}) does not fit: {exc}; plan again for "
            "this config"
        ) from None
    return config, tuple(VwLayout(vw.gpus, vw.split) for vw in plan.vws)
