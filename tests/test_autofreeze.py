"""The adaptive freezing rule (hetpipe.core.wsp.autofreeze) against literal tables, the shards' movement
records (hetpipe.core.wsp.movement) in a shard, its checkpoint and on the wire, and the config's refusals."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from hetpipe.core.config.files import load_config
from hetpipe.core.config.overrides import apply_overrides
from hetpipe.core.errors import ConfigError
from hetpipe.core.protocol.wire import WireError, decode, encode
from hetpipe.core.wsp.aggregation import SumAggregation
from hetpipe.core.wsp.autofreeze import AutoFreeze, AutoFreezeState
from hetpipe.core.wsp.freezing import FreezePoint
from hetpipe.core.wsp.movement import MovementLog, combined
from hetpipe.core.wsp.state import ShardState

from conftest import write_config

F32 = np.float32


def moved(*relative: float) -> dict[int, tuple[float, float]]:
    """Layers 0, 1, ... with these relative movements (Q = m^2, N = 1); None-free."""
    return {layer: (m * m, 1.0) for layer, m in enumerate(relative)}


@pytest.mark.parametrize(
    ("frozen", "layers", "movement", "rate", "ceiling", "after"),
    [
        # the least moved is layer 1: freeze 0-1, within half of 8 and 3/4 of 8
        (0, 8, moved(0.3, 0.1, 0.2, 0.5, 0.6, 0.7, 0.8, 0.9), 0.5, 0.75, 2),
        # the least moved is layer 6: half of the 8 trainable layers caps it at 4
        (0, 8, moved(0.3, 0.5, 0.4, 0.5, 0.6, 0.7, 0.01, 0.9), 0.5, 0.75, 4),
        # 4 frozen: the candidates are 4-6; layer 6 least, half of the 4 left caps at 6, the ceiling at 6
        (4, 8, moved(0, 0, 0, 0, 0.6, 0.7, 0.01, 0.9), 0.5, 0.75, 6),
        # the ceiling (0.5 of 8) binds before the rate
        (3, 8, moved(0, 0, 0, 0.9, 0.6, 0.7, 0.01, 0.9), 1.0, 0.5, 4),
        # the last layer never freezes, however still: layer 2 bounds it
        (0, 4, moved(0.5, 0.4, 0.3, 0.0), 1.0, 0.99, 3),
        # at the ceiling already: nothing more
        (6, 8, moved(0, 0, 0, 0, 0, 0, 0.01, 0.9), 0.5, 0.75, 6),
        # a rate too small to free a whole layer freezes none
        (0, 8, moved(0.1, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9), 0.1, 0.75, 0),
        # layers without parameters (absent) are no candidates; equal movements take the first
        (0, 6, {0: (1.0, 4.0), 2: (1.0, 4.0), 4: (9.0, 1.0), 5: (1.0, 1.0)}, 0.5, 0.75, 1),
        # a layer of all zeros moved infinitely: the other one is least
        (0, 4, {0: (0.0, 0.0), 1: (4.0, 1.0), 3: (1.0, 1.0)}, 0.5, 0.75, 2),
    ],
)
def test_the_frozen_prefix_after_a_boundary(
    frozen: int, layers: int, movement: dict, rate: float, ceiling: float, after: int
) -> None:
    assert AutoFreeze(2, rate, ceiling).frozen_after(frozen, layers, movement) == after


def test_points_start_d_plus_1_waves_after_their_boundary_and_only_inside_the_run() -> None:
    state = AutoFreezeState(AutoFreeze(3), num_layers=8, staleness=2, num_waves=12)
    assert state.observe(3, moved(0.3, 0.1, 0.2, 0.5, 0.6, 0.7, 0.8, 0.9)) == FreezePoint(6, 2)
    assert state.observe(3, moved(0, 0, 0, 0, 0, 0, 0.01, 0.9)) is None  # a boundary seen before
    assert state.observe(6, moved(0, 0, 0.9, 0.1, 0.6, 0.7, 0.8, 0.9)) == FreezePoint(9, 4)
    assert (
        state.observe(9, moved(0, 0, 0, 0, 0.9, 0.9, 0.01, 0.9)) is None
    )  # from wave 12: past the run's last
    assert state.frozen == 4 and state.schedule.frozen(8) == 2 and state.schedule.frozen(9) == 4
    assert state.decided == [3, 6, 9]
    with pytest.raises(ValueError, match="every 3 versions, in order"):
        state.observe(7, moved(0.1))
    with pytest.raises(ValueError, match="in order"):
        AutoFreezeState(AutoFreeze(3), 8, 0, 20, decided=[6]).observe(3, moved(0.1))


def test_a_shards_records_sum_the_wave_updates_by_layer_and_the_norm_at_each_boundary() -> None:
    log = MovementLog(2)
    w = [{"0.w": np.array([3.0, 4.0], F32), "0.b": np.array([0.0], F32), "1.w": np.array([1.0], F32)}]
    w.append({"0.w": np.array([3.0, 5.0], F32), "0.b": np.array([2.0], F32), "1.w": np.array([1.0], F32)})
    w.append({"0.w": np.array([4.0, 5.0], F32), "0.b": np.array([2.0], F32), "1.w": np.array([3.0], F32)})
    w.append({"0.w": np.array([4.0, 5.0], F32), "0.b": np.array([2.0], F32), "1.w": np.array([0.0], F32)})
    for t in (1, 2, 3):
        log.built(t, w[t - 1], w[t], ["0.b", "0.w", "1.w"])
    # interval (0, 2]: layer 0 moved 1 + 4 (wave 0) + 1 (wave 1), layer 1 moved 4; norms of W_2
    assert log.records == {2: {0: (6.0, 45.0), 1: (4.0, 9.0)}}
    assert log.acc == {0: 0.0, 1: 9.0}
    assert log.since(-1, 2) == [[2, [[0, 6.0, 45.0], [1, 4.0, 9.0]]]] and log.since(2, 3) == []
    assert MovementLog.from_meta(log.to_meta()) == log
    # two shards' parts add up to the whole, whatever the keys' split
    halves = [MovementLog(2), MovementLog(2)]
    for t in (1, 2):
        halves[0].built(t, w[t - 1], w[t], ["0.b", "1.w"])
        halves[1].built(t, w[t - 1], w[t], ["0.w"])
    assert combined(h.since(-1, 2) for h in halves) == log.since(-1, 2)


def test_a_shard_records_the_movement_of_what_it_builds_and_sends_it_once_with_pulls() -> None:
    shard = ShardState(0, "exact", SumAggregation(), autofreeze=2)
    start = {"0.w": np.zeros(2, F32), "0.bn": np.zeros(2, F32), "1.w": np.ones(1, F32)}
    shard.register(0, 0, 1, 1, start, {"0.bn": "buffer"}, 10)
    pulled = {}
    for wave in range(6):
        if wave == 5:
            pulled = {known: shard.pull(0, 0, 5, known=known).movement for known in (-1, 2, 4)}  # W_4
        pushed = {"0.w": np.full(2, F32(wave)), "0.bn": np.full(2, F32(50)), "1.w": np.full(1, F32(1))}
        shard.push(0, 0, wave, pushed)
    # W_t: 0.w = 0 + 1 + ... + (t - 1) each, 1.w = 1 + t; the buffer is no movement
    assert shard.movement is not None and sorted(shard.movement.records) == [2, 4, 6]
    assert shard.movement.records[4] == {0: (2 * (2.0**2 + 3.0**2), 2 * 6.0**2), 1: (2.0, 25.0)}
    assert [[b for b, _ in records] for records in pulled.values()] == [[2, 4], [4], []]
    alone = shard.pull(0, 0, 6, known=2, records_only=True)  # a lone VW's WAIT: W_5's records, no weights
    assert alone.tensors == {} and [b for b, _ in alone.movement] == [4]
    meta, arrays = shard.to_state()
    again = ShardState.from_state(meta, arrays)
    assert again.movement == shard.movement
    plain = ShardState(0, "exact")
    plain.register(0, 0, 1, 1, start, {"0.bn": "buffer"}, 10)
    assert plain.pull(0, 0, 1).movement is None


def test_movement_travels_in_a_pull_reply_and_bad_records_are_refused() -> None:
    fields = {"id": 1, "wave": 3, "version": 2, "own_through": 1, "parked_ms": 0, "gaps": []}
    records = [[2, [[0, 6.0, 45.0], [3, 0.0, 1.5]]]]
    assert decode(encode("weights", {**fields, "movement": records})).fields["movement"] == records
    pull = {"id": 2, "run": "r", "vw": 0, "stage": 0, "wave": 4, "known": -1, "records_only": True}
    assert decode(encode("pull", pull)).fields == pull
    for bad in ([[0, []]], [[2, [[0, 1, 2.0]]]], [[2, [[0, -1.0, 2.0]]]], [[2, [[0, math.nan, 1.0]]]], [2]):
        with pytest.raises(WireError, match="movement must be"):
            encode("weights", {**fields, "movement": bad})
    with pytest.raises(WireError, match="unknown field 'moves'"):
        encode("weights", {**fields, "moves": records})


@pytest.mark.parametrize(
    ("settings", "match"),
    [
        (["train.autofreeze_every=2", "train.freeze=[[2, 1]]"], "keep one: remove freeze"),
        (["train.autofreeze_every=2", 'wsp.pull="latest"'], 'set \\[wsp\\] pull = "exact"'),
        (["train.autofreeze_every=2", "ps.node_aggregation=true"], "set node_aggregation = false"),
        (["train.autofreeze_every=2", 'ps.aggregation="server"'], "or set autofreeze_every = 0"),
        (["train.autofreeze_every=2", "train.autofreeze_rate=1.5"], "autofreeze_rate to a number in"),
        (["train.autofreeze_every=2", "train.autofreeze_ceiling=1.0"], "autofreeze_ceiling"),
        (["train.autofreeze_every=-1"], "autofreeze_every"),
    ],
)
def test_the_config_refuses_what_the_rule_cannot_run_with(
    tmp_path: Path, settings: list[str], match: str
) -> None:
    path = write_config(tmp_path, vws=[["n0:0"], ["n0:1"]], nm=2, staleness=1, waves=10)
    with pytest.raises(ConfigError, match=match):
        apply_overrides(load_config(path), settings)


def test_planned_spans_refuse_the_adaptive_rule(tmp_path: Path) -> None:
    path = write_config(tmp_path, vws=[["n0:0", "n0:1"], ["n0:0"]], nm=2, staleness=0, waves=6)
    head, *tables = path.read_text().split("[[virtual_workers]]\n")
    spans = [(0, 3), (3, 6)]
    path.write_text(
        head
        + "".join(f"[[virtual_workers]]\nwaves = {list(s)}\n{t}" for s, t in zip(spans, tables, strict=True))
    )
    assert load_config(path).virtual_workers[1].waves == (3, 6)
    with pytest.raises(ConfigError, match="a re-plan is planned at fixed freeze points"):
        apply_overrides(load_config(path), ["train.autofreeze_every=2"])
