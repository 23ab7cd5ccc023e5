"""Exactly-once pushes across PS crashes: shards killed with SIGKILL mid-run and restarted from their
checkpoints while the stages go on; every stage's update lands exactly once (docs/recovery.md)."""

from __future__ import annotations

import os
import random
import signal
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from hetpipe.server.shard import ShardSettings
from hetpipe.worker.ps_client import PSClient, PSError

from conftest import start_shard
from ledger_client import LedgerSpec, ledger_keys, ledger_stage

pytestmark = pytest.mark.slow


def admin(endpoints: list[str], run: str) -> PSClient:
    return PSClient(endpoints, run, 0, 0, 1, 1, {}, timeout_s=20, retry_s=0.5)


@pytest.mark.parametrize("mode", ["exact", "latest"])
def test_shards_killed_and_restarted_lose_and_repeat_nothing(children, tmp_path: Path, mode: str):
    spec = LedgerSpec(run="chaos", num_vws=2, num_stages=2, num_waves=24, staleness=1, pull_mode=mode)
    settings, endpoints, servers = [], [], []
    for s in range(2):
        first = ShardSettings(
            spec.run,
            s,
            "tcp://127.0.0.1:0",
            spec.staleness,
            mode,
            tmp_path / f"shard-{s}",
            checkpoint_every=1,
        )
        endpoint, child = start_shard(children, first, name=f"ps{s}-0")
        settings.append(replace(first, endpoint=endpoint))  # a restart takes the same port
        endpoints.append(endpoint)
        servers.append(child)
    stages = [
        children.start(f"vw{v}-s{j}", ledger_stage, endpoints, spec, v, j, 0.05, 7)
        for v in range(spec.num_vws)
        for j in range(spec.num_stages)
    ]
    rng = random.Random(3)
    for kill in range(4):  # at random moments: mid-push, mid-checkpoint, while a pull is parked
        time.sleep(rng.uniform(0.2, 0.8))
        s = rng.randrange(2)
        os.kill(servers[s].process.pid, signal.SIGKILL)
        servers[s].process.join(5)
        servers[s] = start_shard(children, settings[s], name=f"ps{s}-{kill + 1}")[1]
    for stage in stages:
        stage.process.join(90)
        assert stage.process.exitcode == 0, stage.log.read_text()[-3000:]
    with admin(endpoints, spec.run) as ps:
        weights, infos = ps.read(), ps.status()
    for stage in range(spec.num_stages):
        for key in ledger_keys(spec, stage):
            np.testing.assert_array_equal(weights[key], np.ones((spec.num_vws, spec.num_waves), np.float32))
    assert all(info["c_global"] == spec.num_waves for info in infos)
    logs = "".join(child.log.read_text() for child in children.children if child.name.startswith("ps"))
    assert "registered again" in logs and "resumed from" in logs


def test_a_shard_restarted_without_checkpoints_says_the_pushes_are_gone(children, tmp_path: Path):
    """checkpoint every 0: nothing survives a crash; the client must not go on as if nothing happened."""
    first = ShardSettings("gone", 0, "tcp://127.0.0.1:0", 0, "exact", tmp_path / "ck", checkpoint_every=0)
    endpoint, server = start_shard(children, first, name="ps-a")
    with PSClient([endpoint], "gone", 0, 0, 1, 1, {"k": 0}, timeout_s=20, retry_s=0.3) as ps:
        ps.register({"k": np.zeros(3, np.float32)})
        for wave in range(3):
            ps.push(wave, {"k": np.ones(3, np.float32)})
        assert ps.retained == {}  # nothing to keep: the shard could not use it after a crash
        os.kill(server.process.pid, signal.SIGKILL)
        server.process.join(5)
        start_shard(children, replace(first, endpoint=endpoint), name="ps-b")
        with pytest.raises(PSError) as err:
            ps.push(3, {"k": np.ones(3, np.float32)})
        assert err.value.code == "lost" and "holding 0 waves" in str(err.value)
