"""The `hetpipe` command line: a click group whose commands are thin shells over the library."""

from __future__ import annotations

import sys
import time
import traceback
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from hetpipe.core.errors import HetpipeError
from hetpipe.core.pipeline.schedule import DEFAULT_SCHEDULE

if TYPE_CHECKING:
    from hetpipe.core.pipeline.profile_window import ProfileWindow
    from hetpipe.core.runs.testbed import Topology

__all__ = ["main", "cli"]

# when this command started (the zero of `hetpipe train`'s start-up timeline): the interpreter's start and the
# imports above, about 0.1 s, come before it. Not the process's start time: `exec hetpipe` from a script
# (launch/run.sh) keeps the script's.
STARTED = time.time()


class RegistryName(click.ParamType):
    """A name from one of core's registries (schedules, aggregation rules), looked up when the option is
    parsed or its help shown: definitions registered after import, or named "package.module:attr", count
    too."""

    name = "name"

    def __init__(self, registry: str) -> None:
        self.registry = registry  # "schedules" | "aggregations"

    def _lookup(self) -> Any:
        if self.registry == "schedules":
            from hetpipe.core.pipeline.schedule import SCHEDULES

            return SCHEDULES
        from hetpipe.core.wsp.aggregation import AGGREGATIONS

        return AGGREGATIONS

    def get_metavar(self, *args: Any, **kwargs: Any) -> str:
        return "[" + "|".join(self._lookup().names()) + "]"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> str:
        try:
            self._lookup().get(value)
        except HetpipeError as exc:
            self.fail(str(exc), param, ctx)
        return value


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--debug", is_flag=True, help="Show tracebacks for errors.")
@click.version_option(package_name="hetpipe")
@click.pass_context
def cli(ctx: click.Context, debug: bool) -> None:
    """Train DNNs on heterogeneous GPU clusters with pipelined virtual workers and a WSP parameter server."""
    ctx.obj = {"debug": debug}


def _config_option(f):
    return click.option(
        "--config",
        "config_path",
        type=click.Path(dir_okay=False, path_type=Path),
        default=None,
        help="Cluster config TOML (default: the embedded launch/clusters/local.toml).",
    )(f)


def _one_config(positional: Path | None, flag: Path | None) -> Path | None:
    """CONFIG_PATH or --config; both only when they name the same file."""
    from hetpipe.core.errors import UsageError

    if positional is not None and flag is not None and positional.resolve() != flag.resolve():
        raise UsageError(f"two configs given: CONFIG_PATH {positional} and --config {flag}; give one of them")
    return positional if positional is not None else flag


def _set_option(f):
    return click.option(
        "--set",
        "settings",
        multiple=True,
        metavar="KEY.PATH=VALUE",
        help="Override one config field, validated like the file (repeatable), e.g. --set wsp.nm=4 "
        "--set train.schedule=gpipe --set model.options.hidden=[64,64].",
    )(f)


def parse_profile_option(
    _ctx: click.Context, _param: click.Parameter, text: str | None
) -> ProfileWindow | None:
    """click callback of a `--profile FIRST:COUNT` option (here and in launch/bench/gpu.py)."""
    from hetpipe.core.errors import UsageError
    from hetpipe.core.pipeline.profile_window import ProfileWindow

    try:
        return ProfileWindow.parse(text) if text is not None else None
    except UsageError as exc:
        raise click.BadParameter(str(exc)) from None


def _profile_option(f):
    return click.option(
        "--profile",
        metavar="FIRST:COUNT",
        default=None,
        callback=parse_profile_option,
        help="Every stage runs torch.profiler from its forward of minibatch FIRST through the update of "
        "FIRST+COUNT-1 and writes which ops take its host's and device's time, per minibatch, to "
        "<run dir>/profile/vw<V>-s<S>.txt (and .json); e.g. 40:40. The profiled stretch runs slower.",
    )(f)


def _load(config_path: Path | None, settings: tuple[str, ...] = ()):
    from hetpipe.core.config.files import default_config_path, load_config
    from hetpipe.core.config.overrides import apply_overrides

    return apply_overrides(load_config(config_path or default_config_path()), settings)


def _run_config(run_dir: Path, settings: tuple[str, ...]):
    from hetpipe.core.config.files import run_dir_config

    return run_dir_config(run_dir, settings)


@cli.command()
@_config_option
@_set_option
@click.option(
    "--shard", type=int, default=None, help="Serve only this shard (default: all, as child processes)."
)
def server(config_path: Path | None, settings: tuple[str, ...], shard: int | None) -> None:
    """Run the parameter server of a cluster config (Ctrl-C or SIGTERM checkpoints, then stops). Under
    torchrun or an srun step of one task per shard, each process serves the shard of its rank."""
    import os

    from hetpipe.core.runs.roles import shard_of
    from hetpipe.server.jobs import shard_jobs
    from hetpipe.server.launch import serve_all, serve_job

    config = _load(config_path, settings)
    if shard is None:
        shard = shard_of(os.environ, config.ps.shards)
    if shard is None:
        serve_all(config)
    else:
        serve_job(shard_jobs(config, shards=[shard])[0])


@cli.command()
@_config_option
@_set_option
@click.option("--node", required=True, help="The node (a [[nodes]] name) whose relay to run.")
def relay(config_path: Path | None, settings: tuple[str, ...], node: str) -> None:
    """Run a node's relay for [ps] node_aggregation (one per shard, at ps.port + 50 + the node's index x
    shards + the shard): the node's VWs push and pull through it (docs/wsp.md#node-local-aggregation). Start
    it on that node after the PS, before its workers."""
    from hetpipe.app.relay_server import serve_relay
    from hetpipe.app.relays import node_group, relay_jobs
    from hetpipe.compute.build import model_of, vw_layouts
    from hetpipe.core.errors import UsageError
    from hetpipe.core.runs.procs import serve_each

    config = _load(config_path, settings)
    if node not in [n.name for n in config.nodes]:
        names = ", ".join(n.name for n in config.nodes)
        raise UsageError(f"--node {node!r} is not a node of {config.path} (its nodes: {names})")
    vws = vw_layouts(config, model_of(config))
    members = node_group(config, vws, node)
    ports = [int(e.rsplit(":", 1)[1]) for e in config.relay_endpoints(node)]
    jobs = relay_jobs(config, vws, members, config.ps_endpoints(), ports)
    serve_each(jobs, serve_relay, lambda job: f"relay-{node}-{job.settings.shard}", grace_s=10.0)


@cli.command()
@click.option("--stages", type=int, default=4, show_default=True, help="Stages (GPUs) of the virtual worker.")
@click.option(
    "--nm", type=int, default=4, show_default=True, help="Minibatches in flight (a wave is nm minibatches)."
)
@click.option("--waves", type=int, default=2, show_default=True, help="Waves to show.")
@click.option("--staleness", "-D", type=int, default=0, show_default=True, help="Global staleness bound D.")
@click.option(
    "--name",
    type=RegistryName("schedules"),
    default=DEFAULT_SCHEDULE,
    show_default=True,
    help="Schedule name.",
)
@click.option("--lists", is_flag=True, help="Print one action list per stage instead of the step grid.")
def schedule(stages: int, nm: int, waves: int, staleness: int, name: str, lists: bool) -> None:
    """Print a pipeline schedule as a step x stage grid (or as per-stage action lists)."""
    from hetpipe.core.pipeline import schedule as sched

    plan = sched.get_schedule(name)(stages, nm, waves, staleness)
    sched.validate(plan)
    click.echo(sched.format_lists(plan) if lists else sched.format_grid(plan))


@cli.command()
@click.argument("config_path", required=False, type=click.Path(dir_okay=False, path_type=Path))
@click.option(
    "--plan",
    "plan_path",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="A plan file from `hetpipe plan --out` (grouping and splits); default: the config's VWs.",
)
@click.option(
    "--run-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Where metrics, traces, logs and the model go (default: <train.out_dir>/run-<time>).",
)
@click.option(
    "--summary",
    "summary_path",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Also write the summary as JSON here.",
)
@click.option(
    "--tensorboard",
    "tensorboard_dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Also write TensorBoard event files here (needs the tensorboard extra).",
)
@click.option("--quiet", is_flag=True, help="No progress output; print only the summary.")
@click.option(
    "--audit",
    is_flag=True,
    help="Carry a tagged-update ledger and check at every forward what it saw (guarantees L and G).",
)
@click.option(
    "--resume",
    "resume_dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Continue the stopped run in this run dir from the newest wave the PS and every stage "
    "checkpointed (needs [checkpoint] every >= 1); its config.toml unless CONFIG is given.",
)
@click.option(
    "--config",
    "config_flag",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="The cluster config, as CONFIG_PATH (either one; both only if they name the same file).",
)
@_profile_option
@_set_option
def train(
    config_path: Path | None,
    config_flag: Path | None,
    plan_path: Path | None,
    run_dir: Path | None,
    summary_path: Path | None,
    tensorboard_dir: Path | None,
    quiet: bool,
    audit: bool,
    resume_dir: Path | None,
    profile: ProfileWindow | None,
    settings: tuple[str, ...],
) -> None:
    """Train on a cluster config, everything local: the PS and every stage of every virtual worker."""
    from hetpipe.core.errors import UsageError

    config_path = _one_config(config_path, config_flag)
    if resume_dir is not None:
        if run_dir is not None and run_dir != resume_dir:
            raise UsageError("--resume RUN_DIR continues that run in its own dir: leave out --run-dir")
        if plan_path:
            raise UsageError(
                "--resume uses the VWs the run was started with (saved in its dir): leave out --plan"
            )
        if not resume_dir.is_dir():
            raise UsageError(f"--resume {resume_dir}: no such run dir")
        run_dir = resume_dir
    # the config before torch is imported: a bad one fails in well under a second
    config = (
        _load(config_path, settings)
        if config_path or resume_dir is None
        else _run_config(resume_dir, settings)
    )
    if resume_dir is not None:
        from hetpipe.app.resume_check import check_resume

        check_resume(resume_dir, config, audit=audit)

    from hetpipe.app.startup import PRELOAD
    from hetpipe.core.runs.procs import warm_forkserver

    warm_forkserver(
        PRELOAD
    )  # imports torch and the stage code for the children while this process does the same

    from hetpipe.app.train import TrainOptions, apply_plan, check_writable_dir
    from hetpipe.app.train import train as run_train
    from hetpipe.core.errors import UsageError
    from hetpipe.core.runs.summary_text import format_run_summary

    layouts = None
    if plan_path:
        config, layouts = apply_plan(config, plan_path)
    if summary_path:
        check_writable_dir(summary_path.parent, "--summary")  # now, not after the run
    if tensorboard_dir:
        from hetpipe.app.board import check_board

        check_board()
    options = TrainOptions(
        run_dir=run_dir,
        progress=not quiet,
        layouts=layouts,
        audit=audit,
        tensorboard=tensorboard_dir,
        started_at=STARTED,
        resume=resume_dir is not None,
        profile=profile,
    )
    summary = run_train(config, options)
    click.echo(format_run_summary(summary, started=STARTED, also_json=summary_path))
    if summary_path:
        import json

        summary_path.parent.mkdir(parents=True, exist_ok=True)
        summary_path.write_text(json.dumps(summary, indent=1, sort_keys=True))


@cli.command()
@click.argument("run_dir", type=click.Path(file_okay=False, path_type=Path))
@click.option(
    "--out",
    "out_path",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Where to write the rebuilt module (default: RUN_DIR/model-module.pt).",
)
def export(run_dir: Path, out_path: Path | None) -> None:
    """Rebuild the trained nn.Module of a run (its config.toml's model, model.pt's weights) and save it whole.

    Load it with `torch.load(FILE, weights_only=False)`; in Python, `hetpipe.app.export.load_model(RUN_DIR)`
    returns it without writing anything."""
    from hetpipe.app.export import export_model

    out = export_model(run_dir, out_path)
    click.echo(f"wrote {out}: torch.load({str(out)!r}, weights_only=False) gives the trained nn.Module")


@cli.command()
@_config_option
@click.option("--vw", type=int, required=True, help="The virtual worker to run (0-based, in config order).")
@click.option("--stage", type=int, default=None, help="Run only this stage of it (default: all its stages).")
@click.option(
    "--run-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Where logs and traces go (default: runs/worker, or with --join a worker-vw<I>-<time> dir in it).",
)
@click.option(
    "--join",
    "join_dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Join the running `hetpipe train` of this run dir (its PS, keys and config.toml unless --config).",
)
@click.option(
    "--audit",
    is_flag=True,
    help="Carry a tagged-update ledger (give it to every worker of the run; `hetpipe finish` checks it).",
)
@_profile_option
@_set_option
def worker(
    config_path: Path | None,
    vw: int,
    stage: int | None,
    run_dir: Path | None,
    join_dir: Path | None,
    audit: bool,
    profile: ProfileWindow | None,
    settings: tuple[str, ...],
) -> None:
    """Run one virtual worker (or one stage) against a running `hetpipe server`, for clusters of machines; a
    VW the PS evicted after a failure rejoins at the next wave boundary with the current global weights."""
    # the config before torch is imported
    config = (
        _run_config(join_dir, settings)
        if join_dir is not None and config_path is None
        else _load(config_path, settings)
    )
    import os

    from hetpipe.core.planning.cluster import check_vw_index, vw_gpus
    from hetpipe.core.runs.roles import stage_of

    check_vw_index(config, vw)  # before torch is imported: a wrong --vw is refused at once
    if stage is None and join_dir is None:  # torchrun or srun with a process per stage: the stage is the rank
        stage = stage_of(os.environ, vw, len(vw_gpus(config)[vw]))
    from hetpipe.app.startup import PRELOAD
    from hetpipe.core.runs.procs import warm_forkserver

    warm_forkserver(PRELOAD)  # its stages fork ready, as under `hetpipe train`
    from hetpipe.worker.run import run_worker

    run_worker(config, vw, stage, run_dir, join_dir, profile, audit)


@cli.command()
@click.argument("config_path", type=click.Path(dir_okay=False, path_type=Path))
@click.option(
    "--out",
    "out_dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Where to write the keys (default: the config's [ps] keys_dir, else <config>-keys beside it).",
)
@click.option(
    "--plan",
    "plan_path",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Make one key pair per VW of this plan (default: per VW of the config).",
)
@click.option(
    "--force", is_flag=True, help="Replace keys already there (processes using them are locked out)."
)
@_set_option
def keys(
    config_path: Path, out_dir: Path | None, plan_path: Path | None, force: bool, settings: tuple[str, ...]
) -> None:
    """Write the CurveZMQ keys of a cluster: the PS's pair, one pair per virtual worker, and an admin pair."""
    from hetpipe.core.protocol.keys import key_users, write_keys

    config = _load(config_path, settings)
    if plan_path:
        from hetpipe.app.train import apply_plan

        num_vws = len(apply_plan(config, plan_path)[1])
    else:
        from hetpipe.compute.build import model_of, vw_layouts

        num_vws = len(vw_layouts(config, model_of(config)))
    directory = out_dir or Path(config.ps.keys_dir or config_path.with_name(f"{config_path.stem}-keys"))
    write_keys(directory, key_users(num_vws), force=force)
    click.echo(
        f"wrote the PS's key pair, {num_vws} VW key pair{'s' * (num_vws != 1)} and an admin pair to "
        f"{directory} (secret keys *.key_secret, mode 600)"
    )
    if config.ps.auth != "curve" or Path(config.ps.keys_dir or "") != directory:
        click.echo(
            f'use them: set [ps] auth = "curve" and keys_dir = "{directory}" in {config_path}; the PS needs '
            "server.key_secret and the *.key files, a worker server.key and its own vw<I>.key_secret",
            err=True,
        )


@cli.command()
@click.argument("model")
@click.option("--batch", type=click.IntRange(min=1), required=True, help="Minibatch size to profile at.")
@click.option(
    "--gpu-type", default=None, help="Label the profile with this GPU type (default: the device, e.g. cpu)."
)
@click.option("--device", default=None, help="Where to measure: cpu, cuda or cuda:N.  [default: cpu]")
@click.option(
    "--like",
    type=click.Choice(["cpu", "cuda"]),
    default=None,
    help="Measure nothing: derive --gpu-type's profile from a measured profile of this device kind (this "
    "machine's cached one, else the shipped one; for cpu, else measured now), by --speed.",
)
@click.option(
    "--speed",
    type=click.FloatRange(min=0, min_open=True),
    default=None,
    help="With --like: the GPU type's FLOP rate over the measured device's; its times are theirs / RATIO, "
    "memory unchanged.",
)
@click.option(
    "--dtype",
    type=click.Choice(["float32", "bfloat16"]),
    default=None,
    help="Profile the model in this dtype (default: the model's own, float32 for the built-in ones).",
)
@click.option(
    "--optimizer",
    type=click.Choice(["sgd", "momentum", "adam"]),
    default="momentum",
    show_default=True,
    help="Optimizer whose state the profile counts.",
)
@click.option(
    "--option",
    "options",
    multiple=True,
    metavar="KEY=VALUE",
    help="A model option, e.g. --option image_size=32 (repeatable).",
)
@click.option(
    "--repeats", type=click.IntRange(min=1), default=10, show_default=True, help="Timed repeats per layer."
)
@click.option(
    "--refresh", is_flag=True, help="Measure again even when the cache holds the profile, and replace it."
)
@click.option(
    "--out",
    "out_path",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Also write the profile JSON here (e.g. DIR/<gpu-type>.json for `hetpipe plan --profile-dir DIR`).",
)
@click.option(
    "--cache",
    "cache_dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Profile cache directory (default: ~/.cache/hetpipe/profiles).",
)
def profile(
    model: str,
    batch: int,
    gpu_type: str | None,
    device: str | None,
    like: str | None,
    speed: float | None,
    dtype: str | None,
    optimizer: str,
    options: tuple[str, ...],
    repeats: int,
    refresh: bool,
    out_path: Path | None,
    cache_dir: Path | None,
) -> None:
    """Measure MODEL per layer (forward/backward time, weights, optimizer state, activations) and cache it;
    or, with --like, derive a profile for a GPU type this machine does not have."""
    from hetpipe.app.plan_inputs import (
        default_profile_dir,
        like_profile,
        measure_profile,
        model_options,
        profile_table,
    )
    from hetpipe.core.errors import UsageError
    from hetpipe.models import get_model

    if (like is None) != (speed is None) or (like is not None and gpu_type is None):
        raise UsageError(
            "--like, --speed and --gpu-type go together: e.g. --gpu-type titan-v --like cpu --speed 150 "
            "derives a titan-v profile with times / 150 from a measured cpu profile"
        )
    if like is not None and (device is not None or refresh):
        raise UsageError(
            "--like measures nothing on this machine: leave out --device and --refresh (to re-measure "
            f"the {like} profile it starts from, run `hetpipe profile {model} --batch {batch} --device "
            f"{like} --refresh` first)"
        )
    device = device or "cpu"
    if device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise UsageError(
                f"--device {device}: no CUDA device here; profile on the machine with the GPU, use "
                "--device cpu (and --gpu-type to label it), or derive one: --like cuda --speed RATIO"
            )
    elif device != "cpu":
        raise UsageError(f"--device {device!r}: use cpu, cuda or cuda:N")
    spec = get_model(model, **model_options(options))
    cache = cache_dir or default_profile_dir()
    if like is not None:
        assert gpu_type is not None and speed is not None
        found = like_profile(
            spec, batch, gpu_type, cache, like=like, speed=speed, optimizer=optimizer, dtype=dtype
        )
    else:
        found = measure_profile(
            spec,
            batch,
            gpu_type or device,
            cache,
            optimizer=optimizer,
            device=device,
            repeats=repeats,
            dtype=dtype,
            refresh=refresh,
        )
    click.echo(profile_table(found))
    if out_path is not None:
        found.save(out_path)
        click.echo(f"wrote {out_path}", err=True)


@cli.command()
@click.argument("config_path", type=click.Path(dir_okay=False, path_type=Path))
@click.option(
    "--out",
    "out_path",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Write the best plan here, for `hetpipe train CONFIG --plan PLAN`.",
)
@click.option(
    "--all",
    "show_all",
    is_flag=True,
    help="Print every candidate kept, in the order the planner chooses (default: the 5 best distinct plans).",
)
@click.option(
    "--explain", "show_why", is_flag=True, help="Print every candidate and say why each other one lost."
)
@click.option("--json", "as_json", is_flag=True, help="Print the candidates as JSON instead of tables.")
@click.option(
    "--profile-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Profiles: the CPU profile cache under emulation; per-type files <type>.json (or `hetpipe profile` "
    "cache names) for real GPUs, else the model's shipped profile derived by FLOP rate. Default: "
    "~/.cache/hetpipe/profiles.",
)
@click.option(
    "--waves",
    type=click.IntRange(min=3),
    default=10,
    show_default=True,
    help="Waves to simulate per candidate (the prediction leaves out fill and drain).",
)
@click.option(
    "-D",
    "--staleness",
    "d_values",
    type=click.IntRange(min=0),
    multiple=True,
    help="Staleness bounds D to try (repeatable; default 0 1 2 4, plus the config's).",
)
@click.option(
    "--nm-max",
    type=click.IntRange(min=1),
    default=None,
    help="Largest Nm to consider (default: the config's nm or the VW size, whichever is larger).",
)
@click.option(
    "--reserve-gib",
    type=click.FloatRange(min=0),
    default=0.0,
    show_default=True,
    help="Memory per GPU kept free (CUDA context, allocator slack).",
)
@click.option(
    "--policy",
    "policies",
    type=click.Choice(["np", "ed", "hd", "dp", "explicit"]),
    multiple=True,
    help="Only these allocation policies (repeatable; default np, ed, hd, dp and explicit when listed).",
)
@click.option(
    "--schedule",
    "schedules",
    type=RegistryName("schedules"),
    multiple=True,
    help="Only these schedules (repeatable; default all, the config's train.schedule first).",
)
@click.option(
    "--refresh", is_flag=True, help="Emulated configs: measure this machine's CPU profile again first."
)
@click.option(
    "--calibration",
    "calibration_path",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Convergence calibration to rank by time to target (default: the shipped one of the config's "
    "model, batch, optimizer and lr, if any; launch/bench/staleness.py --calibrate writes them).",
)
@click.option(
    "--target",
    type=float,
    default=None,
    help="Rank by time to this target (test accuracy, or validation loss for a language model): the shipped "
    "calibration measured to it (default: the model's default calibration, whatever its target).",
)
@click.option(
    "--search-rules/--no-search-rules",
    default=True,
    show_default=True,
    help="With a calibration: also choose the training rule (the PS's aggregation, the mitigation) among "
    "those it measured, by predicted time to target; --out carries it. --no-search-rules: the config's.",
)
@click.option(
    "--batch",
    "batches",
    type=click.IntRange(min=1),
    multiple=True,
    help="Also choose the minibatch size per GPU among these (repeatable), by predicted time to target: "
    "each batch is planned with its own profiles and the calibration at that batch (a batch without "
    "one is not ranked); --out carries it. Default: the config's train.batch_size.",
)
@click.option(
    "--budget",
    "budget_s",
    type=click.FloatRange(min=0, min_open=True),
    default=None,
    help="Stop the search after this many seconds and plan with the best found so far. "
    "Default: search to the end (the same plan every run).",
)
@click.option(
    "--exhaustive",
    is_flag=True,
    help="Plan and simulate every candidate, as before the fast search (slow on large clusters; always so "
    "with a convergence calibration).",
)
@_set_option
def plan(
    config_path: Path,
    out_path: Path | None,
    show_all: bool,
    show_why: bool,
    as_json: bool,
    profile_dir: Path | None,
    waves: int,
    d_values: tuple[int, ...],
    nm_max: int | None,
    reserve_gib: float,
    policies: tuple[str, ...],
    schedules: tuple[str, ...],
    refresh: bool,
    calibration_path: Path | None,
    target: float | None,
    search_rules: bool,
    batches: tuple[int, ...],
    budget_s: float | None,
    exhaustive: bool,
    settings: tuple[str, ...],
) -> None:
    """Search allocation policy x GPU order, split and Nm (one for all VWs, or each VW its own Nm and batch)
    x D for a cluster; predict each against the cluster's capacity and pick the best."""
    from hetpipe.app.plan_command import PlanRequest, run_plan

    config = _load(config_path, settings)
    if calibration_path is not None and len(set(batches)) > 1:
        raise click.UsageError(
            f"--calibration {calibration_path} holds one batch's samples, but --batch gives "
            f"{len(set(batches))}: drop --calibration to price each batch by its shipped calibration"
        )
    request = PlanRequest(
        config_path=config_path,
        profile_dir=profile_dir,
        waves=waves,
        d_values=d_values,
        nm_max=nm_max,
        reserve_gib=reserve_gib,
        policies=policies,
        schedules=schedules,
        refresh=refresh,
        calibration_path=calibration_path,
        target=target,
        search_rules=search_rules,
        batches=batches,
        budget_s=budget_s,
        exhaustive=exhaustive,
    )
    run_plan(config, request, out_path=out_path, show_why=show_why, as_json=as_json, show_all=show_all)


@cli.command()
@_config_option
@click.option(
    "--run-dir",
    type=click.Path(file_okay=False, path_type=Path),
    required=True,
    help="The run's directory (the workers' --run-dir): model.pt and summary.json go there.",
)
@click.option(
    "--wall-s",
    type=float,
    required=True,
    help="The workers' wall time in seconds, which the summary's speed is measured over.",
)
@click.option("--eval-device", default="cpu", show_default=True, help="Where to evaluate the final model.")
@_set_option
def finish(
    config_path: Path | None, run_dir: Path, wall_s: float, eval_device: str, settings: tuple[str, ...]
) -> None:
    """End a run of `hetpipe server` + `hetpipe worker`s as `hetpipe train` ends one: the final model from the
    running PS as model.pt, its evaluation and summary.json in the run dir (then stop the PS)."""
    from hetpipe.app.finish import finish_run
    from hetpipe.core.runs.summary_text import format_run_summary

    summary = finish_run(_load(config_path, settings), run_dir, wall_s, eval_device)
    click.echo(format_run_summary(summary))


@cli.command()
@click.argument("config_path", type=click.Path(dir_okay=False, path_type=Path))
@click.option(
    "--plan",
    "plan_path",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Run this plan's VWs, splits, Nm, D and schedule (a file from `hetpipe plan --out`).",
)
@click.option(
    "--run-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Where the script, the config and the run go, on storage every node sees (default: "
    "runs/slurm-<cluster>).",
)
@click.option(
    "--address",
    type=click.Choice(["ip", "hostname"]),
    default="ip",
    show_default=True,
    help="How nodes find each other: each node's first address (hostname -I), or its Slurm name (DNS).",
)
@click.option(
    "--gres/--no-gres", default=None, help="Ask for each node's GPUs (default: when emulation is off)."
)
@click.option(
    "--ps-node", default=None, help="The node that runs the PS (default: ps.host's, else the first)."
)
@click.option("--python", default=sys.executable, show_default=True, help="The Python on every node.")
@click.option("--dry-run", is_flag=True, help="Print the script; write nothing.")
@_set_option
def slurm(
    config_path: Path,
    plan_path: Path | None,
    run_dir: Path | None,
    address: str,
    gres: bool | None,
    ps_node: str | None,
    python: str,
    dry_run: bool,
    settings: tuple[str, ...],
) -> None:
    """Write a Slurm batch script that trains CONFIG_PATH on the nodes Slurm gives it: a heterogeneous job,
    one component per node (docs/clusters.md#slurm). Submit it with `sbatch`."""
    from hetpipe.app.slurm_job import slurm_files
    from hetpipe.core.errors import UsageError

    config = _load(config_path, settings)
    run_dir = run_dir or Path("runs") / f"slurm-{config.name}"
    files = slurm_files(
        config, run_dir, plan_path=plan_path, python=python, address=address, gres=gres, ps_node=ps_node
    )
    if dry_run:
        click.echo(files.script, nl=False)
        return
    ran = [n for n in ("model.pt", "summary.json", "logs") if (files.config_path.parent / n).exists()]
    if ran:
        raise UsageError(
            f"{files.config_path.parent} already holds a run ({', '.join(ran)}): give another --run-dir, or "
            "remove that one"
        )
    files.config_path.parent.mkdir(parents=True, exist_ok=True)
    (files.config_path.parent / "logs").mkdir(exist_ok=True)
    files.config_path.write_text(files.config)
    files.script_path.write_text(files.script)
    click.echo(f"wrote {files.script_path} and {files.config_path}; submit with: sbatch {files.script_path}")


@cli.group()
def testbed() -> None:
    """A shaped-network testbed: each node its own network namespace and address, its egress shaped with tbf
    at inter_node_gbps x the link scale (needs root and iproute2; docs/testbed.md)."""


def _testbed_options(f):
    f = click.option(
        "--scale",
        type=click.FloatRange(min=0, min_open=True),
        default=None,
        help="Link scale: links run at inter_node_gbps x this. Default: derived from the model's CPU "
        "profile and FLOPs and the fastest GPU type's speed read as FP32 TFLOPS.",
    )(f)
    f = click.option(
        "--run", "run_id", default=None, help="Run id in the names hp-<run>-... (default: from this PID)."
    )(f)
    f = click.option(
        "--ps-node",
        default=None,
        help="Node whose namespace runs the PS (default: the node whose host is ps.host, else the first).",
    )(f)
    return _set_option(f)


def _testbed_plan(
    config_path: Path, settings: tuple[str, ...], scale: float | None, run_id: str | None, ps_node: str | None
):
    import os

    from hetpipe.core.runs.testbed import plan_topology

    config = _load(config_path, settings)
    if scale is None:
        from hetpipe.app.plan_inputs import default_profile_dir
        from hetpipe.app.testbed import derive_link_scale

        derived = derive_link_scale(config, default_profile_dir())
        click.echo(derived.describe(), err=True)
        scale = derived.scale
    return config, plan_topology(config, run_id or f"{os.getpid():x}", scale, ps_node)


def _nodes_table(topology: Topology, probe: bool) -> str:
    """The testbed's nodes, with every node's egress and inside rates measured when `probe`."""
    from hetpipe.app.testbed import probe_egress, probe_inside
    from hetpipe.core.runs.testbed import format_nodes

    if not probe:
        return format_nodes(topology)
    return format_nodes(topology, probe_egress(topology), inside=probe_inside(topology))


@testbed.command("up")
@click.argument("config_path", type=click.Path(dir_okay=False, path_type=Path))
@_testbed_options
@click.option(
    "--probe/--no-probe",
    default=True,
    show_default=True,
    help="Measure every node's egress and inside rates once up.",
)
def testbed_up(
    config_path: Path,
    settings: tuple[str, ...],
    scale: float | None,
    run_id: str | None,
    ps_node: str | None,
    probe: bool,
) -> None:
    """Build the testbed of CONFIG_PATH and leave it up (until `hetpipe testbed down`)."""
    from hetpipe.app.testbed import up

    config, topology = _testbed_plan(config_path, settings, scale, run_id, ps_node)
    folder = up(topology, config, owner=False)
    click.echo(_nodes_table(topology, probe))
    click.echo(
        f"testbed {topology.run} is up; effective config {folder / 'cluster.toml'}; run a command on a node "
        f"with `ip netns exec {topology.nodes[0].netns} ...`; remove it with `hetpipe testbed down --run "
        f"{topology.run}`"
    )


@testbed.command("down")
@click.option(
    "--run", "run_id", default=None, help="Only this run's testbed (default: every testbed, leftovers too)."
)
def testbed_down(run_id: str | None) -> None:
    """Remove testbed namespaces, bridges and state (idempotent)."""
    from hetpipe.app.testbed import remove

    gone = remove(run_id)
    click.echo(f"removed {', '.join(gone)}" if gone else "nothing to remove")


@testbed.command("run", context_settings={"ignore_unknown_options": True})
@click.argument("config_path", type=click.Path(dir_okay=False, path_type=Path))
@_testbed_options
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
def testbed_run(
    config_path: Path,
    settings: tuple[str, ...],
    scale: float | None,
    run_id: str | None,
    ps_node: str | None,
    command: tuple[str, ...],
) -> None:
    """Build the testbed, run COMMAND (after --) with HETPIPE_TESTBED_CONFIG set, always tear it down.

    COMMAND runs in the root namespace; it starts processes on a node with
    `ip netns exec hp-<run>-<node> ...`. Exits with COMMAND's exit code."""
    from hetpipe.app.testbed import run_command
    from hetpipe.core.runs.testbed import format_nodes

    config, topology = _testbed_plan(config_path, settings, scale, run_id, ps_node)
    click.echo(format_nodes(topology), err=True)
    code, sent = run_command(topology, config, command)
    click.echo("bytes sent per node: " + ", ".join(f"{n} {b}" for n, b in sent.items()), err=True)
    sys.exit(code)


@testbed.command("train")
@click.argument("config_path", type=click.Path(dir_okay=False, path_type=Path))
@_testbed_options
@click.option(
    "--run-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Where traces, logs and the effective config go (default: <train.out_dir>/testbed-<time>).",
)
@click.option(
    "--probe/--no-probe",
    default=True,
    show_default=True,
    help="Measure every node's egress and inside rates first.",
)
def testbed_train(
    config_path: Path,
    settings: tuple[str, ...],
    scale: float | None,
    run_id: str | None,
    ps_node: str | None,
    run_dir: Path | None,
    probe: bool,
) -> None:
    """Train in the testbed as on several machines: `hetpipe server` and `hetpipe worker`s in their nodes'
    namespaces; the testbed is torn down after."""
    import time

    from hetpipe.app.testbed import testbed as shaped
    from hetpipe.app.testbed_train import train_in_testbed

    config, topology = _testbed_plan(config_path, settings, scale, run_id, ps_node)
    run_dir = run_dir or Path(config.train.out_dir) / time.strftime("testbed-%Y%m%d-%H%M%S")
    with shaped(topology, config):
        click.echo(_nodes_table(topology, probe))
        run = train_in_testbed(config, topology, run_dir, say=click.echo)
    click.echo(
        f"{config.train.waves} waves in {run.wall_s:.1f} s; bytes sent per node: "
        + ", ".join(f"{n} {b}" for n, b in run.egress_bytes.items())
        + f"; run dir {run.run_dir}"
    )


def main(argv: list[str] | None = None) -> None:
    """Entry point: run the group, turning HetpipeError into a one-paragraph message and its exit code."""
    debug = "--debug" in (sys.argv[1:] if argv is None else argv)
    try:
        cli.main(args=argv, prog_name="hetpipe", standalone_mode=False)
    except click.exceptions.Abort:
        click.echo("aborted", err=True)
        sys.exit(130)
    except click.ClickException as exc:
        exc.show()
        sys.exit(exc.exit_code)
    except HetpipeError as exc:
        if debug:
            traceback.print_exc()
        click.echo(f"error: {exc}", err=True)
        sys.exit(exc.exit_code)
    except KeyboardInterrupt:
        click.echo("interrupted", err=True)
        sys.exit(130)
