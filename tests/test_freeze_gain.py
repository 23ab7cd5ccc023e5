"""A plan with the model's first layers frozen (hetpipe.core.planning.freeze_gain) against hand-worked
figures, and `hetpipe plan`'s prediction of it at each [train] freeze point."""

from __future__ import annotations

from dataclasses import replace

import pytest

from hetpipe.core.planning.candidates import Candidate, seconds_for
from hetpipe.core.planning.freeze_gain import frozen_plan, frozen_profiles
from hetpipe.core.planning.plan import Plan, StagePlan, VwPlan
from hetpipe.core.planning.profile import LayerProfile, ModelProfile

# 4 layers: backward 1, 2, 3, 4 s; weights 100, 0, 300, 600 bytes
LAYERS = tuple(
    LayerProfile(f"l{i}", 0.5, float(i + 1), nbytes, nbytes, 8, 8, 0)
    for i, nbytes in enumerate((100, 0, 300, 600))
)
PROFILE = ModelProfile("toy", 4, "g", "float32", "x", 8, LAYERS)


def stage(start: int, stop: int, backward_s: float, param_bytes: int = 0) -> StagePlan:
    return StagePlan("n0:0", "g", start, stop, 1.0, backward_s, 0.1, 0.1, 10, 100, param_bytes)


def test_each_stage_loses_the_frozen_layers_share_of_its_backward_and_of_its_weights() -> None:
    # stage 0: layers 0-1 (backward 3 s of profile time, here 6 s: another batch); stage 1: layers 2-3
    vw = VwPlan((stage(0, 2, 6.0, 100), stage(2, 4, 7.0, 900)), nm=2, param_bytes=1000)
    plan = Plan("explicit", "toy", 4, 0, (vw,))
    one = frozen_plan(plan, {"g": PROFILE}, 1).vws[0]
    assert [s.backward_s for s in one.stages] == [pytest.approx(6.0 * 2 / 3), 7.0]
    assert [s.param_bytes for s in one.stages] == [0, 900] and one.param_bytes == 900
    three = frozen_plan(plan, {"g": PROFILE}, 3).vws[0]
    assert [s.backward_s for s in three.stages] == [pytest.approx(0.0), pytest.approx(7.0 * 4 / 7)]
    assert [s.param_bytes for s in three.stages] == [0, 600] and three.param_bytes == 600
    assert [s.forward_s for s in three.stages] == [1.0, 1.0]  # a frozen layer still runs forward
    assert [(s.recv_s, s.send_s, s.memory_bytes) for s in three.stages] == [(0.1, 0.1, 10)] * 2
    assert frozen_plan(plan, {"g": PROFILE}, 0) == plan


def test_stages_without_their_own_bytes_take_the_vws_by_layer_count() -> None:
    vw = VwPlan((stage(0, 2, 6.0), stage(2, 4, 7.0)), nm=2, param_bytes=1000)  # 500 bytes a stage
    frozen = frozen_plan(Plan("explicit", "toy", 4, 0, (vw,)), {"g": PROFILE}, 1).vws[0]
    assert [s.param_bytes for s in frozen.stages] == [0, 500]


def test_a_re_plans_profiles_take_no_backward_for_the_frozen_layers_and_keep_the_rest() -> None:
    """A re-plan searches the model with its first layers frozen from the start: their backward is 0 s and
    their optimizer state gone, their forward, weights and activations as measured; the later layers as they
    were."""
    (frozen,) = frozen_profiles({"g": PROFILE}, 2).values()
    assert [layer.backward_s for layer in frozen.layers] == [0.0, 0.0, 3.0, 4.0]
    assert [layer.optimizer_bytes for layer in frozen.layers] == [0, 0, 300, 600]
    for got, want in zip(frozen.layers, PROFILE.layers, strict=True):
        assert (got.forward_s, got.param_bytes, got.saved_bytes) == (
            want.forward_s,
            want.param_bytes,
            want.saved_bytes,
        )


def test_with_the_cache_a_stage_loses_the_frozen_layers_share_of_its_forward_too() -> None:
    """[train] freeze_cache_mib: the frozen layers' outputs come from kept rows, so their forward goes (the
    profile's 0.5 s each, a stage's 1.0 s here)."""
    vw = VwPlan((stage(0, 2, 6.0, 100), stage(2, 4, 7.0, 900)), nm=2, param_bytes=1000)
    plan = Plan("explicit", "toy", 4, 0, (vw,))
    one = frozen_plan(plan, {"g": PROFILE}, 1, cached=True).vws[0]
    assert [s.forward_s for s in one.stages] == [pytest.approx(0.5), 1.0]
    three = frozen_plan(plan, {"g": PROFILE}, 3, cached=True).vws[0]
    assert [s.forward_s for s in three.stages] == [pytest.approx(0.0), pytest.approx(0.5)]
    assert three.stages[1].backward_s == frozen_plan(plan, {"g": PROFILE}, 3).vws[0].stages[1].backward_s


def test_seconds_over_stretches_of_the_run_at_their_own_rates() -> None:
    segments = [(0.0, 100.0), (1000.0, 200.0), (3000.0, 1000.0)]
    assert [seconds_for(n, segments) for n in (500, 2000, 5000)] == [5.0, 15.0, 22.0]


def test_time_to_target_prices_each_freeze_point_and_the_cache_an_epoch_after_it() -> None:
    """One VW of Nm 2 x 4 samples (8 a wave), frozen from wave 1 at 200 samples/s, 1,000 once the cache
    holds an epoch of 80 samples: 8 samples at 100, 80 at 200, the rest at 1,000."""
    vw = VwPlan((stage(0, 4, 6.0, 1000),), nm=2, param_bytes=1000)
    base = Candidate("explicit", 0, Plan("explicit", "toy", 4, 0, (vw,)), 100.0, samples_to_target=1000)
    frozen = replace(base, after_freeze=((1, 1, 200.0),))
    cached = replace(frozen, cached_after_freeze=((1, 1, 1000.0),), epoch_samples=80)
    assert base.time_to_target_s == pytest.approx(10.0)
    assert frozen.time_to_target_s == pytest.approx(8 / 100 + 992 / 200)
    assert cached.time_to_target_s == pytest.approx(8 / 100 + 80 / 200 + 912 / 1000)
    two = replace(cached, after_freeze=((1, 1, 200.0), (5, 2, 400.0)))  # the cache is cut off at wave 5
    assert two.rate_segments() == [(0.0, 100.0), (8.0, 200.0), (40.0, 400.0)]
