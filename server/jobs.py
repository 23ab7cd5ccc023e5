"""What each PS shard process is given, as worker/jobs.py says for each stage: its ShardJob (the packed config
and its place: which shard, the port, where it checkpoints, its keys, a clock to resume from), built by one
function (shard_jobs) for `hetpipe train` and `hetpipe server` alike; the shard derives its settings from the
config in its own process (shard_settings)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from hetpipe.core.config.schema import ClusterConfig
from hetpipe.core.config.serialize import pack_config, unpack_config
from hetpipe.core.errors import UsageError
from hetpipe.core.protocol.keys import ServerKeys, server_keys
from hetpipe.core.wsp.aggregation import OptimizerSettings
from hetpipe.server.shard import ShardSettings

__all__ = ["ShardJob", "shard_jobs", "shard_keys", "shard_settings"]


@dataclass(frozen=True)
class ShardJob:
    """Everything a shard process needs, passed to a spawned child; the config travels parsed (packed)."""

    packed_config: bytes  # hetpipe.core.config.pack_config of the effective config
    shard: int
    port: int | None = None  # None: [ps] port + shard; 0: any free port (the child reports the one it bound)
    checkpoint_root: str | None = None  # checkpoints under <root>/shard-<i>; None: under [checkpoint] dir
    keys: ServerKeys | None = (
        None  # auth = "curve": the PS's pair and the keys it admits; None: [ps] keys_dir
    )
    resume_clock: int | None = None  # start from that clock's checkpoint, cut back to it (train --resume)

    @cached_property
    def config(self) -> ClusterConfig:
        return unpack_config(self.packed_config)

    def settings(self) -> ShardSettings:
        """What this shard runs by, from its config and its place."""
        root = Path(self.checkpoint_root) if self.checkpoint_root is not None else None
        return shard_settings(self.config, self.shard, self.port, root, self.keys, self.resume_clock)


def shard_jobs(
    config: ClusterConfig,
    *,
    shards: Sequence[int] | None = None,
    port: int | None = None,
    checkpoint_root: Path | None = None,
    keys: ServerKeys | None = None,
    resume_clock: int | None = None,
) -> list[ShardJob]:
    """The jobs of the config's shards (or of `shards` only), all with the same place settings (ShardJob)."""
    packed = pack_config(config)
    root = None if checkpoint_root is None else str(checkpoint_root)
    chosen = range(config.ps.shards) if shards is None else shards
    return [ShardJob(packed, shard, port, root, keys, resume_clock) for shard in chosen]


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
    ckpt, t = config.checkpoint, config.train
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
        optimizer=OptimizerSettings(t.optimizer, t.lr, t.momentum, t.weight_decay),
        keys=keys if config.ps.auth == "curve" else None,
        on_vw_failure=config.ps.on_vw_failure,
        hung_after_s=config.ps.hung_after_s,
        resume_clock=resume_clock,
        wire_dtype=config.ps.wire_dtype,
        freeze=config.train.freeze,
        autofreeze=config.train.autofreeze_every,
    )
