"""The shard's recovery rules without sockets: how far a client must keep its pushes, heartbeats that stop,
on_vw_failure (hetpipe.server.shard, docs/recovery.md)."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest

from hetpipe.core.wsp.state import WspError
from hetpipe.server.shard import ShardServer, ShardSettings


def shard(tmp_path: Path | None = None, **changes) -> ShardServer:
    settings = ShardSettings(
        "r",
        0,
        "tcp://127.0.0.1:0",
        0,
        "exact",
        checkpoint_dir=tmp_path,
        checkpoint_every=1 if tmp_path else 0,
        **changes,
    )
    server = ShardServer(settings, log=lambda line: None)
    for vw in range(2):
        for stage in range(2):
            server.state.register(vw, stage, 2, 2, {f"k{stage}": np.zeros(2, np.float32)}, num_waves=4)
            server.beats[(vw, stage)] = (time.monotonic(), 0)
    return server


def push_all(server: ShardServer, wave: int, vws=(0, 1)) -> None:
    for vw in vws:
        for stage in (0, 1):
            server.state.push(vw, stage, wave, {f"k{stage}": np.ones(2, np.float32)})


def test_without_periodic_checkpoints_a_client_keeps_nothing():
    server = shard()
    push_all(server, 0)
    assert server.keep_from((0, 0)) == 1  # a crash loses everything anyway: keeping pushes would not help


def test_a_client_keeps_what_the_newest_checkpoint_lacks(tmp_path: Path):
    server = shard(tmp_path)
    push_all(server, 0)
    assert server.keep_from((0, 0)) == 0
    server.checkpoint("test")
    push_all(server, 1)
    assert server.keep_from((0, 0)) == 1 and server.state.pushed[(0, 0)] == 2
    restarted = ShardServer(server.settings, log=lambda line: None)
    assert restarted.state.pushed[(0, 0)] == 1 and restarted.keep_from((0, 0)) == 1


def test_a_silent_stage_gets_its_vw_evicted_and_the_others_go_on():
    server = shard(on_vw_failure="evict", hung_after_s=10.0)
    push_all(server, 0)
    now = time.monotonic()
    for sid in [(0, 0), (0, 1), (1, 1)]:
        server.beats[sid] = (now + 20, 5)
    server._check_heartbeats(now + 5)
    assert server.state.live_vws() == [0, 1]
    server._check_heartbeats(now + 25)  # vw 1 stage 0 last beat 25 s ago
    assert server.state.live_vws() == [0] and server.failed is None
    push_all(server, 1, vws=(0,))
    assert server.state.c_global == 2


def test_a_silent_stage_stops_the_run_by_default_naming_it():
    server = shard(hung_after_s=10.0)
    server.beats[(1, 0)] = (time.monotonic() - 30, 3)
    server._check_heartbeats(time.monotonic())
    assert server.failed and "vw 1 stage 0 sent no heartbeat for 30 s" in server.failed
    assert 'on_vw_failure = "stop"' in server.failed and server.state.live_vws() == [0, 1]


def test_finished_stages_may_fall_silent():
    server = shard(on_vw_failure="evict", hung_after_s=10.0)
    for wave in range(4):
        push_all(server, wave)
    server._check_heartbeats(time.monotonic() + 60)
    assert server.state.live_vws() == [0, 1]


def test_eviction_on_request_needs_the_evict_policy():
    server = shard()
    with pytest.raises(WspError) as err:
        server._evict_policy("evict of vw 1")
    assert err.value.code == "conflict" and '"evict"' in str(err.value)
