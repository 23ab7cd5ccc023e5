"""The `hetpipe` command line: a click group whose commands are thin shells over the library."""

from __future__ import annotations

import sys
import traceback
from pathlib import Path

import click

from hetpipe.errors import HetpipeError

__all__ = ["main", "cli"]


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


def _load(config_path: Path | None):
    from hetpipe.config import default_config_path, load_config

    return load_config(config_path or default_config_path())


@cli.command()
@_config_option
@click.option("--shard", type=int, default=None, help="Serve only this shard (default: all, as child processes).")
def server(config_path: Path | None, shard: int | None) -> None:
    """Run the parameter server of a cluster config (Ctrl-C or SIGTERM checkpoints, then stops)."""
    from hetpipe.server.launch import run_shard, serve_all

    config = _load(config_path)
    if shard is None:
        serve_all(config)
    else:
        from hetpipe.server.launch import shard_settings

        shard_settings(config, shard)  # validate the index before anything starts
        run_shard(str(config.path), shard)


@cli.command()
@click.option("--stages", type=int, default=4, show_default=True, help="Stages (GPUs) of the virtual worker.")
@click.option("--nm", type=int, default=4, show_default=True, help="Minibatches in flight (a wave is nm minibatches).")
@click.option("--waves", type=int, default=2, show_default=True, help="Waves to show.")
@click.option("--staleness", "-D", type=int, default=0, show_default=True, help="Global staleness bound D.")
@click.option("--name", default="wsp", show_default=True, help="Schedule name.")
@click.option("--lists", is_flag=True, help="Print one action list per stage instead of the step grid.")
def schedule(stages: int, nm: int, waves: int, staleness: int, name: str, lists: bool) -> None:
    """Print a pipeline schedule as a step x stage grid (or as per-stage action lists)."""
    from hetpipe import schedule as sched

    plan = sched.get_schedule(name)(stages, nm, waves, staleness)
    sched.validate(plan)
    click.echo(sched.format_lists(plan) if lists else sched.format_grid(plan))


@cli.command()
@click.argument("config_path", required=False, type=click.Path(dir_okay=False, path_type=Path))
@click.option("--plan", "plan_path", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="A plan file from `hetpipe plan --out` (grouping and splits); default: the config's VWs.")
@click.option("--run-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Where metrics, traces, logs and the model go (default: <train.out_dir>/run-<time>).")
@click.option("--summary", "summary_path", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Also write the summary as JSON here.")
@click.option("--quiet", is_flag=True, help="No progress output; print only the summary.")
@click.option("--audit", is_flag=True,
              help="Carry a tagged-update ledger and check at every forward what it saw (guarantees L and G).")
def train(config_path: Path | None, plan_path: Path | None, run_dir: Path | None, summary_path: Path | None,
          quiet: bool, audit: bool) -> None:
    """Train on a cluster config, everything local: the PS and every stage of every virtual worker."""
    from hetpipe.metrics import format_summary
    from hetpipe.worker.launcher import TrainOptions, plan_layouts
    from hetpipe.worker.launcher import train as run_train

    config = _load(config_path)
    layouts = plan_layouts(config, plan_path) if plan_path else None
    summary = run_train(config, TrainOptions(run_dir=run_dir, progress=not quiet, layouts=layouts, audit=audit))
    click.echo(format_summary(summary))
    if summary_path:
        import json

        summary_path.parent.mkdir(parents=True, exist_ok=True)
        summary_path.write_text(json.dumps(summary, indent=1, sort_keys=True))


@cli.command()
@_config_option
@click.option("--vw", type=int, required=True, help="The virtual worker to run (0-based, in config order).")
@click.option("--stage", type=int, default=None, help="Run only this stage of it (default: all its stages).")
@click.option("--run-dir", type=click.Path(file_okay=False, path_type=Path), default=Path("runs/worker"),
              show_default=True, help="Where logs and traces go.")
def worker(config_path: Path | None, vw: int, stage: int | None, run_dir: Path) -> None:
    """Run one virtual worker (or one stage) against a running `hetpipe server`, for clusters of machines."""
    from hetpipe.worker.launcher import run_worker

    run_worker(_load(config_path), vw, stage, run_dir)


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
