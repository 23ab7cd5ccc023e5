"""hetpipe.core.pipeline.lr_schedule against tables worked out by hand from its docstring's formulas."""

from __future__ import annotations

import math

import pytest

from hetpipe.core.pipeline.lr_schedule import LrSchedule, lr_at

HALF_SQRT2 = math.sqrt(2.0) / 2.0  # cos(pi / 4)


def test_constant_is_lr_at_every_wave():
    s = LrSchedule("constant", 0.05)
    assert [lr_at(s, c) for c in range(5)] == [0.05] * 5


def test_cosine_warms_up_linearly_then_decays_to_min_lr_and_stays():
    # lr 1, warm-up 2, total 6: waves 0, 1 ramp (1/2, 2/2); waves 2..5 at q = 0, 1/4, 2/4, 3/4; then q = 1
    s = LrSchedule("cosine", 1.0, warmup_steps=2, total=6, min_lr=0.0)
    expected = [0.5, 1.0, 1.0, (1 + HALF_SQRT2) / 2, 0.5, (1 - HALF_SQRT2) / 2, 0.0, 0.0]
    assert [lr_at(s, c) for c in range(8)] == pytest.approx(expected, rel=0, abs=1e-15)
    assert lr_at(s, 0) == 0.5 and lr_at(s, 4) == 0.5  # the rational points exactly


def test_cosine_decays_to_min_lr_not_to_zero():
    # lr 0.1, min 0.02, no warm-up, total 2: q = 0, 1/2, 1 -> 0.1, 0.06, 0.02
    s = LrSchedule("cosine", 0.1, warmup_steps=0, total=2, min_lr=0.02)
    assert [lr_at(s, c) for c in range(4)] == pytest.approx([0.1, 0.06, 0.02, 0.02], rel=1e-12)


def test_cosine_warm_up_of_one_wave_starts_at_lr():
    s = LrSchedule("cosine", 0.4, warmup_steps=1, total=3)
    assert lr_at(s, 0) == 0.4 and lr_at(s, 1) == 0.4  # (0 + 1) / 1, then q = 0


def test_step_multiplies_by_gamma_every_n_waves():
    s = LrSchedule("step", 0.8, every=2, gamma=0.5)
    assert [lr_at(s, c) for c in range(7)] == [0.8, 0.8, 0.4, 0.4, 0.2, 0.2, 0.1]


def test_step_every_wave():
    s = LrSchedule("step", 1.0, every=1, gamma=0.25)
    assert [lr_at(s, c) for c in range(4)] == [1.0, 0.25, 0.0625, 0.015625]
