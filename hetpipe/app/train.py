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

This module settles the run, starts its children and ties the parts together: the checks are in
hetpipe.app.train_guards, the watching of a started run in hetpipe.app.train_loop, the final model, evaluation
and summary numbers in hetpipe.app.train_summary.
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from hetpipe.app.board import EVAL_METRICS, Board
from hetpipe.app.live_eval import LiveEvaluator
from hetpipe.app.progress import Progress, ProgressView
from hetpipe.app.relays import start_relays
from hetpipe.app.span_starts import LaterVw, SpanStarts, starts_after
from hetpipe.app.startup import PRELOAD, format_timeline, startup_timeline
from hetpipe.app.supervise import Supervisor
from hetpipe.app.train_guards import (
    check_memory,
    check_options,
    check_work,
    check_writable_dir,
    interrupted,
    refuse_earlier_checkpoints,
    resume_point,
)
from hetpipe.app.train_loop import RunWatch, failure_error
from hetpipe.app.train_summary import run_summary
from hetpipe.compute.build import VwLayout, check_init, handover_sources, model_of, vw_layouts
from hetpipe.core.config.overrides import apply_overrides
from hetpipe.core.config.parse import planned_span_conflicts
from hetpipe.core.config.schema import ClusterConfig
from hetpipe.core.config.serialize import config_toml
from hetpipe.core.errors import ConfigError, HetpipeError, UsageError
from hetpipe.core.hardware.devices import stage_device
from hetpipe.core.pipeline.profile_window import ProfileWindow
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
from hetpipe.core.runs.metrics import MetricsWriter
from hetpipe.core.runs.procs import ChildFailed, ChildGroup, free_port, warm_forkserver
from hetpipe.core.runs.run_lock import RunLock, lock_run_dir
from hetpipe.core.wsp.work import VwWork
from hetpipe.models import ModelSpec
from hetpipe.server.jobs import ShardJob, shard_jobs
from hetpipe.server.launch import serve_job
from hetpipe.worker.jobs import cuda_devices, emulated_slowdowns, stage_jobs
from hetpipe.worker.ps_client import PSClient
from hetpipe.worker.stage import run_stage

if TYPE_CHECKING:
    from hetpipe.core.planning.plan import Plan

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


def _start_ps(
    group: ChildGroup,
    config: ClusterConfig,
    run_dir: Path,
    keys: RunKeys | None,
    resume_clock: int | None = None,
) -> tuple[list[str], list[ShardJob], list[Any]]:
    """One child per PS shard, each on a free port it reports; returns the endpoints, each shard's job with
    the port it listens on (a restart listens on the same one), and the children."""
    endpoints, placed, children = [], [], []
    jobs = shard_jobs(
        config,
        port=0,
        checkpoint_root=run_dir / "ps",
        keys=keys.server if keys else None,
        resume_clock=resume_clock,
    )
    for job in jobs:
        child, port = group.start_listening(f"ps-shard-{job.shard}", serve_job, job)
        endpoints.append(f"tcp://{config.shard_host(job.shard)}:{port}")
        placed.append(replace(job, port=port))
        children.append(child)
    return endpoints, placed, children


@dataclass(frozen=True)
class _Run:
    """One run as settled before anything starts: what it trains, where, from which wave, with which keys."""

    config: ClusterConfig
    options: TrainOptions
    spec: ModelSpec
    run_dir: Path
    vws: tuple[VwLayout, ...]
    cut: int | None  # the wave a resumed run continues from; None for a new run
    keys: RunKeys | None
    slow: dict[str, float]  # each emulated GPU's slowdown; empty without emulation
    eval_device: str
    started_at: float  # the start-up timeline's zero
    launcher: dict[str, float]  # the launcher's own start-up moments (Unix time), filled in as it goes
    lock: RunLock  # the run dir's, held until train() returns (and by every child while it lives)


def train(config: ClusterConfig, options: TrainOptions = TrainOptions()) -> dict[str, Any]:
    """Run a whole training job locally (or continue one, options.resume); returns the summary. The run dir
    is locked while this or any of its children runs (hetpipe.core.runs.run_lock)."""
    run = _settle(config, options)
    try:
        return _train(run)
    finally:
        run.lock.release()


def _train(run: _Run) -> dict[str, Any]:
    """Start, watch and finish the settled run."""
    config, options = run.config, run.options
    progress = Progress(run.vws, start_wave=run.cut or 0, num_waves=config.train.waves)
    view = ProgressView(options.progress)
    say = (lambda m: print(m, file=sys.stderr, flush=True)) if options.progress else (lambda m: None)
    _announce(run, say)
    board = Board(options.tensorboard) if options.tensorboard else None
    threads = torch.get_num_threads()
    if torch.device(run.eval_device).type == "cpu":
        torch.set_num_threads(1)  # live evaluations share the CPU with the stages: one thread, as each stage
    started = time.monotonic()
    group = ChildGroup(log_dir=run.run_dir / "logs", hold=run.lock.fd)  # each child keeps the dir locked
    events = group.ctx.Queue()
    failures: dict[str, dict[str, Any]] = {}
    trained = False
    try:
        with MetricsWriter(run.run_dir / "metrics.jsonl") as metrics:
            endpoints, jobs, shards, relays, stages, starts = _launch(run, group, events, metrics)
            admin = _admin_client(run, endpoints)
            supervisor = Supervisor(
                config,
                group,
                run.run_dir,
                jobs,
                shards,
                stages,
                admin,
                say=say,
                record=metrics.write,
                relays=relays,
            )
            supervisor.write_pids()
            live = LiveEvaluator(
                config,
                run.spec,
                endpoints,
                len(run.vws),
                run.eval_device,
                run.keys.admin if run.keys else None,
            )
            watch = RunWatch(
                config, events, metrics, failures, progress, view, board, supervisor, live, started, starts
            )
            wall, training = watch.until_done()
            with admin() as ps:
                final, infos = ps.read_each()
            live.join()
            watch.pump()
            trained = True
    except ChildFailed as exc:
        group.stop()
        raise failure_error(exc, events, failures, run.run_dir / "logs") from None
    except KeyboardInterrupt:
        group.stop()
        raise HetpipeError(interrupted(config, run.run_dir)) from None
    finally:
        group.stop(grace_s=30.0)
        torch.set_num_threads(threads)
        if board is not None and not trained:
            board.close()
    return _close(run, (final, infos, wall, training), progress, supervisor, board, say)


def _settle(config: ClusterConfig, options: TrainOptions) -> _Run:
    """Everything decided before a process starts: the model, the run dir, the VWs and their splits, the
    wave a resumed run continues from, the checks (guards), the run dir's config and layouts, the keys."""
    launcher = {"launcher_ready": time.time()}
    started_at = options.started_at or launcher["launcher_ready"]
    warm_forkserver(PRELOAD)  # the CLI started it already; a no-op then
    spec = model_of(config)
    run_dir = options.run_dir or Path(config.train.out_dir) / time.strftime("run-%Y%m%d-%H%M%S")
    vws = options.layouts or _saved_layouts(run_dir, options.resume) or vw_layouts(config, spec)
    check_memory(config, spec, vws)
    check_work(config, vws)
    check_init(config, spec)
    # before the run dir is made: a refused option leaves nothing behind
    check_options(config, audit=options.audit, resuming=options.resume, profile=options.profile)
    with contextlib.ExitStack() as undo:  # the lock is let go if a later check fails
        lock = _lock(config, options, run_dir)
        undo.callback(lock.release)
        cut = resume_point(config, run_dir, vws) if options.resume else None
        if cut is None:
            refuse_earlier_checkpoints(config, run_dir)
        if cut is None:
            (run_dir / "config.toml").write_text(
                config_toml(config)
            )  # the effective config: `hetpipe export` reads it
            (run_dir / "layouts.json").write_text(
                json.dumps([[list(lay.gpus), list(lay.split), lay.nm, lay.batch, lay.waves] for lay in vws])
            )
        keys = (
            run_keys(config, run_dir, len(vws))
            if cut is None or config.ps.keys_dir
            else _saved_keys(config, run_dir, len(vws))
        )
        slow, _ = emulated_slowdowns(config, vws)
        eval_device = stage_device(config, vws[0].gpus[0], cuda_devices())
        undo.pop_all()
    return _Run(config, options, spec, run_dir, vws, cut, keys, slow, eval_device, started_at, launcher, lock)


def _lock(config: ClusterConfig, options: TrainOptions, run_dir: Path) -> RunLock:
    """The run dir, made if new, locked for this run before anything reads or writes it; UsageError when
    another run holds it."""
    check_writable_dir(
        run_dir, "--run-dir" if options.run_dir else f"the run dir (train.out_dir of {config.path})"
    )
    return lock_run_dir(run_dir)


def _announce(run: _Run, say: Callable[[str], None]) -> None:
    """The run's headline and one line per VW (its GPUs, their slowdowns, its layers per stage)."""
    config, vws, slow, cut = run.config, run.vws, run.slow, run.cut
    say(
        f"hetpipe train: {config.name}: {len(vws)} virtual workers, model {run.spec.name}, "
        f"{config.train.waves} waves x {_work_text(config, vws)}, D={config.wsp.staleness}, "
        f"pull={config.wsp.pull}; run dir {run.run_dir}"
        + (f"; resuming from wave {cut}" if cut is not None else "")
    )
    for i, lay in enumerate(vws):
        parts = [_gpu_text(g, config.gpu(g).name, slow.get(g), config.emulation.device) for g in lay.gpus]
        work = lay.work(config)
        span = f", waves {lay.waves[0]}-{lay.waves[1] - 1}" if lay.waves else ""  # a re-plan's VW
        say(
            f"  vw{i}: {' -> '.join(parts)}  layers per stage {list(lay.split)}, a wave of {work.nm} x "
            f"{work.batch} samples{span}"
        )


def _gpu_text(gpu: str, type_name: str, slowdown: float | None, device: str) -> str:
    """ "n0:1 (slow, emulated: 4.00x slower than this CPU)": under emulation each block of a GPU's compute
    takes `slowdown` times its own time on the device that runs it (docs/emulation.md#slowdowns); else
    "n0:1"."""
    if slowdown is None:
        return gpu
    runs_on = "this CPU" if device == "cpu" else "this machine's CUDA device"
    return f"{gpu} ({type_name}, emulated: {slowdown:.2f}x slower than {runs_on})"


def _work_text(config: ClusterConfig, vws: tuple[VwLayout, ...]) -> str:
    """ "nm=4" when every VW runs the config's Nm and batch, else "per-VW work" (each VW's line says it)."""
    if {lay.work(config) for lay in vws} == {VwWork(config.wsp.nm, config.train.batch_size)}:
        return f"nm={config.wsp.nm}"
    return "per-VW work (below)"


def _launch(
    run: _Run, group: ChildGroup, events: Any, metrics: MetricsWriter
) -> tuple[list[str], list[ShardJob], list[Any], list[Any], dict[tuple[int, int], Any], SpanStarts]:
    """Record the run's start, start the PS shards, node aggregation's relays, then every stage of every VW,
    stamping the launcher's start-up moments; returns the shards' endpoints, jobs and children, the relays'
    children, the stages', and the VWs whose stages start later."""
    config, run_dir = run.config, run.run_dir
    metrics.write(
        "run_start", at=run.started_at, config=str(config.path), run_dir=str(run_dir), resumed_from=run.cut
    )
    run.launcher["checks_done"] = time.time()
    endpoints, jobs, shards = _start_ps(group, config, run_dir, run.keys, resume_clock=run.cut)
    run.launcher["ps_ready"] = time.time()
    (run_dir / "ps.json").write_text(
        json.dumps({"endpoints": endpoints, "run": config.name, "audit": run.options.audit})
    )  # for `hetpipe worker --join`
    per_vw, relays = start_relays(group, config, run.vws, endpoints)  # node aggregation's, if on
    stages, starts = _start_stages(run, group, per_vw, events)
    run.launcher["stages_started"] = time.time()
    return endpoints, jobs, shards, relays, stages, starts


def _start_stages(
    run: _Run, group: ChildGroup, endpoints: list[list[str]], events: Any
) -> tuple[dict[tuple[int, int], Any], SpanStarts]:
    """One child per stage of every VW, each given its StageJob and the event queue; keyed by (VW, stage).
    `endpoints[v]`: where VW v's stages find the PS (its node's relays under node aggregation). A VW planned
    to train later waves on GPUs that earlier VWs use is held back (the returned SpanStarts starts it)."""
    config, vws, options = run.config, run.vws, run.options
    snapshots = config.checkpoint.enabled and config.checkpoint.every >= 1

    def start(later: LaterVw) -> dict[tuple[int, int], Any]:
        return {
            (later.vw, job.stage): group.start(f"vw{later.vw}-s{job.stage}", run_stage, job, events)
            for job in later.jobs
        }

    starts = SpanStarts(start)
    stages = {}
    cut = run.cut or 0
    held = starts_after(vws, config.train.waves, handover_sources(config, vws))
    for v in range(len(vws)):
        first, end = vws[v].span(config.train.waves)
        if end <= cut:
            continue  # a VW planned to end by the wave the run resumes from has done its part
        jobs = stage_jobs(
            config,
            vws,
            v,
            run_dir=run.run_dir,
            ps_endpoints=tuple(endpoints[v]),
            p2p_host="127.0.0.1",
            p2p_port=free_port(),
            audit=options.audit,
            dump_weights=options.dump_weights,
            ps_keys=run.keys.vws[v] if run.keys else None,
            resume_wave=cut if first < cut else 0,  # one planned to start at the cut or later starts there
            snapshots=snapshots,
            profile=options.profile,
        )
        later = LaterVw(v, jobs, held.get(v, ()))
        if later.after:
            starts.pending.append(later)
        else:
            stages.update(start(later))
    return stages, starts


def _admin_client(run: _Run, endpoints: list[str]) -> Callable[[], PSClient]:
    """Makes the launcher's own PS client (with the admin key under CURVE): for the supervisor and the final
    read of the weights."""
    config, keys = run.config, run.keys

    def admin() -> PSClient:
        return PSClient(
            endpoints,
            config.name,
            0,
            0,
            len(run.vws),
            1,
            {},
            timeout_s=60,
            retry_s=1,
            curve=keys.admin if keys else None,
        )

    return admin


def _close(
    run: _Run,
    outcome: tuple[list[dict[str, Any]], list[dict[str, Any]], float, float],
    progress: Progress,
    supervisor: Supervisor,
    board: Board | None,
    say: Callable[[str], None],
) -> dict[str, Any]:
    """After every child stopped: say the start-up timeline, make the summary (run_summary, from `outcome`:
    the shards' final tensors and infos, the wall and training seconds), complete it (timeline, PS restarts,
    evictions), write summary.json and record the final evaluation in metrics.jsonl and TensorBoard."""
    config, run_dir = run.config, run.run_dir
    final, infos, wall, training = outcome
    timeline = startup_timeline(run.started_at, run.launcher, progress.startup.values(), progress.first_step)
    say(format_timeline(timeline))
    summary = run_summary(
        config, run.spec, run_dir, final, infos, wall, training, progress, run.vws, run.eval_device
    )
    summary.update(
        startup_s=timeline,
        ps_restarts=sum(supervisor.restarts),
        evicted=sorted(supervisor.evicted),
        resumed_from=run.cut,
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
    return tuple(_layout_of(row) for row in json.loads(path.read_text()))


def _layout_of(row: list[Any]) -> VwLayout:
    """A VW of layouts.json: [gpus, split, nm, batch, waves] (older runs' rows stop after split or batch)."""
    gpus, split, nm, batch, waves = [*row, 0, 0, None][:5]
    return VwLayout(tuple(gpus), tuple(split), nm, batch, tuple(waves) if waves else None)


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


def apply_plan(config: ClusterConfig, plan_path: Path) -> tuple[ClusterConfig, tuple[VwLayout, ...]]:
    """The config with a plan's Nm, D, schedule, minibatch size and training rule (aggregation, mitigation),
    and the plan's VWs and splits (a file from `hetpipe plan --out`); with re-plans at freeze points, every
    plan's VWs, each training its plan's waves (docs/wsp.md#planned-spans)."""
    from hetpipe.app.plan_replan import plan_phases, spanned_layouts

    try:
        phases = plan_phases(plan_path.read_text())
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise UsageError(
            f"{plan_path}: not a readable plan file ({exc}); write one with `hetpipe plan --out`"
        ) from None
    plan = phases[0][1]
    known = {str(g) for g in config.all_gpus()}
    layers = model_of(config).num_layers
    for wave, phase in phases:
        _check_plan_phase(config, plan_path, plan, wave, phase, known, layers)
    config = replace(
        config,
        wsp=replace(config.wsp, nm=plan.vws[0].nm, staleness=plan.staleness),
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
    if len(phases) > 1:
        for field, what, (why, fix) in planned_span_conflicts(config.ps, config.train):
            raise UsageError(
                f"{plan_path} re-plans at wave {phases[1][0]}, but {config.path}'s {field} {what}: {why}; "
                f"{fix}, or plan without [train] freeze"
            )
    return config, spanned_layouts(phases, config.train.batch_size, config.train.waves)


def _check_plan_phase(
    config: ClusterConfig, plan_path: Path, first: Plan, wave: int, plan: Plan, known: set[str], layers: int
) -> None:
    """UsageError for a plan (or a re-plan from `wave`) this config cannot run."""
    where = f"{plan_path}" if wave == 0 else f"{plan_path} (its re-plan at wave {wave})"
    for vw in plan.vws:
        unknown = [g for g in vw.gpus if g not in known]
        if unknown:
            raise UsageError(
                f"{where}: GPU {unknown[0]} is not in {config.path}; plan again for this cluster"
            )
        if sum(vw.split) != layers:
            raise UsageError(
                f"{where}: a split of {sum(vw.split)} layers, but {config.model.name} has {layers}: "
                "plan again for this config"
            )
    if (plan.staleness, plan.schedule, plan.batch_size) != (
        first.staleness,
        first.schedule,
        first.batch_size,
    ):
        raise UsageError(f"{where}: its D, schedule or batch differ from the first plan's; plan again")
    if not 0 <= wave < config.train.waves:
        raise UsageError(f"{where}: wave {wave} is outside the run's {config.train.waves} waves; plan again")
