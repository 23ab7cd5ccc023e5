"""The cluster's capacity and what bounds a candidate below it (hetpipe/core/planning/capacity.py), and where
`hetpipe plan` shows them: the table, --explain, --json."""

from __future__ import annotations

import math

import pytest
from test_planner import cluster, small, toy_profile

from hetpipe.core.planning.capacity import PsFigures, plan_bounds, standalone_rates
from hetpipe.core.planning.plan import Plan, StagePlan, VwPlan
from hetpipe.core.planning.planner import best, candidates_json, explain, format_table, plan_candidates
from hetpipe.core.planning.relays import Relay

MIB = 2**20


def test_standalone_rates_are_the_batch_over_the_whole_models_step_on_each_gpu() -> None:
    # toy_profile: 6 layers of 10 ms forward + 20 ms backward x the type's factor; batch 4
    config, profiles = small()
    rates = standalone_rates(config, profiles)
    assert rates == pytest.approx({"n0:0": 4 / 0.18, "n0:1": 4 / 0.18, "n1:0": 4 / 0.36, "n1:1": 4 / 0.36})


def stage(gpu: str, time_s: float, *, send_s: float = 0.0) -> StagePlan:
    return StagePlan(gpu, "t", 0, 6, time_s / 3, 2 * time_s / 3 - send_s, 0.0, send_s, MIB, 8 * MIB)


def two_vws() -> Plan:
    """vw0 on n0:0 at 0.4 s a minibatch of 4 (10 samples/s, its GPU's standalone rate), vw1 on n0:1 at 0.8 s
    (5 samples/s, half its GPU's); one minibatch a wave each; n1:0 left idle."""
    vws = (VwPlan((stage("n0:0", 0.4),), 1, 6 * MIB), VwPlan((stage("n0:1", 0.8),), 1, 6 * MIB))
    return Plan("dp", "toy", 4, 0, vws)


def ps(utilisation: float = 0.5) -> PsFigures:
    return PsFigures(10.0, 1, utilisation, "PS", 24 * MIB, 0.8)


def link(a: str, b: str) -> float:
    return 100.0 if a.split(":")[0] == b.split(":")[0] else 10.0


def test_bounds_chain_the_losses_from_the_capacity_to_the_prediction() -> None:
    """Capacity 30 (three GPUs of 10 samples/s). Idle n1:0: 10 (33%). The VWs alone: 10 + 5 of their GPUs' 20:
    5 lost in pipelines (17%). Paced by vw1's 0.8 s wave: 8 samples / 0.8 s = 10, 5 lost to wave imbalance
    (17%). Predicted 9: 1 more lost to the PS and the gates (3%)."""
    rates = {"n0:0": 10.0, "n0:1": 10.0, "n1:0": 10.0}
    bounds = plan_bounds(two_vws(), 9.0, rates, ["vw2 (n1:0 t) left out: needs 9 MiB of 8 MiB"], ps(), link)
    kinds = ["idle GPUs", "pipelines", "wave imbalance", "gate waits and the PS link"]
    assert [b.split(" (")[0] for b in bounds] == kinds
    idle, pipelines, waves, link_text = bounds
    assert idle.startswith(
        "idle GPUs (33% of capacity): 1 of 3 left out (n1:0); vw2 (n1:0 t) left out: needs"
    )
    assert pipelines.startswith("pipelines (17% of capacity): the VWs alone reach 15 samples/s, 75% of their")
    assert (
        "most lost in vw1 (5 of 10)" in pipelines
        and "an even split over its GPUs would take 0.4 s" in pipelines
    )
    assert waves == (
        "wave imbalance (17% of capacity): the slowest VW's wave takes 0.8 s (vw1), the fastest's 0.4 s "
        "(vw0); the others wait for it"
    )
    assert link_text == (
        "gate waits and the PS link (1 shard x 10 Gbit/s) (3% of capacity): 50% busy; 2 VWs move "
        "24.00 MiB per wave (pushes and pulls), a wave takes 0.8 s"
    )


def test_no_bounds_at_or_above_the_target_and_a_busy_ps_is_named_even_without_a_loss() -> None:
    rates = {"n0:0": 10.0, "n0:1": 10.0, "n1:0": 10.0}
    assert plan_bounds(two_vws(), 27.0, rates, [], ps(), link) == ()  # 90% of 30
    one = Plan("dp", "toy", 4, 0, (VwPlan((stage("n0:0", 0.4),), 1, 6 * MIB),))
    bounds = plan_bounds(one, 10.0, {"n0:0": 10.0, "n1:0": 10.0}, [], ps(0.97), link)
    assert bounds[0].startswith("idle GPUs (50% of capacity)")
    assert bounds[1].startswith("the PS link (1 shard x 10 Gbit/s) (0% of capacity): 97% busy")


def test_a_relayed_plans_ps_link_counts_each_groups_bytes_once_or_names_the_relays_inside_link() -> None:
    """two_vws through n0's relay: one copy of the 6 MiB pushed and pulled over the PS link (12 MiB, not 24);
    when n0's inside link to the relay is the busiest, the bytes over it: both VWs' 24 MiB."""
    rates = {"n0:0": 10.0, "n0:1": 10.0, "n1:0": 10.0}
    relay = Relay((0, 1), "n0", 100.0)
    relayed = PsFigures(10.0, 1, 0.9, "PS", 12 * MIB, 0.8, (relay,), (24 * MIB,))
    text = plan_bounds(two_vws(), 9.0, rates, [], relayed, link)[-1]
    assert text == (
        "the PS link (1 shard x 10 Gbit/s) (3% of capacity): 90% busy; 2 VWs move 12.00 MiB per wave over "
        "the PS's links (pushes and pulls; node aggregation: 1 relay pushes and pulls one copy each for 2 of "
        "them), a wave takes 0.8 s"
    )
    inside = PsFigures(10.0, 1, 0.9, "n0 loopback", 12 * MIB, 0.8, (relay,), (24 * MIB,))
    text = plan_bounds(two_vws(), 9.0, rates, [], inside, link)[-1]
    assert text.startswith("the PS traffic's busiest link, n0 loopback (a node's link) (3% of capacity): 90%")
    assert "; 2 VWs move 24.00 MiB per wave over it to and from n0's relay (pushes and pulls" in text


def test_transfers_of_the_slowest_stage_name_their_link() -> None:
    """vw0: n0:0 then n1:0 (10 Gbit/s between nodes); stage 1 takes 0.8 s, 0.2 s of it sending."""
    vw = VwPlan((stage("n0:0", 0.4), stage("n1:0", 0.8, send_s=0.2)), 2, 6 * MIB)
    plan = Plan("np", "toy", 4, 0, (vw,))
    bounds = plan_bounds(plan, 5.0, {"n0:0": 10.0, "n1:0": 10.0}, [], ps(), link)
    expected = "a link between GPUs: vw0 stage 1 (n1:0) spends 25% of its time on transfers, n1:0-n0:0 at"
    assert f"{expected} 10 Gbit/s" in bounds


def test_every_candidate_carries_the_capacity_and_the_outputs_show_it() -> None:
    config, profiles = small()
    found = plan_candidates(config, profiles, ps_gbps=10.0, d_values=(0,), schedules=["wsp"])
    capacity = 2 * 4 / 0.18 + 2 * 4 / 0.36
    assert all(c.capacity == pytest.approx(capacity) for c in found)
    for c in found:
        below = c.feasible and c.samples_per_s < 0.9 * capacity
        assert bool(c.bounds) == below, (c.label, c.samples_per_s, c.bounds)
    table = format_table(found)
    assert "capacity" in table.splitlines()[0]
    top = best(found)
    assert f"{top.samples_per_s / capacity:.0%}" in next(
        line for line in table.splitlines() if line[0] == "*"
    )
    text = explain(found)
    assert f"{top.samples_per_s / capacity:.0%} of the cluster's capacity ({capacity:.4g} samples/s)" in text
    assert "    bound: idle GPUs (" in text  # the candidates with only the fastest VW
    rows = candidates_json(found)["candidates"]
    assert all(r["capacity_samples_per_s"] == pytest.approx(capacity) for r in rows)
    for row, c in zip(rows, found, strict=True):
        assert row["bounds"] == list(c.bounds)
        assert math.isclose(row["capacity_share"], c.samples_per_s / capacity)


def test_a_gpu_left_out_for_memory_is_named_with_its_share_of_the_capacity() -> None:
    """A GPU twice as fast as `fast` but with 1 MiB: nothing holds even one layer on it, so every plan leaves
    it out, and the best plan's bounds say so with its share (44 of 111 samples/s)."""
    config = cluster(
        [["fast", "fast"], ["slow", "slow"], ["tiny"]],
        {"fast": (2.0, 8.0), "slow": (1.0, 4.0), "tiny": (4.0, 0.001)},
    )
    profiles = {t: toy_profile(t, f) for t, f in (("fast", 1.0), ("slow", 2.0), ("tiny", 0.5))}
    found = plan_candidates(config, profiles, ps_gbps=10.0, d_values=(0,), schedules=["wsp"])
    top = best(found)
    assert top.capacity == pytest.approx(2 * 4 / 0.18 + 2 * 4 / 0.36 + 4 / 0.09)
    idle = next(b for b in top.bounds if b.startswith("idle GPUs"))
    assert idle.startswith("idle GPUs (40% of capacity): 1 of 5 left out (n2:0)") and "tiny" in idle
