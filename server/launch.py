"""Start parameter-server shards: from their jobs (hetpipe.server.jobs), one in this process or all of a
config's as owned children."""

from __future__ import annotations

from typing import Any

from hetpipe.core.config.schema import ClusterConfig
from hetpipe.core.errors import UsageError
from hetpipe.core.runs.procs import serve_each
from hetpipe.server.jobs import ShardJob, shard_jobs, shard_keys
from hetpipe.server.shard import ShardServer, ShardSettings

__all__ = ["serve_all", "serve_job", "serve_settings"]


def serve_job(job: ShardJob, port_queue: Any = None) -> None:
    """Serve one shard until SIGTERM/SIGINT, putting the port it bound on `port_queue`: the child-process
    entry point of every shard `hetpipe train` and `hetpipe server` start, and `hetpipe server --shard I`
    in-process."""
    serve_settings(job.settings(), port_queue)


def serve_all(config: ClusterConfig) -> None:
    """Serve every shard of the config as child processes; stop all when one fails or on Ctrl-C."""
    shard_keys(config)  # a missing or bad key file: say so before any shard starts
    hosts = {config.shard_host(i) for i in range(config.ps.shards)}
    if len(hosts) > 1:
        each = "; ".join(
            f"`hetpipe server --shard {i}` on {n.name} ({n.host})" for i, n in enumerate(config.nodes)
        )
        raise UsageError(
            f'{config.path}: [ps] placement = "{config.ps.placement}" runs one shard on each node, and the '
            f"nodes have different hosts, so no one machine can serve them all: run {each}"
        )
    serve_each(
        shard_jobs(config),
        serve_job,
        lambda job: f"ps-shard-{job.shard}",
        grace_s=30.0,
        on_interrupt="stopping the shards (they checkpoint first)...",
    )


def serve_settings(settings: ShardSettings, port_queue: Any = None) -> None:
    """Serve a shard from explicit settings, putting its bound port on a queue (serve_job's, and a bare
    shard's that a test or benchmark builds)."""
    ShardServer(settings).serve(ready=port_queue.put if port_queue is not None else None)
