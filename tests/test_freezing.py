"""The fixed freezing schedule's rule (hetpipe/core/wsp/freezing.py) against literal tables."""

from __future__ import annotations

import pytest

from hetpipe.core.wsp.freezing import FreezePoint, FreezeSchedule

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
