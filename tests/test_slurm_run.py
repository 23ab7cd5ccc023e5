"""`hetpipe slurm`'s job on a real Slurm (launch/slurm_testbed.py: one slurmd per node of the config, each in
its own network namespace with its own address and hostname): it trains the model `hetpipe train` trains, bit
for bit, and leaves the same outputs. Root only; slow."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from test_slurm_job import CONFIG, assert_trains_as_hetpipe_train, wait_for  # noqa: E402
from test_slurm_testbed import skip_reason  # noqa: E402

SCRIPT = ROOT / "launch" / "slurm_testbed.py"
# three nodes, one component each: VW 0 over n0 and n1, VW 1 on n2, the PS on n0
THREE_NODES = CONFIG.replace('gpus = ["n1:1"]', 'gpus = ["n2:0"]')


@pytest.fixture(scope="module")
def slurm_conf(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    """A Slurm testbed of the three-node config for this module: (SLURM_CONF, the config); torn down after."""
    reason = skip_reason()
    if reason is not None:
        pytest.skip(reason)
    folder = tmp_path_factory.mktemp("slurm")
    config = folder / "three.toml"
    config.write_text(THREE_NODES.replace("PORT", "7750").replace("OUT", str(folder / "runs")))
    run = f"j{os.getpid() % 16**7:x}"
    up = subprocess.run(
        [sys.executable, str(SCRIPT), "up", str(config), "--run", run, "--scale", "1"],
        capture_output=True,
        text=True,
        timeout=700,
        check=False,
    )
    try:
        assert up.returncode == 0, f"the Slurm testbed did not come up:\n{up.stderr}"
        yield f"/run/hetpipe-slurm/{run}/slurm.conf", config
    finally:
        subprocess.run([sys.executable, str(SCRIPT), "down", "--run", run], timeout=120, check=False)


def sbatch_wait(script: Path, conf: str, timeout: float = 400) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "SLURM_CONF": conf, "GLOO_SOCKET_IFNAME": "hpnet"}  # the nodes' own interface
    return subprocess.run(
        ["sbatch", "--wait", str(script)],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
        check=False,
    )


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_slurm_job_trains_hetpipe_trains_model_bit_for_bit(slurm_conf, tmp_path: Path) -> None:
    conf, config = slurm_conf
    run_dir = tmp_path / "run"
    made = subprocess.run(
        [sys.executable, "-m", "hetpipe", "slurm", str(config), "--run-dir", str(run_dir), "--no-gres"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert made.returncode == 0, made.stderr
    started = time.monotonic()
    done = sbatch_wait(run_dir / "job.sbatch", conf)
    outs = list((run_dir / "logs").glob("slurm-*.out"))
    assert len(outs) == 1, done.stdout + done.stderr
    (out,) = outs
    text = out.read_text()
    assert done.returncode == 0, done.stdout + done.stderr + text
    print(f"job: {time.monotonic() - started:.1f} s")
    # every node's own address, and each worker on its node
    assert "node n0: 10.77.0.2" in text and "node n1: 10.77.0.3" in text and "node n2: 10.77.0.4" in text
    logs = run_dir / "logs"
    for name, stage in (("worker-vw0-s0", "vw0-s0"), ("worker-vw0-s1", "vw0-s1"), ("worker-vw1", "vw1-s0")):
        assert f"{stage} finished 3 waves" in (logs / f"{name}.log").read_text()
    assert_trains_as_hetpipe_train(run_dir, tmp_path / "local")


def slurm_out(argv: list[str], conf: str) -> str:
    done = subprocess.run(
        argv, capture_output=True, text=True, timeout=60, env={**os.environ, "SLURM_CONF": conf}, check=False
    )
    assert done.returncode == 0, f"{' '.join(argv)}: {done.stderr}"
    return done.stdout


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_cancelled_vw_step_is_evicted_the_others_go_on_and_it_rejoins(slurm_conf, tmp_path: Path) -> None:
    """Under on_vw_failure = "evict": `scancel` of VW 1's step (on n2) evicts VW 1 and VW 0 goes on; the srun
    the job prints starts VW 1 again into the job, it rejoins at a wave boundary, and the job ends with every
    live VW at the last wave and the model, as a run without the failure."""
    conf, config = slurm_conf
    run_dir = tmp_path / "run"
    settings = ["ps.on_vw_failure=evict", "ps.heartbeat_s=0.5", "ps.hung_after_s=3", "train.waves=1500"]
    made = subprocess.run(
        [sys.executable, "-m", "hetpipe", "slurm", str(config), "--run-dir", str(run_dir), "--no-gres"]
        + [arg for s in settings for arg in ("--set", s)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert made.returncode == 0, made.stderr
    env = {**os.environ, "SLURM_CONF": conf, "GLOO_SOCKET_IFNAME": "hpnet"}
    submitted = subprocess.run(
        ["sbatch", "--parsable", str(run_dir / "job.sbatch")],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert submitted.returncode == 0, submitted.stderr
    job = submitted.stdout.strip().split(";")[0]
    logs = run_dir / "logs"
    server = logs / "server.log"
    wait_for("clock 20 at the PS", lambda: server.exists() and "clock 20 " in server.read_text(), 180)
    steps = slurm_out(["squeue", "--steps", "--noheader", "--format=%i %N"], conf).split()
    on_n2 = [steps[i] for i in range(0, len(steps), 2) if steps[i + 1] == "n2"]
    assert len(on_n2) == 1, steps  # VW 1's worker is the only step left on n2
    slurm_out(["scancel", on_n2[0]], conf)
    (out,) = logs.glob("slurm-*.out")
    wait_for(
        "the job's word on the failed step", lambda: "start it again into this job" in out.read_text(), 120
    )
    again = out.read_text().split("start it again into this job (it rejoins): ")[1].splitlines()[0]
    assert again.startswith(f"srun --jobid={job} ") and "--vw 1 " in again
    with open(tmp_path / "again.log", "w") as log:
        rejoin = subprocess.Popen(again.split(), stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        wait_for(
            "the job's end", lambda: job not in slurm_out(["squeue", "--noheader", "--format=%i"], conf), 600
        )
        assert rejoin.wait(timeout=60) == 0, (tmp_path / "again.log").read_text()
    finally:
        if rejoin.poll() is None:
            rejoin.kill()
    text = out.read_text()
    assert "every worker finished" in text and (run_dir / "model.pt").exists(), text
    assert "rejoining at wave" in (tmp_path / "again.log").read_text()
    assert "finished 1500 waves" in (tmp_path / "again.log").read_text()
    assert "evict" in server.read_text()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["waves"] == 1500 and 0.0 <= summary["test_accuracy"] <= 1.0
