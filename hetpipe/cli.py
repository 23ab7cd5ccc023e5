"""The `hetpipe` command line: a click group whose commands are thin shells over the library."""

from __future__ import annotations

import sys
import traceback

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
