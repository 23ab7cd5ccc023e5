"""Checkpoints: atomic files with sha256 manifests; SIGKILL + restart resumes bit for bit; a corrupted
newest checkpoint is refused with a clear message and the previous one is used."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import numpy as np
import pytest

from hetpipe.server.checkpoint import CheckpointError, list_manifests, load_newest, write_checkpoint
from hetpipe.server.shard import ShardSettings
from hetpipe.worker.ps_client import PSClient

from conftest import start_shard


def test_write_and_load_round_trip(tmp_path: Path):
    arrays = {"w/a": np.arange(5, dtype=np.float32), "w/b": np.ones((2, 3), np.float32)}
    for clock in (1, 2, 3, 4):
        write_checkpoint(tmp_path, clock, {"clock": clock, "c_local": [clock]}, arrays, keep=2)
    assert [p.name for p in list_manifests(tmp_path)] == ["ckpt-00000003.json", "ckpt-00000004.json"]
    assert not list(tmp_path.glob(".*tmp"))
    ckpt = load_newest(tmp_path, log=lambda m: None)
    assert ckpt is not None and ckpt.clock == 4 and ckpt.meta["clock"] == 4
    for key, arr in arrays.items():
        assert np.array_equal(ckpt.arrays[key], arr) and ckpt.arrays[key].dtype == arr.dtype


def test_corrupt_newest_falls_back_and_all_corrupt_is_refused(tmp_path: Path):
    for clock in (1, 2):
        write_checkpoint(tmp_path, clock, {"c": clock}, {"w/a": np.full(4, clock, np.float32)}, keep=3)
    newest = tmp_path / "ckpt-00000002.bin"
    data = bytearray(newest.read_bytes())
    data[-1] ^= 0xFF
    newest.write_bytes(bytes(data))
    messages: list[str] = []
    ckpt = load_newest(tmp_path, log=messages.append)
    assert ckpt is not None and ckpt.clock == 1
    assert "ckpt-00000002.bin: sha256 does not match" in messages[0]
    (tmp_path / "ckpt-00000001.bin").write_bytes(b"short")
    with pytest.raises(CheckpointError, match="no valid checkpoint .* move that directory away"):
        load_newest(tmp_path, log=messages.append)
    assert load_newest(tmp_path / "none", log=messages.append) is None


def wait_for(path: Path, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.02)


@pytest.mark.slow
def test_sigkill_restart_resumes_bit_for_bit(children, tmp_path: Path):
    ckdir = tmp_path / "ckpt"
    settings = ShardSettings(
        "ck", 0, "tcp://127.0.0.1:0", 1, "exact", ckdir, checkpoint_every=1, checkpoint_keep=5
    )
    endpoint, server = start_shard(children, settings, name="ps-a")
    rng = np.random.default_rng(0)
    shape = (64, 33)
    place = {"x": 0, "y": 0}
    a = PSClient([endpoint], "ck", 0, 0, 2, 1, place, timeout_s=10, retry_s=0.5)
    b = PSClient([endpoint], "ck", 1, 0, 2, 1, place, timeout_s=10, retry_s=0.5)
    init = {k: rng.standard_normal(shape).astype(np.float32) for k in place}
    a.register(init)
    b.register(init)
    snapshots = {}
    for wave in range(4):
        for client in (b, a):  # arrival order differs from VW order: the sum must not care
            client.push(wave, {k: rng.standard_normal(shape).astype(np.float32) for k in place})
        wait_for(ckdir / f"ckpt-{wave + 1:08d}.json")
        snapshots[wave + 1] = (a.read(), a.status()[0])
    a.push(4, {k: np.ones(shape, np.float32) for k in place})  # after checkpoint 4: lost by the kill
    os.kill(server.process.pid, signal.SIGKILL)
    server.process.join(5)
    a.close()
    b.close()

    def restart(name: str):
        """Start the shard again on the same checkpoint directory; its weights, status and the child."""
        endpoint, child = start_shard(children, settings, name=name)
        with PSClient([endpoint], "ck", 0, 0, 2, 1, place, timeout_s=10, retry_s=0.5) as c:
            return c.read(), c.status()[0], child

    weights, status, server = restart("ps-b")
    want_weights, want_status = snapshots[4]
    for k in place:
        assert np.array_equal(weights[k], want_weights[k])
    for key in ("c_global", "c_local", "version", "pending_waves", "registered"):
        assert status[key] == want_status[key]
    assert "resumed from" in server.log.read_text()

    os.kill(server.process.pid, signal.SIGKILL)
    server.process.join(5)
    newest = ckdir / "ckpt-00000004.bin"
    data = bytearray(newest.read_bytes())
    data[len(data) // 2] ^= 0x01
    newest.write_bytes(bytes(data))
    weights, status, server = restart("ps-c")
    want_weights, want_status = snapshots[3]
    for k in place:
        assert np.array_equal(weights[k], want_weights[k])
    assert status["c_local"] == want_status["c_local"] == [3, 3]
    log = server.log.read_text()
    assert "refusing checkpoint ckpt-00000004.bin: sha256 does not match" in log
    assert "resumed from" in log and "ckpt-00000003.bin" in log


def test_acks_say_the_oldest_checkpoint_kept_so_stages_keep_snapshots_back_to_it(children, tmp_path: Path):
    # a full disk under the PS's checkpoints left it holding clocks 8-10 while the stages, counting on
    # checkpoints at every clock up to c_global, had dropped their snapshots before 11: no resume was possible
    ckdir = tmp_path / "ckpt"
    settings = ShardSettings(
        "fl", 0, "tcp://127.0.0.1:0", 0, "exact", ckdir, checkpoint_every=1, checkpoint_keep=2
    )
    endpoint, _ = start_shard(children, settings, name="ps-floor")
    with PSClient([endpoint], "fl", 0, 0, 1, 1, {"x": 0}, timeout_s=10, retry_s=0.5) as ps:
        ps.register({"x": np.zeros(4, np.float32)})
        assert ps.checkpoint_floor == 0  # none on disk yet: a stage keeps every snapshot
        for wave in range(3):
            ps.push(wave, {"x": np.ones(4, np.float32)})
            wait_for(ckdir / f"ckpt-{wave + 1:08d}.json")
        deadline = time.monotonic() + 10
        while ps.checkpoint_floor != 2 and time.monotonic() < deadline:  # the writer thread notes it after
            ps.send_heartbeat(0)  # its reply says it (so do acks and registration replies)
            ps.status()  # a call that reads the replies come in meanwhile
            time.sleep(0.05)
        assert [c for c in range(1, 4) if (ckdir / f"ckpt-{c:08d}.json").exists()] == [2, 3]
        assert ps.checkpoint_floor == 2
