"""Which stage of a virtual worker (or PS shard) a process is, from its launcher (docs/clusters.md#torchrun):
torchrun's RANK and WORLD_SIZE, or srun's SLURM_PROCID and SLURM_NTASKS in a step of several tasks. Pure."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from hetpipe.core.errors import UsageError

__all__ = ["Launch", "launch_of", "shard_of", "stage_of"]


@dataclass(frozen=True)
class Launch:
    """What a launcher told this process: who started it, its rank among the tasks and how many there are."""

    launcher: str  # "torchrun" or "srun"
    rank: int
    world_size: int


def launch_of(env: Mapping[str, str]) -> Launch | None:
    """The launch of this process: torchrun (TORCHELASTIC_RUN_ID with RANK and WORLD_SIZE), else srun
    (SLURM_PROCID and SLURM_NTASKS in a job step, not in the batch script itself), else None (started by hand
    or by `hetpipe train`)."""
    if "TORCHELASTIC_RUN_ID" in env and "RANK" in env:
        return Launch("torchrun", _int(env, "RANK"), _int(env, "WORLD_SIZE"))
    if "SLURM_PROCID" in env and env.get("SLURM_STEP_ID", "").isdigit():  # a step, not the batch script
        tasks = "SLURM_STEP_NUM_TASKS" if "SLURM_STEP_NUM_TASKS" in env else "SLURM_NTASKS"  # the step's own
        return Launch("srun", _int(env, "SLURM_PROCID"), _int(env, tasks))
    return None


def stage_of(env: Mapping[str, str], vw: int, num_stages: int) -> int | None:
    """The stage of VW `vw` (of `num_stages`) this process runs when a launcher started one process per stage
    (its rank; the launcher's task count must be the VW's stage count), else None: every stage of the VW."""
    return _rank(
        env,
        num_stages,
        f"vw {vw} has {num_stages} stages",
        "one process per stage",
        "one process for the whole VW",
    )


def shard_of(env: Mapping[str, str], shards: int) -> int | None:
    """The PS shard (of `shards`) this process serves when a launcher started one process per shard (its
    rank; the task count must be the shard count), else None: every shard, as child processes."""
    return _rank(
        env,
        shards,
        f"the PS has {shards} shards ([ps] shards)",
        "one process per shard",
        "one for all of them",
    )


def _rank(env: Mapping[str, str], count: int, has: str, each: str, whole: str) -> int | None:
    """This process's rank when a launcher started several, which must be `count` (else UsageError: the
    launcher started N processes but `has`; start `each` or `whole`); None for one process or none."""
    launch = launch_of(env)
    if launch is None or launch.world_size == 1:
        return None
    if launch.world_size != count:
        what = "--nproc-per-node x --nnodes" if launch.launcher == "torchrun" else "--ntasks"
        raise UsageError(
            f"{launch.launcher} started {launch.world_size} processes but {has}: start {each} ({what} = "
            f"{count}), or {whole}"
        )
    return launch.rank


def _int(env: Mapping[str, str], name: str) -> int:
    value = env.get(name, "")
    try:
        number = int(value)
    except ValueError:
        raise UsageError(
            f"environment variable {name}={value!r} is not an integer: is the launcher's set-up broken?"
        ) from None
    if number < 0:
        raise UsageError(f"environment variable {name}={value} is negative")
    return number
