"""Start parameter-server shards from a cluster config: one in this process, or all as owned children."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from hetpipe.core.config import ClusterConfig, pack_config, unpack_config
from hetpipe.core.errors import UsageError
from hetpipe.core.protocol.keys import ServerKeys, server_keys
from hetpipe.core.runs.procs import ChildGroup
from hetpipe.server.shard import ShardServer, ShardSettings

__all__ = ["run_shard", "serve_all", "serve_settings", "shard_keys", "shard_settings"]


def shard_keys(config: ClusterConfig) -> ServerKeys | None:
    """The shards' CURVE keys from [ps] keys_dir when auth = "curve" (None for "none")."""
    if config.ps.auth == "none":
        return None
    if not config.ps.keys_dir:
        raise UsageError(
            f'{config.path}: [ps] auth = "curve" but keys_dir is empty: a PS started on its own needs the '
            "keys its workers share; run `hetpipe keys CONFIG --out DIR` and set [ps] keys_dir = DIR"
        )
    return server_keys(Path(config.ps.keys_dir))


def shard_settings(
    config: ClusterConfig,
    shard: int,
    port: int | None = None,
    checkpoint_root: Path | None = None,
    keys: ServerKeys | None = None,
    resume_clock: int | None = None,
) -> ShardSettings:
    """The settings of shard `shard`: it listens on ps.port + shard unless `port` is given (0: any) and
    checkpoints under [checkpoint] dir (or `checkpoint_root`) in shard-<i>, unless checkpoints are off.
    With auth = "curve" it admits `keys` (default: those of [ps] keys_dir). `resume_clock`: start from that
    checkpoint, cut back to it (hetpipe train --resume)."""
    if not 0 <= shard < config.ps.shards:
        raise UsageError(f"--shard {shard} is out of range: {config.path} has ps.shards = {config.ps.shards}")
    if config.ps.auth == "curve" and keys is None:
        keys = shard_keys(config)
    ckpt = config.checkpoint
    return ShardSettings(
        run=config.name,
        shard=shard,
        endpoint=f"tcp://{config.shard_host(shard)}:{config.ps.port + shard if port is None else port}",
        staleness=config.wsp.staleness,
        pull_mode=config.wsp.pull,
        checkpoint_dir=Path(checkpoint_root or ckpt.dir) / f"shard-{shard}" if ckpt.enabled else None,
        checkpoint_every=ckpt.every,
        checkpoint_keep=ckpt.keep,
        aggregation=config.ps.aggregation,
        optimizer=config.train.optimizer,
        lr=config.train.lr,
        momentum=config.train.momentum,
        weight_decay=config.train.weight_decay,
        keys=keys if config.ps.auth == "curve" else None,
        on_vw_failure=config.ps.on_vw_failure,
        hung_after_s=config.ps.hung_after_s,
        resume_clock=resume_clock,
        wire_dtype=config.ps.wire_dtype,
    )


def run_shard(packed_config: bytes, shard: int) -> None:
    """Serve one shard in this process until SIGTERM/SIGINT (child-process entry point too)."""
    ShardServer(shard_settings(unpack_config(packed_config), shard)).serve()


def serve_all(config: ClusterConfig) -> None:
    """Serve every shard of the config as child processes; stop all when one fails or on Ctrl-C."""
    shard_keys(config)  # a missing or bad key file: say so before any shard starts
    hosts = {config.shard_host(i) for i in range(config.ps.shards)}
    if len(hosts) > 1:
        each = "; ".join(
            f"`hetpipe server --shard {i}` on {n.name} ({n.host})" for i, n in enumerate(config.nodes)
        )
        raise UsageError(
            f'{config.path}: [ps] placement = "local" runs one shard on each node, and the nodes have '
            f"different hosts, so no one machine can serve them all: run {each}"
        )
    if config.ps.shards == 1:
        run_shard(pack_config(config), 0)
        return
    group = ChildGroup()
    try:
        for shard in range(config.ps.shards):
            group.start(f"ps-shard-{shard}", run_shard, pack_config(config), shard)
        group.wait()
    except KeyboardInterrupt:
        print("stopping the shards (they checkpoint first)...", file=sys.stderr)
    finally:
        group.stop(grace_s=30.0)


def serve_settings(settings: ShardSettings, port_queue: Any = None) -> None:
    """Child-process entry point: serve a shard from explicit settings, putting its bound port on a queue."""
    ShardServer(settings).serve(ready=port_queue.put if port_queue is not None else None)
