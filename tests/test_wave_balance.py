"""Per-VW work per wave (hetpipe/core/planning/wave_balance.py, per_vw_work.py): each VW's Nm and minibatch
size chosen so that the VWs' waves take about as long: against tables worked out by hand, in the planner."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest
from test_planner import cluster, small, toy_profile

from hetpipe.core.config.parse import parse_config
from hetpipe.core.planning.memory import MemoryRule, stage_memory_terms
from hetpipe.core.planning.per_vw_work import nm_cap
from hetpipe.core.planning.planner import best, plan_candidates
from hetpipe.core.planning.simulate import PsNetwork
from hetpipe.core.planning.wave_balance import WorkOption, balance, batch_ladder, fine_batches


def options(
    per_sample_s: float,
    nms: Sequence[int] = (1, 2),
    batches: Sequence[int] = (2, 4, 8),
    most: int | None = None,
) -> list[WorkOption]:
    """A VW whose wave takes per_sample_s x its samples; samples over `most` do not fit its memory."""
    return [
        WorkOption(nm, b, nm * b * per_sample_s, "" if most is None or nm * b <= most else "n0:0 needs more")
        for nm in nms
        for b in batches
    ]


def work(found) -> list[tuple[int, int]]:
    return [(o.nm, o.batch) for o in found.work]


def test_batch_ladder_is_quarters_of_the_batch_up_to_four_times_it() -> None:
    assert batch_ladder(32) == tuple(range(8, 129, 8))
    assert batch_ladder(4) == tuple(range(1, 17))
    assert batch_ladder(6) == tuple(range(1, 25))  # under 8: every size from 1
    assert batch_ladder(1) == (1, 2, 3, 4)


def test_a_vw_twice_as_fast_does_twice_the_work_in_a_wave_at_the_configs_batch() -> None:
    # fast: 0.01 s a sample, slow: 0.02 s. Wave times T in {0.04, 0.08, 0.16} all give 150 samples/s (fast 100
    # + slow 50); at T = 0.08 both keep batch 4 (fast 2 x 4, slow 1 x 4), at 0.04 the slow one would run 1 x 2
    # and at 0.16 the fast one 2 x 8: the fewest batch changes win
    found = balance([options(0.01), options(0.02)], ps_s=0.0, base_batch=4)
    assert found is not None
    assert work(found) == [(2, 4), (1, 4)]
    assert found.wave_s == pytest.approx(0.08) and found.samples_per_s == pytest.approx(150.0)
    assert found.held == ()


def test_when_the_ps_bounds_the_wave_every_vw_does_more_per_wave() -> None:
    # the PS takes 0.1 s a wave: T = 0.08 gives 12 samples / 0.1 s = 120; T = 0.16 gives 24 / 0.16 = 150;
    # T = 0.32 gives (16 + 16) / 0.32 = 100
    found = balance([options(0.01), options(0.02)], ps_s=0.1, base_batch=4)
    assert found is not None
    assert work(found) == [(2, 8), (2, 4)]
    assert found.samples_per_s == pytest.approx(150.0) and found.ps_s == 0.1


def test_memory_caps_a_vws_work_and_says_what_it_would_have_done() -> None:
    # the fast VW holds at most 8 samples of a wave; PS 0.16 s a wave: T = 0.16 gives (8 + 8) / 0.16 = 100,
    # T = 0.08 12 / 0.16 = 75, T = 0.32 (8 + 16) / 0.32 = 75. At T = 0.16 the fast VW would run 2 x 8.
    found = balance([options(0.01, most=8), options(0.02)], ps_s=0.16, base_batch=4)
    assert found is not None
    assert work(found) == [(2, 4), (2, 4)] and found.samples_per_s == pytest.approx(100.0)
    assert [(v, o.nm, o.batch, o.over) for v, o in found.held] == [(0, 2, 8, "n0:0 needs more")]


def test_equal_vws_get_equal_work_and_a_vw_that_fits_nothing_gives_none() -> None:
    found = balance([options(0.01), options(0.01)], ps_s=0.0, base_batch=4)
    assert found is not None and work(found) == [(1, 4), (1, 4)]  # equal rates: the shortest wave
    assert balance([options(0.01), options(0.02, most=1)], ps_s=0.0, base_batch=4) is None
    assert balance([], ps_s=0.0, base_batch=4) is None


# --------------------------------------------------------------------------------------------- in the planner


def test_the_planner_gives_a_faster_vw_more_work_per_wave_and_keeps_the_common_nm_one() -> None:
    """small(): np makes a VW of two fast GPUs (6 x 30 ms over 2: 90 ms a minibatch of 4) and one of two
    slow ones (180 ms). At one Nm the slow one paces both: 2 x 4 / 0.18 = 44.4 samples/s. With per-VW work
    the fast VW's wave holds twice the slow one's samples, and the two run at their own rates: 4 / 0.09 +
    4 / 0.18 = 66.7 samples/s, every GPU's standalone rate (capacity 2 x 4 / 0.18 + 2 x 4 / 0.36)."""
    config, profiles = small()
    found = plan_candidates(
        config, profiles, ps_gbps=10.0, d_values=(0,), policies=["np"], schedules=["wsp"], baselines=False
    )
    common = found[0]
    assert {(vw.nm, vw.batch_size) for vw in common.plan.vws} == {(2, 0)}
    assert common.samples_per_s == pytest.approx(2 * 4 / 0.18, rel=0.01)
    per_vw = next(c for c in found if any(n.startswith("per-VW work") for n in c.notes))
    fast, slow = per_vw.plan.vws
    assert {s.gpu_type for s in fast.stages} == {"fast"} and {s.gpu_type for s in slow.stages} == {"slow"}
    assert fast.nm * fast.batch(4) == 2 * slow.nm * slow.batch(4)
    assert per_vw.samples_per_s == pytest.approx(4 / 0.09 + 4 / 0.18, rel=0.02)
    assert per_vw.capacity == pytest.approx(2 * 4 / 0.18 + 2 * 4 / 0.36)
    assert per_vw.capacity_share > 0.95 > 0.7 > common.capacity_share
    assert all(u.memory_bytes <= u.limit_bytes for u in per_vw.memory)


def test_memory_at_a_larger_batch_holds_a_vw_back_and_is_named() -> None:
    """A slow PS link (0.1 Gbit/s: two VWs' 6 MiB pushes and pulls take 2 s a wave) asks for long waves, but
    the fast GPUs' 31.7 MiB hold the fast VW's stage 0 at nm 2 x batch 4 (31.5 MiB) and no more: the note
    says what memory refused."""
    config = cluster([["fast", "fast"], ["slow", "slow"]], {"fast": (2.0, 0.031), "slow": (1.0, 8.0)})
    profiles = {"fast": toy_profile("fast", 1.0), "slow": toy_profile("slow", 2.0)}
    found = plan_candidates(
        config, profiles, ps_gbps=0.1, d_values=(0,), policies=["np"], schedules=["wsp"], baselines=False
    )
    per_vw = next(c for c in found if any(n.startswith("per-VW work") for n in c.notes))
    fast = per_vw.plan.vws[0]
    assert {s.gpu_type for s in fast.stages} == {"fast"} and (fast.nm, fast.batch(4)) == (2, 4)
    assert per_vw.plan.vws[1].nm * per_vw.plan.vws[1].batch(4) > 8  # the slow VW's wave grows instead
    held = [n for n in per_vw.notes if n.startswith("memory: vw0 would do")]
    assert held and "n0:0 (fast) needs" in held[0] and "of 31.74 MiB" in held[0]
    assert all(u.memory_bytes <= u.limit_bytes for u in per_vw.memory)


def test_the_average_mitigation_keeps_equal_work() -> None:
    """The runtime refuses unequal work with "average" (it shares a VW's own updates at 1 / n)."""
    data = {
        "name": "t",
        "gpu_types": {"fast": {"speed": 2.0, "memory_gib": 8.0}, "slow": {"speed": 1.0, "memory_gib": 4.0}},
        "nodes": [{"name": "n0", "gpus": ["fast", "fast"]}, {"name": "n1", "gpus": ["slow", "slow"]}],
        "wsp": {"nm": 2},
        "train": {"batch_size": 4, "optimizer": "momentum", "mitigation": "average"},
        "ps": {"aggregation": "mean"},
    }
    config = parse_config(data, Path("t.toml"))
    _, profiles = small()
    found = plan_candidates(config, profiles, ps_gbps=10.0, d_values=(0,), schedules=["wsp"], baselines=False)
    assert found and all(
        len({vw.nm * vw.batch(4) for vw in c.plan.vws}) == 1 for c in found if c.plan is not None
    )


def test_a_gpu_short_of_memory_falls_back_to_the_largest_sixteenth_of_the_batch_it_holds() -> None:
    assert fine_batches(64) == tuple(range(4, 64, 4))
    assert fine_batches(4) == (1, 2, 3)  # under 16: every size below the batch
    # the Nm cap counts minibatches of the config's batch: a VW at a smaller batch may run as many more as
    # make up the same samples, never fewer than the cap
    assert [nm_cap(16, b, 64) for b in (16, 28, 64, 128)] == [64, 36, 16, 16]


def test_a_gpu_that_holds_the_model_only_at_a_smaller_batch_is_a_vw_of_its_own() -> None:
    """A "mid" GPU (72 MiB) cannot hold the whole model at the config's batch of 4 (94 MiB at Nm 1: 6 x 3 MiB
    of weights, gradients and momentum, 6 x 8 MiB of saved activations, input and working memory); at a
    smaller batch the activations shrink. dp at one common Nm pipelines n1's two mids and leaves n2's lone
    one out; per-VW work runs every mid alone at the largest batch it holds, so all five GPUs count."""
    config = cluster([["big", "big"], ["mid", "mid"], ["mid"]], {"big": (2.0, 8.0), "mid": (1.0, 72 / 1024)})
    profiles = {"big": toy_profile("big", 1.0, saved_mib=8.0), "mid": toy_profile("mid", 2.0, saved_mib=8.0)}
    found = plan_candidates(config, profiles, ps_gbps=10.0, d_values=(0,), policies=["dp"], schedules=["wsp"])
    common = found[0]
    assert sorted(vw.gpus for vw in common.plan.vws) == [("n0:0",), ("n0:1",), ("n1:0", "n1:1")]
    alone = [c for c in found if c.plan is not None and sum(len(vw.gpus) == 1 for vw in c.plan.vws) == 5]
    assert alone, [c.notes for c in found]
    plan = alone[0].plan
    mids = [vw for vw in plan.vws if vw.stages[0].gpu_type == "mid"]
    assert sorted(vw.gpus for vw in mids) == [("n1:0",), ("n1:1",), ("n2:0",)]
    # the largest batch it holds, by the memory model on its own: 2 fits in 72 MiB, 3 does not
    whole = profiles["mid"]
    need = [
        stage_memory_terms(
            whole.at_batch(b).layers,
            0,
            1,
            MemoryRule.of(config, 5).with_nm(1),
            input_bytes=whole.at_batch(b).input_bytes,
        ).total
        for b in (2, 3)
    ]
    assert need[0] <= 72 * 2**20 < need[1]
    assert all(vw.batch(4) <= 2 for vw in mids)
    note = "GPUs that hold the model only at a smaller minibatch, each its own VW: vw2-4 (mid) at 2 or less"
    assert note in alone[0].notes
    assert all(u.memory_bytes <= u.limit_bytes for u in alone[0].memory)
    assert best(found).gpus_used == 5


def two_nodes(gbps: float, d_values: tuple[int, ...]) -> list:
    """plan_candidates (dp, pipedream, Nm up to 16) for a fast GPU on n0, beside the PS, and one of half its
    speed on n1, 6 MiB of weights, each node's link at `gbps` (10 Gbit/s inside)."""
    network = PsNetwork("n0", {"n0": gbps, "n1": gbps}, {"n0": 10.0, "n1": 10.0})
    config = cluster([["fast"], ["slow"]], {"fast": (2.0, 8.0), "slow": (1.0, 8.0)})
    profiles = {"fast": toy_profile("fast", 1.0), "slow": toy_profile("slow", 2.0)}
    return plan_candidates(
        config,
        profiles,
        ps_gbps=10.0,
        d_values=d_values,
        ps_network=network,
        policies=["dp"],
        schedules=["pipedream"],
        baselines=False,
        nm_max=16,
    )


def test_over_slow_node_links_per_vw_work_makes_waves_no_shorter_than_their_ps_round_trip() -> None:
    """A fast GPU on n0 (beside the PS) and one of half its speed on n1, 6 MiB of weights, 0.05 Gbit/s
    links: a wave's push from n1 (its egress, n0's ingress) and the pull back take 2 x 6 MiB / 6.25 MB/s =
    2.01 s, which under D = 0 must fit in the wave before the gate. Per-VW work sizes the waves by it: Nm 12
    and 6 (2.16 s each). Without it the best plan was a common Nm 16, the slow VW pacing the fast one."""
    found = two_nodes(0.05, (0,))
    top = best(found)
    round_trip = 2 * 6 * 2**20 / (0.05e9 / 8)
    waves = [vw.nm * 6 * 0.03 * (1 if vw.gpus == ("n0:0",) else 2) for vw in top.plan.vws]
    assert len(top.plan.vws) == 2 and min(waves) >= round_trip
    assert [vw.nm for vw in top.plan.vws] == [12, 6] and top.gate_wait_share == 0.0


def test_at_d_1_per_vw_work_spreads_the_ps_round_trip_over_two_waves() -> None:
    """The cluster above at D = 1: the gate of wave c needs wave c - 3, so the push and the pull (1.01 s
    each: 6 MiB over n1's egress and n0's ingress, then back) may take two waves, but the pushes of one wave
    must cross before the next wave's: waves of 1.01 s at least. Per-VW work sizes them so: Nm 6 and 3
    (1.08 s each), where D = 0 needed Nm 12 and 6."""
    found = two_nodes(0.05, (0, 1))
    phase = 6 * 2**20 / (0.05e9 / 8)
    sized = {
        c.staleness: [vw.nm for vw in c.plan.vws]
        for c in found
        if any(n.startswith("per-VW work") for n in c.notes)
    }
    assert sized == {0: [12, 6], 1: [6, 3]}
    at_1 = next(c for c in found if c.staleness == 1 and any(n.startswith("per-VW work") for n in c.notes))
    waves = [vw.nm * 6 * 0.03 * (1 if vw.gpus == ("n0:0",) else 2) for vw in at_1.plan.vws]
    assert min(waves) >= phase and at_1.gate_wait_share == 0.0


def test_per_vw_work_at_d_1_holds_what_d_0_holds_with_pushed_sums_on_the_host() -> None:
    """The fast GPUs' 31.7 MiB hold the fast VW's stage at Nm 2 x batch 4 at D = 0
    (test_memory_at_a_larger_batch_holds_a_vw_back_and_is_named). At D = 1 a stage keeps one more wave's
    update sums until a pull contains them; they wait in host memory (docs/memory.md#what-a-stage-keeps), so
    per-VW work at D = 1 gives the fast VW the same work as at D = 0, within memory (with them on the GPU it
    had to give it less)."""
    config = cluster([["fast", "fast"], ["slow", "slow"]], {"fast": (2.0, 0.031), "slow": (1.0, 8.0)})
    profiles = {"fast": toy_profile("fast", 1.0), "slow": toy_profile("slow", 2.0)}
    found = plan_candidates(
        config, profiles, ps_gbps=0.1, d_values=(0, 1), policies=["np"], schedules=["wsp"], baselines=False
    )
    per_vw = {
        c.staleness: c for c in found if c.feasible and any(n.startswith("per-VW work") for n in c.notes)
    }
    assert set(per_vw) == {0, 1}
    fast = [c.plan.vws[0] for c in (per_vw[0], per_vw[1])]
    assert (fast[1].nm, fast[1].batch(4)) == (fast[0].nm, fast[0].batch(4)) == (2, 4)
    assert [u.memory_bytes for u in per_vw[1].memory] == [u.memory_bytes for u in per_vw[0].memory]
    for c in per_vw.values():
        assert all(u.memory_bytes <= u.limit_bytes for u in c.memory)


def test_a_plan_of_only_the_fastest_vws_says_what_all_of_them_would_cost() -> None:
    """The two-node cluster above at 0.003 Gbit/s: the slow VW's push and pull cross n1's and n0's links,
    2 x 6 MiB / 0.375 MB/s = 33.6 s a wave at D = 0, longer than any wave either VW can run. Per-VW work's
    grouping of the fast VW alone names that bound and the estimate for both."""
    found = two_nodes(0.003, (0,))
    per_vw = [c for c in found if any(n.startswith("per-VW work") for n in c.notes)]
    [alone] = per_vw  # both VWs, estimated under 90% of the fast one alone, are not planned
    round_trip = 2 * 6 * 2**20 / (0.003e9 / 8)
    note = alone.notes[-1]
    assert note.startswith("only the 1 fastest of the policy's 2 VWs, at per-VW work (all 2: about ")
    assert f"bound by the PS's links {round_trip:.3g} s a wave against " in note
    estimate = float(note.split("about ")[1].split(" samples/s")[0])
    assert estimate < 0.9 * alone.samples_per_s
