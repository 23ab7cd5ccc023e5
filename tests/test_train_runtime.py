"""The runtime as a user runs it: audited WSP guarantees under a slow VW, a killed stage, `hetpipe train`."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from hetpipe.app.train import TrainOptions, train
from hetpipe.core.config.files import load_config

from conftest import as_from_a_terminal, free_port_block, write_config

pytestmark = pytest.mark.slow
HAS_TENSORBOARD = importlib.util.find_spec("tensorboard") is not None


def start_long_training(tmp_path: Path) -> tuple[subprocess.Popen, dict[str, int]]:
    """`hetpipe train` of a long run as a subprocess; returns once it is training, with its children's
    PIDs."""
    path = write_config(
        tmp_path,
        vws=[["n0:0", "n0:1"], ["n0:2", "n0:3"]],
        nm=2,
        staleness=0,
        waves=3000,
        speeds=[2.0, 1.0, 2.0, 1.0],
        emulation=True,
        time_scale=1.0,
    )
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "hetpipe", "train", str(path), "--run-dir", str(run_dir), "--quiet"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=as_from_a_terminal,
    )
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + 60
    while not ((run_dir / "pids.json").exists() and metrics.exists() and '"push"' in metrics.read_text()):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"training never started: {proc.communicate()}")
        time.sleep(0.2)
    return proc, json.loads((run_dir / "pids.json").read_text())


def stop_within(proc: subprocess.Popen, seconds: float) -> tuple[str, float]:
    """Wait for proc to exit after a signal; returns its stderr and how long it took."""
    sent = time.monotonic()
    try:
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    took = time.monotonic() - sent
    assert took < seconds, f"took {took:.1f} s to stop"
    return err, took


def assert_all_gone(pids: dict[str, int]) -> None:
    for pid in pids.values():
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


@pytest.mark.parametrize(("pull", "staleness"), [("latest", 1), ("exact", 0)])
def test_audit_holds_with_one_vw_four_times_slower(tmp_path: Path, pull: str, staleness: int):
    # VW 0 on two speed-4 GPUs, VW 1 on two speed-1 GPUs: VW 1 computes 4x slower (time dilation). At
    # time_scale 1 the fast GPUs ran undilated, so when 4 stages shared 2 busy cores their wall time grew with
    # the contention while the slow ones' sleeps absorbed it: both VWs ran alike and VW 0 never waited (the
    # flaky failure). At 8 every stage sleeps most of its time, and the 4x ratio holds on a loaded machine.
    path = write_config(
        tmp_path,
        vws=[["n0:0", "n0:1"], ["n0:2", "n0:3"]],
        nm=2,
        staleness=staleness,
        waves=8,
        pull=pull,
        speeds=[4.0, 4.0, 1.0, 1.0],
        emulation=True,
        time_scale=8.0,
        model="mnist-cnn",
        batch_size=32,
    )
    summary = train(load_config(path), TrainOptions(run_dir=tmp_path / "run", progress=False, audit=True))
    # every forward of every stage checked each of its layers' ledgers: 2 VWs x 16 minibatches x 6 layers
    assert summary["audit_checks"] == 2 * 8 * 2 * 6
    assert summary["audit_final_ledgers_exact"] is True
    assert summary["max_lead_waves"] <= staleness + 2  # launcher's view; the ledger checks are the proof
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    waited = gate_wait_once_both_ran(metrics)
    assert waited[0] > waited[1]  # the fast VW is the one held back


def gate_wait_once_both_ran(metrics: list[dict]) -> dict[int, float]:
    """Each VW's gate wait (its most-waiting stage) from the moment both VWs had pushed their first wave.

    The summary's totals also count start-up: under load one VW's processes may start seconds after the
    other's, and the early VW then waits at its first gates for the late one (this test's flaky failure,
    summary gate_wait_s of the slow VW above the fast one's)."""
    pushes = [m for m in metrics if m["event"] == "push"]
    both = max(min(m["t"] for m in pushes if m["vw"] == v) for v in (0, 1))
    out = {}
    for v in (0, 1):
        per_stage = {}
        for stage in {m["stage"] for m in pushes if m["vw"] == v}:
            mine = sorted((m for m in pushes if m["vw"] == v and m["stage"] == stage), key=lambda m: m["t"])
            before = [m["gate_wait_s"] for m in mine if m["t"] <= both]
            per_stage[stage] = mine[-1]["gate_wait_s"] - (before[-1] if before else 0.0)
        out[v] = max(per_stage.values())
    return out


def test_sigkill_of_a_stage_stops_the_run_naming_it(tmp_path: Path):
    proc, pids = start_long_training(tmp_path)
    os.kill(pids["vw1-s0"], signal.SIGKILL)
    err, _ = stop_within(proc, 15)
    assert proc.returncode == 1
    assert "vw1-s0" in err and "SIGKILL" in err and "Traceback" not in err
    assert_all_gone(pids)


def test_train_cli_writes_summary_and_model(tmp_path: Path):
    # --set reaches the stage processes: they receive the parsed config, never the file to re-read
    path = write_config(tmp_path, vws=[["n0:0", "n0:1"]], nm=2, staleness=0, waves=4)
    out = tmp_path / "summary.json"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "hetpipe",
            "train",
            str(path),
            "--run-dir",
            str(tmp_path / "r"),
            "--summary",
            str(out),
            "--set",
            "train.waves=3",
            "--set",
            "wsp.nm=3",
            "--profile",
            "2:4",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    summary = json.loads(out.read_text())
    assert {"test_accuracy", "samples_per_s", "wall_s"} <= set(summary)
    assert (summary["waves"], summary["nm"]) == (3, 3)
    # the printed block (hetpipe.core.runs.summary_text): the result first, the model's and summaries' paths
    lines = result.stdout.splitlines()
    assert lines[1] == (
        f"accuracy  {summary['test_accuracy']:.4g}  (test loss {summary['test_loss']:.4g}, "
        f"{summary['eval_samples']} held-out samples)"
    ), result.stdout
    assert f"model     {tmp_path / 'r' / 'model.pt'}" in lines
    assert f"summary   {tmp_path / 'r' / 'summary.json'} and {out} (every number)" in lines
    assert "wave 3/3" in result.stderr
    metrics = [json.loads(line) for line in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    assert max(m["p"] for m in metrics if m["event"] == "minibatch") == 3 * 3 - 1
    import torch

    state = torch.load(tmp_path / "r" / "model.pt", weights_only=True)
    assert "1.0.weight" in state and all(t.dtype == torch.float32 for t in state.values())
    # each stage's totals are in its trace too (what a run of `hetpipe worker`s leaves), and they add up
    from hetpipe.core.runs.metrics import STAGE_PARTS, stage_totals

    totals = stage_totals(tmp_path / "r" / "trace")
    assert sorted(totals) == [(0, 0), (0, 1)] and {t["waves"] for t in totals.values()} == {3}
    for t in totals.values():
        own = sum(t["times_s"][part] for part in STAGE_PARTS)
        assert 0 < t["times_s"]["compute"] <= own <= t["times_s"]["train"]
    assert summary["wave_breakdown_ms"]["0"]["train"] == max(
        round(1000 * t["times_s"]["train"] / 3, 3) for t in totals.values()
    )
    # --profile: each stage wrote its ops over minibatches 2 ... 5
    for stage in (0, 1):
        profile = json.loads((tmp_path / "r" / "profile" / f"vw0-s{stage}.json").read_text())
        assert profile["window"] == [2, 5] and profile["aten_calls"] > 0 and profile["by_host"]
        assert (
            (tmp_path / "r" / "profile" / f"vw0-s{stage}.txt")
            .read_text()
            .startswith(f"vw0-s{stage}, from the forward of minibatch 2")
        )


def test_a_profile_window_past_the_run_is_refused_before_anything_starts(tmp_path: Path):
    from hetpipe.core.errors import UsageError
    from hetpipe.core.pipeline.profile_window import ProfileWindow
    from hetpipe.worker.run import run_worker

    path = write_config(tmp_path, vws=[["n0:0"]], nm=2, staleness=0, waves=3)
    with pytest.raises(UsageError, match=r"ends at minibatch 7, but each VW runs 6 .*FIRST \+ COUNT <= 6"):
        train(
            load_config(path),
            TrainOptions(run_dir=tmp_path / "r", progress=False, profile=ProfileWindow(4, 4)),
        )
    with pytest.raises(
        UsageError, match=r"ends at minibatch 7, but each VW runs 6"
    ):  # no PS runs: refused first
        run_worker(load_config(path), 0, None, tmp_path / "w", profile=ProfileWindow(4, 4))
    # `hetpipe worker --profile` reaches run_worker (whose stages profile as `hetpipe train`'s do, above)
    result = subprocess.run(
        [sys.executable, "-m", "hetpipe", "worker", "--config", str(path), "--vw", "0"]
        + ["--run-dir", str(tmp_path / "w"), "--profile", "4:4"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode != 0, result.stderr
    assert "ends at minibatch 7, but each VW runs 6" in result.stderr
    assert not (tmp_path / "r").exists() and not (tmp_path / "w").exists()


def test_server_and_workers_as_separate_commands(tmp_path: Path):
    """The several-machines flow, on one: `hetpipe server` plus one `hetpipe worker` per VW."""
    path = write_config(tmp_path, vws=[["n0:0", "n0:1"], ["n0:2", "n0:3"]], nm=2, staleness=0, waves=3)
    port = free_port_block([0, 100, 101])  # the PS's one shard, then each VW's rendezvous
    path.write_text(path.read_text() + f"\n[ps]\nport = {port}\n")
    server = subprocess.Popen(
        [sys.executable, "-m", "hetpipe", "server", "--config", str(path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        workers = [
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "hetpipe",
                    "worker",
                    "--config",
                    str(path),
                    "--vw",
                    str(v),
                    "--run-dir",
                    str(tmp_path / f"w{v}"),
                ],
                stderr=subprocess.PIPE,
                text=True,
            )
            for v in range(2)
        ]
        outputs = [w.communicate(timeout=120)[1] for w in workers]
        assert [w.returncode for w in workers] == [0, 0], outputs
        assert all("finished 3 waves" in out for out in outputs)
    finally:
        server.terminate()
        _, log = server.communicate(timeout=30)
    assert server.returncode == 0
    assert "clock 3  c_local [3, 3]" in log


def test_ctrl_c_stops_everything_within_seconds(tmp_path: Path):
    proc, pids = start_long_training(tmp_path)
    proc.send_signal(signal.SIGINT)  # what Ctrl-C sends (here to the launcher alone)
    err, _ = stop_within(proc, 15)
    assert proc.returncode == 1 and "interrupted" in err and "Traceback" not in err
    assert_all_gone(pids)


def test_a_diverging_run_stops_naming_the_stage_and_wave(tmp_path: Path):
    # lr = 1e30: the first steps overflow, the loss and the updates turn NaN; the run must end with the cause
    # (the stage's own NaN check, or the PS refusing the non-finite push), exit 1 and no traceback
    path = write_config(tmp_path, vws=[["n0:0"]], nm=2, staleness=0, waves=6)
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "hetpipe",
            "train",
            str(path),
            "--run-dir",
            str(tmp_path / "r"),
            "--quiet",
            "--set",
            "train.lr=1e30",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 1, result.stderr
    assert "stage 0 of virtual worker 0 (vw0-s0) stopped the run" in result.stderr
    assert "wave" in result.stderr and 'train.on_nan = "skip"' in result.stderr
    assert "Traceback" not in result.stderr and str(tmp_path / "r" / "logs" / "vw0-s0.log") in result.stderr


def test_train_with_curve_auth(tmp_path: Path):
    path = write_config(tmp_path, vws=[["n0:0"], ["n0:1"]], nm=2, staleness=0, waves=3)
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "hetpipe",
            "train",
            str(path),
            "--run-dir",
            str(tmp_path / "r"),
            "--quiet",
            "--set",
            "ps.auth=curve",
            "--set",
            "ps.timeout_s=5",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    keys = tmp_path / "r" / "keys"
    assert sorted(p.name for p in keys.glob("*.key")) == ["admin.key", "server.key", "vw0.key", "vw1.key"]
    log = (tmp_path / "r" / "logs" / "ps-shard-0.log").read_text()
    assert "auth=curve, 3 client keys" in log and "refused" not in log


def test_on_nan_skip_drops_the_bad_minibatches_and_trains_on(tmp_path: Path):
    """One sample in forty is NaN: with on_nan = "skip" the minibatches holding one add nothing at any stage
    (the last stage tells the others), the rest train, and the final model is finite."""
    data = tmp_path / "data"
    data.mkdir()
    rng = np.random.default_rng(0)
    x = rng.standard_normal((400, 1, 28, 28)).astype(np.float32)
    x[::40, 0, 0, 0] = np.nan
    np.save(data / "x.npy", x)
    np.save(data / "y.npy", rng.integers(0, 10, 400))
    path = write_config(tmp_path, vws=[["n0:0", "n0:1"], ["n0:2", "n0:3"]], nm=2, staleness=0, waves=6)
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "hetpipe",
            "train",
            str(path),
            "--run-dir",
            str(tmp_path / "r"),
            "--quiet",
            "--set",
            "train.on_nan=skip",
            "--set",
            f"data.name={json.dumps(str(data))}",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    metrics = [json.loads(line) for line in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in metrics if m["event"] == "minibatch"]
    assert any(m["skipped"] for m in steps) and not all(m["skipped"] for m in steps)
    assert all(math.isfinite(m["loss"]) for m in steps if not m["skipped"])
    import torch

    state = torch.load(tmp_path / "r" / "model.pt", weights_only=True)
    assert all(bool(torch.isfinite(t).all()) for t in state.values())


ROOT = Path(__file__).resolve().parents[1]


def test_example_model_trains_evaluates_live_and_exports(tmp_path: Path):
    """examples/tiny_convnet.py trained by `hetpipe train` from the repository root (its own model, BatchNorm
    buffers included), with CURVE auth, live evaluations every 3 waves and TensorBoard files; then rebuilt
    by `hetpipe export`: the exported module scores the test digits exactly as the run's final evaluation."""
    run_dir, board = tmp_path / "r", tmp_path / "tb"
    with_board = ["--tensorboard", str(board)] if HAS_TENSORBOARD else []
    cpu = '["cpu", "cpu"]'  # every emulated GPU on the CPU, also on a machine with CUDA
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "hetpipe",
            "train",
            "examples/tiny_convnet.toml",
            "--run-dir",
            str(run_dir),
            "--summary",
            str(tmp_path / "s.json"),
            *with_board,
            "--set",
            "train.waves=12",
            "--set",
            "train.eval_every=3",
            "--set",
            "train.eval_samples=200",
            "--set",
            "ps.auth=curve",
            "--set",
            f"nodes.0.devices={cpu}",
            "--set",
            f"nodes.1.devices={cpu}",
            "--set",
            f"train.out_dir={json.dumps(str(tmp_path / 'runs'))}",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr
    assert "start-up: launcher_ready" in result.stderr
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    # live evaluations of W_t while training (t >= 3: at least the first due point is always taken), then the
    # final
    live = [m for m in metrics if m["event"] == "eval" and not m.get("final")]
    final = [m for m in metrics if m["event"] == "eval" and m.get("final")]
    assert live and all(3 <= m["wave"] <= 12 and 0 <= m["test_accuracy"] <= 1 for m in live)
    assert len(final) == 1 and final[0]["wave"] == 12
    assert not [m for m in metrics if m["event"] == "eval_failed"]
    # every line carries its event's own time: none before the launcher started, pulls carry their weights'
    # age
    start = metrics[0]
    assert start["event"] == "run_start" and all(m["t"] >= start["t"] for m in metrics)
    assert {m["age_waves"] for m in metrics if m["event"] == "pull"} == {1}  # exact pulls, D = 0: W_{c-1}
    steps = ["process", "imported", "data", "built", "registered", "rendezvous"]
    startups = [m for m in metrics if m["event"] == "startup"]
    assert sorted((m["vw"], m["stage"]) for m in startups) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for m in startups:
        points = [m["points"][s] for s in steps if s in m["points"]]
        assert points == sorted(points) and start["t"] - 1 <= points[0]
    summary = json.loads((tmp_path / "s.json").read_text())
    assert (
        0
        < summary["startup_s"]["launcher_ready"]
        <= summary["startup_s"]["ps_ready"]
        <= summary["startup_s"]["first_minibatch"]
    )
    # our own warnings are fixed at their cause: none in any process's log
    for log in (run_dir / "logs").glob("*.log"):
        assert "Warning" not in log.read_text(), log
    if HAS_TENSORBOARD:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        acc = EventAccumulator(str(board))
        acc.Reload()
        assert {
            "vw0/loss",
            "vw1/samples_per_s",
            "vw0/gate_wait_s",
            "vw1/lead_waves",
            "vw0/pulled_age_waves",
            "eval/test_accuracy",
        } <= set(acc.Tags()["scalars"])
    exported = subprocess.run(
        [sys.executable, "-m", "hetpipe", "export", str(run_dir), "--out", str(tmp_path / "m.pt")],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert exported.returncode == 0, exported.stderr
    import torch

    from hetpipe.compute.build import dataset_of
    from hetpipe.core.config.files import load_config

    model = torch.load(tmp_path / "m.pt", weights_only=False)
    assert model.state_dict()["0.1.num_batches_tracked"].dtype == torch.int64
    test = dataset_of(load_config(run_dir / "config.toml")).test
    with torch.no_grad():
        predicted = model(test.x[:200]).argmax(-1)
    assert round(float((predicted == test.y[:200]).float().mean()), 4) == summary["test_accuracy"]


def test_local_placement_keeps_each_nodes_layers_on_its_own_shard(tmp_path: Path):
    """ED-local: two nodes, two VWs each with a GPU on both; shard i (node i) holds exactly node i's layers
    and the audited WSP guarantees hold."""
    from hetpipe.compute.build import model_of
    from hetpipe.server.checkpoint import load_newest

    path = write_config(
        tmp_path, vws=[["n0:0", "n1:0"], ["n0:1", "n1:1"]], nm=2, staleness=0, waves=3, hidden=(24, 16, 16)
    )
    text = path.read_text().replace(
        '[checkpoint]\ndir = ""', f'[checkpoint]\ndir = "{tmp_path / "unused"}"\nevery = 1'
    )
    text = text.replace("[wsp]", '[ps]\nshards = 2\nplacement = "local"\n[wsp]')
    path.write_text(text + '\n[[nodes]]\nname = "n1"\ngpus = ["g0", "g0"]\ndevices = ["cpu", "cpu"]\n')
    text = path.read_text()
    for v in (0, 1):  # layers 0-1 (a flatten and a linear layer) on n0, 2-4 on n1, in both VWs
        text = text.replace(
            f'gpus = ["n0:{v}", "n1:{v}"]\n', f'gpus = ["n0:{v}", "n1:{v}"]\nlayers = [2, 3]\n'
        )
    path.write_text(text)
    config = load_config(path)
    summary = train(config, TrainOptions(run_dir=tmp_path / "run", progress=False, audit=True))
    assert summary["audit_final_ledgers_exact"] is True
    keys = [set(load_newest(tmp_path / "run" / "ps" / f"shard-{s}", print).arrays) for s in (0, 1)]
    layers = [{int(k.split("/")[-1].split(".")[0]) for k in found if not k.startswith("_")} for found in keys]
    assert layers == [{0, 1}, {2, 3, 4}], keys
    assert model_of(config).num_layers == 5


def test_spread_placement_with_node_relays_puts_whole_layers_on_each_nodes_shard(tmp_path: Path):
    """Spread: two nodes, two one-GPU VWs on each, pushing and pulling through their node's relay (one per
    shard); the largest layer (1: 784 x 24 weights) is all of shard 0's, the four small ones shard 1's, and
    the audited WSP guarantees hold."""
    from hetpipe.server.checkpoint import load_newest

    path = write_config(
        tmp_path,
        vws=[["n0:0"], ["n0:1"], ["n1:0"], ["n1:1"]],
        nm=2,
        staleness=0,
        waves=3,
        hidden=(24, 16, 16),
    )
    text = path.read_text().replace(
        '[checkpoint]\ndir = ""', f'[checkpoint]\ndir = "{tmp_path / "unused"}"\nevery = 1'
    )
    text = text.replace("[wsp]", '[ps]\nshards = 2\nplacement = "spread"\nnode_aggregation = true\n[wsp]')
    path.write_text(text + '\n[[nodes]]\nname = "n1"\ngpus = ["g0", "g0"]\ndevices = ["cpu", "cpu"]\n')
    config = load_config(path)
    summary = train(config, TrainOptions(run_dir=tmp_path / "run", progress=False, audit=True))
    assert summary["audit_final_ledgers_exact"] is True
    keys = [set(load_newest(tmp_path / "run" / "ps" / f"shard-{s}", print).arrays) for s in (0, 1)]
    layers = [{int(k.split("/")[-1].split(".")[0]) for k in found if not k.startswith("_")} for found in keys]
    assert layers == [{1}, {0, 2, 3, 4}], keys
