"""Virtual workers under torchrun in the testbed's namespaces (docs/clusters.md#torchrun): a stage killed
with SIGKILL fails its worker, which evicts its VW; torchrun starts the worker again, it rejoins at a wave
boundary, and the run completes with the audit's ledgers exact. Root only; slow."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_slurm_job import wait_for  # noqa: E402
from test_testbed import needs_testbed, run_id  # noqa: E402

CONFIG = """name = "trun"
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
[ps]
port = 7770
on_vw_failure = "evict"
heartbeat_s = 0.5
hung_after_s = 3
[wsp]
staleness = 0
nm = 2
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
waves = WAVES
optimizer = "momentum"
lr = 0.05
out_dir = "OUT"
[emulation]
enabled = false
[[virtual_workers]]
gpus = ["n0:0", "n0:1"]
[[virtual_workers]]
gpus = ["n1:0", "n1:1"]
"""
WAVES = 2000
TORCHRUN = str(Path(sys.executable).parent / "torchrun")


def in_node(run: str, node: str, argv: list[str]) -> list[str]:
    """`argv` in the testbed node's namespace, gloo on the node's own interface."""
    return ["ip", "netns", "exec", f"hp-{run}-{node}", "env", "GLOO_SOCKET_IFNAME=hpnet", *argv]


@pytest.mark.slow
@pytest.mark.timeout(900)
@needs_testbed
def test_torchrun_restarts_a_killed_stages_worker_and_the_vw_rejoins(tmp_path: Path) -> None:
    run = run_id("t")
    config = tmp_path / "trun.toml"
    config.write_text(CONFIG.replace("WAVES", str(WAVES)).replace("OUT", str(tmp_path / "runs")))
    hetpipe = [sys.executable, "-m", "hetpipe"]
    up = subprocess.run(
        [*hetpipe, "testbed", "up", str(config), "--run", run, "--scale", "1", "--no-probe"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    started: list[subprocess.Popen] = []
    try:
        assert up.returncode == 0, up.stderr
        effective = f"/run/hetpipe-testbed/{run}/cluster.toml"  # every node at its namespace's address
        run_dir, logs = tmp_path / "run", tmp_path / "logs"
        logs.mkdir()

        def start(name: str, node: str, argv: list[str]) -> subprocess.Popen:
            with open(logs / f"{name}.log", "w") as log:
                proc = subprocess.Popen(in_node(run, node, argv), stdout=log, stderr=subprocess.STDOUT)
            started.append(proc)
            return proc

        start("server", "n0", [*hetpipe, "server", "--config", effective])
        server = logs / "server.log"
        wait_for("the PS listening", lambda: "listening on port" in server.read_text(), 60)
        began = time.monotonic()
        workers = [
            start(
                f"vw{v}",
                f"n{v}",
                [TORCHRUN, "--nnodes=1", "--nproc-per-node=1", "--max-restarts=2", "--rdzv-backend=c10d"]
                + [f"--rdzv-endpoint=127.0.0.1:{29600 + v}", "-m", "hetpipe", "worker", "--config", effective]
                + ["--vw", str(v), "--run-dir", str(run_dir / f"vw{v}"), "--audit"],
            )
            for v in (0, 1)
        ]
        wait_for("clock 50", lambda: "clock 50 " in server.read_text(), 120)
        pids = json.loads((run_dir / "vw1" / "pids.json").read_text())
        os.kill(pids["vw1-s1"], signal.SIGKILL)
        for w in workers:
            assert w.wait(timeout=600) == 0, (logs / "vw1.log").read_text()[-3000:]
        wall = time.monotonic() - began
        vw1 = (logs / "vw1.log").read_text()
        assert "killed by SIGKILL" in vw1 and "rejoining at wave" in vw1, vw1[-3000:]
        assert f"vw1-s0, vw1-s1 finished {WAVES} waves" in vw1
        assert "evicted vw 1" in server.read_text() and "vw 1 rejoins at wave" in server.read_text()
        finish = subprocess.run(
            in_node(run, "n0", [*hetpipe, "finish", "--config", effective, "--run-dir", str(run_dir)])
            + ["--wall-s", f"{wall:.1f}"],
            capture_output=True,
            text=True,
            timeout=180,
            check=False,
        )
        assert finish.returncode == 0, finish.stderr
        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["audit_final_ledgers_exact"] is True, summary["audit_ledger"]
        assert summary["audit_ledger"]["slots"] > 0
    finally:
        for proc in started:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in started:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
        subprocess.run([*hetpipe, "testbed", "down", "--run", run], capture_output=True, timeout=120)
