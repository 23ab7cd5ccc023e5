"""A pipeline schedule and an aggregation rule defined in this file only, never in hetpipe, run through every
consumer: the validator, the CLI's choices, the simulators, the planner with its memory model and convergence
model, the reference, and a run of two virtual workers with exact pulls that equals the reference bit for bit.

Other processes (the stages and the PS shards of `hetpipe train`) find them by the names
"test_extension:TOY_SCHEDULE" and "test_extension:HalfSum", importing this module as a user's module would be.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from hetpipe.cli import cli
from hetpipe.compute.reference import run_reference
from hetpipe.core.config.files import load_config
from hetpipe.core.config.overrides import apply_overrides
from hetpipe.core.config.parse import parse_config
from hetpipe.core.config.schema import ClusterConfig
from hetpipe.core.pipeline.schedule import (
    SCHEDULES,
    ScheduleKind,
    format_lists,
    get_schedule,
    register_schedule,
    simulate,
    validate,
)
from hetpipe.core.planning.convergence import Setting, canonical, features
from hetpipe.core.planning.memory import MemoryRule
from hetpipe.core.planning.partition import minibatch_time_s
from hetpipe.core.planning.planner import best, plan_candidates
from hetpipe.core.planning.profile import LayerProfile, ModelProfile
from hetpipe.core.planning.simulate import simulate as simulate_plan
from hetpipe.core.wsp.aggregation import AGGREGATIONS, Aggregation, make_aggregation, register_aggregation

from conftest import write_config
from equivalence import assert_bitwise, assert_equals_reference, layout

SCHEDULE = "test_extension:TOY_SCHEDULE"
RULE = "test_extension:HalfSum"


def _one_at_a_time(stage: int, num_stages: int, nm: int, num_waves: int) -> list[tuple[str, int]]:
    """Every stage: the forward of a minibatch, then its backward, one minibatch at a time."""
    return [(kind, p) for p in range(num_waves * nm) for kind in ("F", "B")]


TOY_SCHEDULE = ScheduleKind(
    "toy-one-at-a-time",
    _one_at_a_time,
    update_every="wave",
    guarantee="wave",
    stashing="none",
    recompute=True,
    drains=True,
    summary="one minibatch in the pipe at a time, one update per wave (a test's schedule)",
)


class HalfSum(Aggregation):
    """Sum-like: every VW's update applied at half its size, W + S / 2."""

    name = "toy-half-sum"
    summary = "W + S / 2 (a test's rule)"

    def fold_param(self, key: str, w: np.ndarray, s: np.ndarray, num_vws: int) -> np.ndarray:
        return w + s * np.float32(0.5)


@pytest.fixture
def registered() -> Iterator[None]:
    """Both known by their short names too, as a user's plugin module would register them at import."""
    register_schedule(TOY_SCHEDULE)
    register_aggregation(HalfSum)
    try:
        yield
    finally:
        SCHEDULES.unregister(TOY_SCHEDULE.name)
        AGGREGATIONS.unregister(HalfSum.name)


def test_the_names_resolve_by_import_and_the_validator_runs_the_lists() -> None:
    assert get_schedule(SCHEDULE) is TOY_SCHEDULE
    assert type(make_aggregation(RULE)) is HalfSum
    validate(TOY_SCHEDULE(3, 2, 4, 1))
    lists = "F0 B0 F1 B1 U1 PUSH0 F2 B2 F3 B3 U3 PUSH1 WAIT2 F4 B4 F5 B5 U5 PUSH2"
    assert format_lists(TOY_SCHEDULE(2, 2, 3, 0)).splitlines()[1:] == [
        f"stage 0: {lists}",
        f"stage 1: {lists}",
    ]


def test_the_clis_choices_list_them_and_accept_them(registered: None) -> None:
    runner = CliRunner()
    helped = runner.invoke(cli, ["plan", "--help"])
    assert helped.exit_code == 0 and "toy-one-at-a-time" in helped.output
    lists = ["--stages", "2", "--nm", "1", "--waves", "2", "--lists", "--name"]
    for name in ("toy-one-at-a-time", SCHEDULE):
        result = runner.invoke(cli, ["schedule", *lists, name])
        assert result.exit_code == 0, result.output
        assert result.output.splitlines()[1:] == [
            "stage 0: F0 B0 U0 PUSH0 F1 B1 U1 PUSH1",
            "stage 1: F0 B0 U0 PUSH0 F1 B1 U1 PUSH1",
        ]
    refused = runner.invoke(cli, ["schedule", "--name", "toy-one-at-a-tim"])
    assert refused.exit_code != 0 and 'did you mean "toy-one-at-a-time"' in refused.output


def test_the_timing_model_and_the_partitioner_see_a_pipe_that_drains() -> None:
    """One minibatch at a time: a minibatch takes the sum of the stages' times, not the slowest stage's."""
    forward, backward = [1.0, 2.0, 3.0], [2.0, 4.0, 6.0]
    timeline = simulate(TOY_SCHEDULE(3, 4, 2, 0), forward, backward)
    assert timeline.makespan == pytest.approx(8 * sum(forward + backward))
    config, profiles = _cluster()
    found = plan_candidates(
        config, profiles, ps_gbps=1e6, d_values=(0,), policies=["np"], schedules=[SCHEDULE], baselines=False
    )
    vw = found[0].plan.vws[0]
    stages_s = sum(s.forward_s + s.backward_s + s.recv_s + s.send_s for s in vw.stages)
    assert minibatch_time_s(vw, SCHEDULE) == pytest.approx(stages_s, rel=1e-6)
    assert minibatch_time_s(vw, "wsp") < 0.7 * stages_s  # a full 1F1B pipe is paced by its slowest stage


def _cluster() -> tuple[ClusterConfig, dict[str, ModelProfile]]:
    """Two nodes of two GPUs, fast and half as fast, running the toy schedule and rule; a 6-layer profile."""
    config = parse_config(
        {
            "name": "toy",
            "gpu_types": {
                "fast": {"speed": 2.0, "memory_gib": 8.0},
                "slow": {"speed": 1.0, "memory_gib": 4.0},
            },
            "nodes": [{"name": "n0", "gpus": ["fast", "fast"]}, {"name": "n1", "gpus": ["slow", "slow"]}],
            "wsp": {"nm": 2, "staleness": 0},
            "ps": {"aggregation": RULE},
            "train": {"batch_size": 4, "optimizer": "momentum", "schedule": SCHEDULE},
        },
        Path("toy.toml"),
    )
    mib = 2**20

    def profile(gpu_type: str, slower: float) -> ModelProfile:
        layer = LayerProfile("l", 0.01 * slower, 0.02 * slower, mib, mib, mib // 4, mib, mib // 4)
        return ModelProfile("toy", 4, gpu_type, "float32", "x", mib // 4, (layer,) * 6)

    return config, {"fast": profile("fast", 1.0), "slow": profile("slow", 2.0)}


def test_the_planner_memory_and_convergence_models_read_their_traits() -> None:
    config, profiles = _cluster()
    assert config.train.schedule == SCHEDULE and config.ps.aggregation == RULE
    found = plan_candidates(config, profiles, ps_gbps=1e6, d_values=(0, 1), baselines=False)
    mine = [c for c in found if c.schedule == SCHEDULE]
    assert (
        mine and all(c.feasible for c in mine) and found[0].schedule == SCHEDULE
    )  # the config's comes first
    top = best(mine)
    plan = top.plan
    assert plan is not None and plan.aggregation == RULE
    # the simulator: every VW paced by its minibatches one at a time, its wave Nm of them (each VW its own
    # work per wave), the WSP gate open (D >= 0, fast PS): the slowest wave paces every VW's wave
    result = simulate_plan(plan, waves=6, ps_gbps=1e6)
    wave_s = max(vw.nm * minibatch_time_s(vw, SCHEDULE) for vw in plan.vws)
    per_wave = sum(vw.nm * vw.batch(plan.batch_size) for vw in plan.vws)
    assert top.samples_per_s == pytest.approx(per_wave / wave_s, rel=0.02)
    assert result.samples_per_s <= top.samples_per_s * 1.001
    # the memory model: nothing in flight but one minibatch, no stashed weights (stashing "none")
    keep = MemoryRule.of(config, len(plan.vws)).with_nm(2).keeping(0, 2)
    assert (keep.in_flight, keep.stashed, keep.saved, keep.optimizer) == (1, 0, 1, True)
    # the convergence model: a pipe that drains has no local lag and no stage count; each VW's update whole
    setting = Setting(2, 2, 3, SCHEDULE, RULE)
    assert canonical(setting) == Setting(2, 2, 1, SCHEDULE, RULE)
    assert features(setting)["local_lag"] == 0.0 and features(setting)["sum_overshoot"] == 1.0


@pytest.mark.slow
def test_two_vws_run_them_and_equal_the_reference_bit_for_bit(tmp_path: Path) -> None:
    config = apply_overrides(
        load_config(write_config(tmp_path, vws=layout(2, 2), nm=2, staleness=0, waves=4)),
        [f'train.schedule="{SCHEDULE}"', f'ps.aggregation="{RULE}"'],
    )
    splits = [(1, 3), (2, 2)]
    assert_equals_reference(tmp_path, config, splits, order=1)
    # the rule is what the PS applied: the same run summed whole ends elsewhere
    summed = run_reference(apply_overrides(config, ['ps.aggregation="sum"']), splits, order_seed=1)
    halved = run_reference(config, splits, order_seed=1)
    differs = [k for k in halved.ps_weights if not np.array_equal(halved.ps_weights[k], summed.ps_weights[k])]
    assert differs
    assert_bitwise(halved.ps_weights, run_reference(config, splits, order_seed=5).ps_weights, "any order")
    assert all(torch.isfinite(torch.as_tensor(v)).all() for v in halved.ps_weights.values())
