"""A process's stage from its launcher's environment (hetpipe/core/runs/roles.py), and `hetpipe worker` using
it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from hetpipe.core.errors import UsageError
from hetpipe.core.runs.roles import Launch, launch_of, shard_of, stage_of

TORCHRUN = {"TORCHELASTIC_RUN_ID": "r1", "RANK": "2", "WORLD_SIZE": "3", "LOCAL_RANK": "0"}
SRUN = {"SLURM_JOB_ID": "7", "SLURM_STEP_ID": "4", "SLURM_PROCID": "1", "SLURM_NTASKS": "3"}


def test_torchrun_and_srun_steps_say_the_rank_and_the_batch_script_says_nothing() -> None:
    assert launch_of(TORCHRUN) == Launch("torchrun", 2, 3)
    assert launch_of(SRUN) == Launch("srun", 1, 3)
    assert launch_of({**SRUN, "SLURM_STEP_NUM_TASKS": "2"}) == Launch(
        "srun", 1, 2
    )  # the step's, not the job's
    assert launch_of({**SRUN, "SLURM_STEP_ID": "batch"}) is None  # the batch script: no step of its own
    assert launch_of({"SLURM_PROCID": "0", "SLURM_NTASKS": "4"}) is None
    assert launch_of({}) is None
    assert launch_of({**SRUN, **TORCHRUN}).launcher == "torchrun"  # torchrun inside an srun step


def test_a_process_per_stage_runs_its_rank_and_one_process_runs_the_whole_vw() -> None:
    assert stage_of(TORCHRUN, 0, 3) == 2
    assert stage_of(SRUN, 1, 3) == 1
    assert stage_of({**TORCHRUN, "RANK": "0", "WORLD_SIZE": "1"}, 0, 3) is None
    assert stage_of({}, 0, 3) is None


def test_a_task_count_that_is_not_the_vws_stage_count_is_refused_with_the_fix() -> None:
    with pytest.raises(UsageError, match=r"torchrun started 3 processes but vw 1 has 2 stages.*= 2"):
        stage_of(TORCHRUN, 1, 2)
    with pytest.raises(UsageError, match=r"srun started 3 processes .* \(--ntasks = 4\)"):
        stage_of(SRUN, 0, 4)
    with pytest.raises(UsageError, match="RANK='x' is not an integer"):
        launch_of({**TORCHRUN, "RANK": "x"})


def test_hetpipe_worker_under_torchrun_refuses_a_task_count_that_is_not_its_stages() -> None:
    config = Path(__file__).resolve().parents[1] / "hetpipe" / "clusters" / "local.toml"
    env = {**os.environ, **TORCHRUN}  # 3 processes; local.toml's VWs have 2 stages each
    done = subprocess.run(
        [sys.executable, "-m", "hetpipe", "worker", "--config", str(config), "--vw", "0"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2, done.stderr
    assert "torchrun started 3 processes but vw 0 has 2 stages" in done.stderr


def test_a_process_per_shard_serves_its_rank_and_a_wrong_count_is_refused() -> None:
    assert shard_of(TORCHRUN, 3) == 2 and shard_of(SRUN, 3) == 1
    assert shard_of({}, 3) is None and shard_of({**SRUN, "SLURM_NTASKS": "1", "SLURM_PROCID": "0"}, 3) is None
    with pytest.raises(UsageError, match=r"srun started 3 processes but the PS has 2 shards.*--ntasks = 2"):
        shard_of(SRUN, 2)


def test_hetpipe_server_under_srun_refuses_a_task_count_that_is_not_its_shards() -> None:
    config = Path(__file__).resolve().parents[1] / "hetpipe" / "clusters" / "local.toml"
    done = subprocess.run(
        [sys.executable, "-m", "hetpipe", "server", "--config", str(config)],
        capture_output=True,
        text=True,
        env={**os.environ, **SRUN},  # 3 tasks; local.toml's PS has fewer shards
        timeout=60,
        check=False,
    )
    assert done.returncode == 2, done.stderr
    assert "srun started 3 processes but the PS has" in done.stderr
