"""The fixed freezing schedule's rule (hetpipe/core/wsp/freezing.py) against literal tables, and the PS's side
of it: frozen parameters left off the wire (ShardState, RelayState)."""

from __future__ import annotations

import numpy as np
import pytest

from hetpipe.core.wsp.aggregation import MeanAggregation
from hetpipe.core.wsp.freezing import FreezePoint, FreezeSchedule
from hetpipe.core.wsp.relay import RelayState
from hetpipe.core.wsp.state import ShardState, WspError

# 5 layers, 8 waves: layer 0 frozen from wave 2, layers 1 and 2 from wave 4; layers 3 and 4 always train
SCHEDULE = FreezeSchedule.of([[2, 1], [4, 3]], num_layers=5, waves=8, where="t.toml train.freeze")


def test_the_frozen_prefix_by_wave() -> None:
    assert SCHEDULE.points == (FreezePoint(2, 1), FreezePoint(4, 3))
    assert [SCHEDULE.frozen(w) for w in range(8)] == [0, 0, 1, 1, 3, 3, 3, 3]
    assert [SCHEDULE.frozen_from(layer) for layer in range(5)] == [2, 4, 4, None, None]
    assert FreezeSchedule().frozen(7) == 0 and FreezeSchedule().frozen_from(0) is None


def test_what_trains_and_is_pushed_by_layer_and_wave() -> None:
    table = [[SCHEDULE.pushes(layer, w) for w in range(6)] for layer in range(5)]
    assert table == [
        [True, True, False, False, False, False],
        [True, True, True, True, False, False],
        [True, True, True, True, False, False],
        [True] * 6,
        [True] * 6,
    ]
    assert all(SCHEDULE.trains(layer, w) == table[layer][w] for layer in range(5) for w in range(6))


@pytest.mark.parametrize("staleness", [0, 1, 2])
def test_a_frozen_layer_is_pulled_through_w_f_by_the_gate_of_wave_f_plus_d_plus_1(staleness: int) -> None:
    # the gate of wave c pulls W_{c-D-1} (docs/wsp.md#gate); layer 0 freezes from wave 2
    pulled = [c for c in range(staleness + 2, 8) if SCHEDULE.pulls(0, c - staleness - 1)]
    assert pulled == list(range(staleness + 2, 2 + staleness + 2))
    assert pulled[-1] - staleness - 1 == 2  # the last pull is of W_f
    assert all(SCHEDULE.pulls(3, v) for v in range(8))


def test_which_stages_run_backward_and_send_their_input_gradient() -> None:
    stages = [(0, 1), (1, 3), (3, 5)]  # layers start ... stop - 1
    backward = [[SCHEDULE.runs_backward(a, b, w) for w in range(6)] for a, b in stages]
    assert backward == [
        [True, True, False, False, False, False],
        [True, True, True, True, False, False],
        [True] * 6,
    ]
    sends = [[SCHEDULE.wants_input_gradient(a, w) for w in range(6)] for a, _ in stages]
    assert sends == [
        [False] * 6,  # the first stage has none to send
        [True, True, False, False, False, False],  # stage 0 frozen whole from wave 2
        [True, True, True, True, False, False],  # stages 0 and 1 from wave 4
    ]
    # a stage partly frozen still runs its backward, and the stage after it still sends it a gradient
    assert SCHEDULE.runs_backward(0, 3, 2) and SCHEDULE.wants_input_gradient(3, 2)


@pytest.mark.parametrize(
    ("pairs", "match"),
    [
        ([[2, 1], [2, 3]], r"train.freeze\[1\] = \[2, 3\] after \[2, 1\]: list the points by wave"),
        ([[2, 3], [4, 1]], r"each freezing more layers than the one before \(a layer never thaws\)"),
        ([[0, 1]], r"wave 0 is outside the run's waves 1 ... 7"),
        ([[8, 1]], r"wave 8 is outside"),
        ([[2, 5]], r"5 layers frozen, but the model has 5: freeze 1 ... 4"),
        ([[2, 0]], r"0 layers frozen"),
        ([[2]], r"train.freeze\[0\] = \[2\]: write \[wave, layers\], two integers"),
        ([[2, 1.5]], r"two integers"),
        ([[True, 1]], r"two integers"),
    ],
)
def test_bad_schedules_are_refused_naming_the_point_and_the_fix(pairs: list, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        FreezeSchedule.of(pairs, num_layers=5, waves=8, where="t.toml train.freeze")


# ---- the PS's side: frozen parameters off the wire (ShardState, RelayState) ------------------------------
F32 = np.float32
FROZEN = FreezeSchedule.at([(2, 1)])  # layer 0 frozen from wave 2


def keys() -> dict[str, np.ndarray]:
    """Layer 0's weight and running statistic, layer 1's weight."""
    return {"0.w": np.zeros(2, F32), "0.bn": np.zeros(2, F32), "1.w": np.zeros(3, F32)}


def update(wave: int, frozen: bool) -> dict[str, np.ndarray]:
    """A push of `wave`: every key, or all but layer 0's weight."""
    out = {k: np.full(v.shape, F32(wave + 1)) for k, v in keys().items()}
    if frozen:
        del out["0.w"]
    return out


def test_a_shard_takes_pushes_without_frozen_weights_and_keeps_them_at_w_f() -> None:
    shard = ShardState(0, "exact", MeanAggregation(), FROZEN)
    for vw in range(2):
        shard.register(vw, 0, 2, 1, keys(), {"0.bn": "buffer"}, 6)
    built = [shard.versions[0]]
    for wave in range(4):
        if wave >= 2:  # from wave 2 a push carries exactly the unfrozen keys
            for wrong in (update(wave, False), {"0.bn": np.zeros(2, F32)}):
                with pytest.raises(WspError, match="less the parameters"):
                    shard.push(0, 0, wave, wrong)
        for vw in range(2):
            shard.push(vw, 0, wave, update(wave, wave >= 2))
        built.append(shard.versions[wave + 1])
    assert [float(w["0.w"][0]) for w in built] == [0, 1, 3, 3, 3]  # W_2's from then on
    assert [float(w["1.w"][0]) for w in built] == [0, 1, 3, 6, 10]
    assert float(built[4]["0.bn"][0]) == 4  # buffers still travel (and average)


def test_a_pull_carries_a_frozen_weight_through_w_f_and_a_stages_first_pull_carries_everything() -> None:
    shard = ShardState(0, "exact", MeanAggregation(), FROZEN)
    shard.register(0, 0, 1, 1, keys(), {"0.bn": "buffer"}, 8)
    carried = {}
    for wave in range(7):
        if wave == 5:  # the stage restarted (or its VW rejoined): it registers again
            shard.register(0, 0, 1, 1, keys(), {"0.bn": "buffer"}, 8)
        if wave >= 2:
            carried[wave] = set(shard.pull(0, 0, wave).tensors)
            if wave == 5:
                assert float(shard.pull(0, 0, wave).tensors["0.w"][0]) == 3  # a retry of it too: W_f's
        shard.push(0, 0, wave, update(wave, wave >= 2))
    everything, unfrozen = {"0.w", "0.bn", "1.w"}, {"0.bn", "1.w"}
    # W_1 (the first pull), W_2 = W_f, W_3, W_4 (the first pull since registering again), W_5
    assert carried == {2: everything, 3: everything, 4: unfrozen, 5: everything, 6: unfrozen}


def test_a_relay_leaves_frozen_weights_out_and_fills_a_first_pull_from_what_it_saw() -> None:
    relay = RelayState((0, 1), 0, MeanAggregation(), FROZEN)
    for vw in range(2):
        relay.register(vw, 0, 2, 1, keys(), {"0.bn": "buffer"}, 8, 0, ())
    for wave in range(3):
        for vw in range(2):
            relay.push(vw, 0, wave, update(wave, wave >= 2))
    sums = dict(relay.take_outbox())
    assert set(sums[1]) == {"0.w", "0.bn", "1.w"} and set(sums[2]) == {"0.bn", "1.w"}
    relay.receive(2, {k: np.full(v.shape, F32(2)) for k, v in keys().items()}, 2)  # W_2 = W_f, in full
    relay.receive(3, {"0.bn": np.ones(2, F32), "1.w": np.ones(3, F32)}, 3)  # W_3 without it
    assert float(relay.pull(0, 0, 4).tensors["0.w"][0]) == 2  # vw 0's first pull: W_3 and W_f's weight
    relay.receive(4, {"0.bn": np.ones(2, F32), "1.w": np.ones(3, F32)}, 4)
    assert set(relay.pull(0, 0, 5).tensors) == {"0.bn", "1.w"}
