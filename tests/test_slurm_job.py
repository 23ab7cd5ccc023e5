"""`hetpipe slurm` (hetpipe/core/runs/slurm.py, hetpipe/app/slurm_job.py): the job's components and steps as
data, the batch script's text, and the script run end to end here with stand-ins for srun and hostname."""

from __future__ import annotations

import json
import os
import re
import stat
import subprocess
import sys
import time
import tomllib
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from hetpipe.core.config.overrides import apply_overrides
from hetpipe.core.config.parse import parse_config
from hetpipe.core.errors import UsageError
from hetpipe.core.runs.slurm import Step, job_script, slurm_job

CONFIG = """
name = "sl"
seed = 3
[gpu_types.g]
speed = 1.0
memory_gib = 4.0
[[nodes]]
name = "n0"
gpus = ["g", "g"]
[[nodes]]
name = "n1"
gpus = ["g", "g"]
[[nodes]]
name = "n2"
gpus = ["g"]
[ps]
port = PORT
[wsp]
staleness = 0
nm = 2
pull = "exact"
[checkpoint]
dir = ""
[model]
name = "mlp"
options = { image_size = 8, hidden = [24, 16] }
[data]
name = "synthetic"
options = { input_shape = [1, 8, 8], num_classes = 10, n = 512 }
[train]
batch_size = 16
waves = 3
optimizer = "momentum"
lr = 0.05
out_dir = "OUT"
[emulation]
enabled = false
[[virtual_workers]]
gpus = ["n0:0", "n1:0"]
[[virtual_workers]]
gpus = ["n1:1"]
"""


def config_of(tmp_path: Path, port: int = 7720, extra: str = ""):
    text = CONFIG.replace("PORT", str(port)).replace("OUT", str(tmp_path / "runs")) + extra
    path = tmp_path / "sl.toml"
    path.write_text(text)
    return parse_config(tomllib.loads(text), path), path


def vw_gpus(config) -> list[list[str]]:
    return [[str(g) for g in vw.gpus] for vw in config.virtual_workers]


def test_a_component_per_node_that_runs_something_and_the_steps_on_their_nodes(tmp_path: Path) -> None:
    config, _ = config_of(tmp_path)
    job = slurm_job(config, vw_gpus(config))
    assert job.nodes == ("n0", "n1") and job.node_index == (0, 1) and job.gpus == (2, 2)  # n2 runs nothing
    assert job.steps == (
        Step("n0", ("server",), "server.log", True),
        Step("n0", ("worker", "--vw", "0", "--stage", "0"), "worker-vw0-s0.log", False),
        Step("n1", ("worker", "--vw", "0", "--stage", "1"), "worker-vw0-s1.log", False),
        Step("n1", ("worker", "--vw", "1"), "worker-vw1.log", False),
    )
    assert slurm_job(config, vw_gpus(config), ps_node="n2").nodes == ("n0", "n1", "n2")
    with pytest.raises(UsageError, match="has nodes n0, n1, n2"):
        slurm_job(config, vw_gpus(config), ps_node="n9")


@pytest.mark.parametrize("placement", ["local", "spread"])
def test_per_node_placements_run_a_shard_on_every_node(tmp_path: Path, placement: str) -> None:
    config, _ = config_of(tmp_path)
    local = apply_overrides(config, [f'ps.placement="{placement}"', "ps.shards=3"])
    servers = [s for s in slurm_job(local, vw_gpus(local)).steps if s.server]
    assert [(s.node, s.args) for s in servers] == [
        ("n0", ("server", "--shard", "0")),
        ("n1", ("server", "--shard", "1")),
        ("n2", ("server", "--shard", "2")),
    ]


def test_the_script_asks_for_each_node_and_runs_each_step_on_its_component(tmp_path: Path) -> None:
    config, _ = config_of(tmp_path)
    job = slurm_job(config, vw_gpus(config))
    text = job_script(job, config_file="/shared/c.toml", run_dir="/shared/run", python="py", gres=True)
    sbatch = [line for line in text.splitlines() if line.startswith("#SBATCH")]
    assert sbatch == [
        "#SBATCH --job-name=hetpipe-sl",
        "#SBATCH --output=/shared/run/logs/slurm-%j.out",
        "#SBATCH --nodes=1 --ntasks=1 --exclusive --gres=gpu:2",
        "#SBATCH hetjob",
        "#SBATCH --nodes=1 --ntasks=1 --exclusive --gres=gpu:2",
    ]
    assert 'SETS+=(--set "nodes.1.host=$A1")' in text and 'SETS+=(--set "ps.host=$A0")' in text
    assert (
        'srun --het-group=1 --nodes=1 --ntasks=1 --overlap --gres=gpu:2 "$PY" -m hetpipe worker --vw 1 '
        '--config "$CONFIG" --run-dir "$RUN_DIR" "${SETS[@]}" > "$RUN_DIR/logs/worker-vw1.log" 2>&1 &'
    ) in text
    by_name = job_script(job, config_file="c", run_dir="r", address="hostname")
    assert "scontrol show hostnames" in by_name and "hostname -I" not in by_name and "--gres" not in by_name
    with pytest.raises(UsageError, match="choose one of ip, hostname"):
        job_script(job, config_file="c", run_dir="r", address="dns")  # type: ignore[arg-type]


def test_hetpipe_slurm_writes_the_script_and_config_and_never_over_a_run(tmp_path: Path) -> None:
    _, path = config_of(tmp_path)
    run_dir = tmp_path / "run"
    argv = [sys.executable, "-m", "hetpipe", "slurm", str(path), "--run-dir", str(run_dir)]
    first = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
    assert first.returncode == 0, first.stderr
    assert (run_dir / "job.sbatch").read_text().startswith("#!/bin/bash")
    assert 'virtual_workers = [{ gpus = ["n0:0", "n1:0"] }' in (run_dir / "config.toml").read_text()
    again = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
    assert again.returncode == 2 and "already holds a run (logs)" in again.stderr, again.stderr


def test_one_node_is_a_plain_job_without_het_groups(tmp_path: Path) -> None:
    config, _ = config_of(tmp_path)
    job = slurm_job(config, [["n1:0", "n1:1"]], ps_node="n1")
    text = job_script(job, config_file="c", run_dir="r")
    assert job.nodes == ("n1",) and "hetjob" not in text and "--het-group" not in text


STANDIN_SRUN = """#!/bin/bash
# srun for a test: drop srun's options and run the command here (FAIL: a step whose arguments hold it fails)
while [ $# -gt 0 ] && [ "${1#--}" != "$1" ]; do shift; done
if [ -n "${FAIL:-}" ] && [[ " $* " == *" $FAIL "* ]]; then sleep 2; echo "failing on purpose" >&2; exit 3; fi
exec "$@"
"""
STANDIN_HOSTNAME = """#!/bin/bash
[ "$1" = "-I" ] && echo "127.0.0.1 " && exit 0
exec /bin/hostname "$@"
"""


def assert_trains_as_hetpipe_train(run_dir: Path, local: Path) -> None:
    """The run in `run_dir` left the model `hetpipe train` of its config.toml trains on one machine, bit for
    bit (exact pulls), and the same accuracy."""
    trained = subprocess.run(
        [sys.executable, "-m", "hetpipe", "train", str(run_dir / "config.toml"), "--run-dir", str(local)],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert trained.returncode == 0, trained.stderr
    got, want = torch.load(run_dir / "model.pt"), torch.load(local / "model.pt")
    assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)
    accuracy = json.loads((local / "summary.json").read_text())["test_accuracy"]
    assert json.loads((run_dir / "summary.json").read_text())["test_accuracy"] == accuracy


def wait_for(what: str, ready: Callable[[], bool], timeout_s: float) -> None:
    """Poll `ready` until it holds; fail naming `what` after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not ready():
        assert time.monotonic() < deadline, f"no {what} within {timeout_s:.0f} s"
        time.sleep(0.3)


def written_script(tmp_path: Path, port: int) -> tuple[Path, dict[str, str]]:
    """`hetpipe slurm`'s script for the test config, and an environment whose srun and hostname are the
    stand-ins."""
    _, path = config_of(tmp_path, port=port)
    run_dir = tmp_path / "run"
    made = subprocess.run(
        [sys.executable, "-m", "hetpipe", "slurm", str(path), "--run-dir", str(run_dir)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert made.returncode == 0, made.stderr
    assert f"submit with: sbatch {run_dir / 'job.sbatch'}" in made.stdout
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("srun", STANDIN_SRUN), ("hostname", STANDIN_HOSTNAME)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(stat.S_IRWXU)
    return run_dir, {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}


@pytest.mark.slow
def test_the_script_trains_end_to_end_with_stand_ins_for_srun(tmp_path: Path) -> None:
    """The script's own logic on this machine: addresses found, the PS up and listening, every worker (VW 0
    across two nodes' components, VW 1 on one) to the last wave, then the PS stopped with SIGTERM."""
    run_dir, env = written_script(tmp_path, 7730)
    done = subprocess.run(
        ["bash", str(run_dir / "job.sbatch")],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "node n0: 127.0.0.1" in done.stdout and "every worker finished" in done.stdout
    logs = run_dir / "logs"
    assert re.search(r"clock 3\s+c_local \[3, 3\]", (logs / "server.log").read_text())
    for name, stage in (("worker-vw0-s0", "vw0-s0"), ("worker-vw0-s1", "vw0-s1"), ("worker-vw1", "vw1-s0")):
        assert f"{stage} finished 3 waves" in (logs / f"{name}.log").read_text()
    # it ends as `hetpipe train` does: the PS's final model, evaluated, and the summary
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["waves"] == 3 and summary["virtual_workers"] == 2 and summary["launcher"] == "distributed"
    assert 0.0 <= summary["test_accuracy"] <= 1.0 and summary["samples"] == 3 * 2 * 2 * 16
    state = torch.load(run_dir / "model.pt")
    assert sorted(state) and all(not k.startswith("audit/") for k in state)
    # `hetpipe finish` prints the block `hetpipe train` does (hetpipe.core.runs.summary_text)
    assert f"model     {run_dir / 'model.pt'}" in done.stdout.splitlines()
    assert f"accuracy  {summary['test_accuracy']:.4g}  (test loss " in done.stdout
    assert_trains_as_hetpipe_train(run_dir, tmp_path / "local")
    exported = subprocess.run(
        [sys.executable, "-m", "hetpipe", "export", str(run_dir)], capture_output=True, text=True, timeout=120
    )
    assert exported.returncode == 0 and (run_dir / "model-module.pt").exists(), exported.stderr


@pytest.mark.slow
def test_a_failed_worker_stops_the_job_and_everything_it_started(tmp_path: Path) -> None:
    run_dir, env = written_script(tmp_path, 7740)
    done = subprocess.run(
        ["bash", str(run_dir / "job.sbatch")],
        capture_output=True,
        text=True,
        timeout=240,
        env={**env, "FAIL": "--vw 1"},  # the step of `--vw 1` exits 3
        check=False,
    )
    assert done.returncode == 1, done.stdout + done.stderr
    assert re.search(r"failed: srun .* worker --vw 1 .*; stopping the job", done.stderr), done.stderr
    deadline = time.monotonic() + 15
    while holders(run_dir) and time.monotonic() < deadline:  # stopping is SIGTERM, then their own exit
        time.sleep(0.2)
    assert holders(run_dir) == [], "processes still hold files of the run dir"


def holders(folder: Path) -> list[int]:
    """PIDs of the processes with a file under `folder` open (the PS, workers and their stages log there)."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if any(os.readlink(fd).startswith(str(folder)) for fd in (proc / "fd").iterdir()):
                found.append(int(proc.name))
        except OSError:  # gone, or not ours to read
            continue
    return found
