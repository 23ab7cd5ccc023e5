"""The WSP simulator and the baselines, against numbers worked out by hand from the rules."""

from __future__ import annotations

import dataclasses
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hetpipe.core.errors import UsageError
from hetpipe.core.pipeline.schedule import BACKWARD, FORWARD, wsp_schedule
from hetpipe.core.pipeline.schedule import simulate as simulate_schedule
from hetpipe.core.planning.plan import Plan, StagePlan, VwPlan
from hetpipe.core.planning.relays import Relay, plan_relays
from hetpipe.core.planning.simulate import (
    PsNetwork,
    simulate,
    simulate_allreduce,
    simulate_sync_pipeline,
    stage_param_bytes,
    stage_times,
)

BATCH = 32
GB = 1e9  # 8 Gbit/s moves GB bytes per second


def stage(
    forward: float,
    backward: float,
    *,
    recv: float = 0.0,
    send: float = 0.0,
    params: int = 0,
    layers: int = 1,
    gpu: str = "n0:0",
) -> StagePlan:
    return StagePlan(gpu, "g", 0, layers, forward, backward, recv, send, 0, 0, params)


def vw(*stages: StagePlan, nm: int = 1, param_bytes: int = 0) -> VwPlan:
    return VwPlan(tuple(stages), nm, param_bytes)


def plan(*vws: VwPlan, staleness: int = 0) -> Plan:
    return Plan("explicit", "m", BATCH, staleness, tuple(vws))


def pipeline(k: int, forward: float, backward: float, nm: int, params: int = 0) -> VwPlan:
    return vw(*(stage(forward, backward, params=params) for _ in range(k)), nm=nm)


# ---------------------------------------------------------------------------------------------- one VW


def test_one_stage_without_ps_cost_runs_at_batch_over_f_plus_b() -> None:
    result = simulate(plan(vw(stage(1.0, 2.0), nm=2)), waves=5, ps_gbps=math.inf)
    assert result.makespan_s == 5 * 2 * 3.0
    assert result.samples_per_s == BATCH / 3.0
    # F0 F1 B0 F2 B1 PUSH0 ...: wave 0 completes at 7, then one wave every 6, the last one drains in 5
    assert result.vws[0].wave_s == 6.0 and result.vws[0].wave_done_s == (7.0, 13.0, 19.0, 25.0, 30.0)
    assert result.ps_utilisation == 0.0 and result.vws[0].gate_wait_s == 0.0


def test_push_goes_out_in_the_background_and_one_vw_skips_the_pull_by_hand() -> None:
    # One stage, nm=1, D=0, f=1, b=2, 1 GB of weights over 8 Gbit/s: each transfer takes 1 s.
    # F0 0-1, B0 1-3, U0, PUSH0 handed over at 3 (lands 4; the stage goes on), F1 3-4, B1 4-6, PUSH1 6-7,
    # WAIT2: one VW, no gate and no pull, F2 6-7, B2 7-9, PUSH2 9-10.
    result = simulate(plan(vw(stage(1.0, 2.0, params=int(GB)))), waves=3, ps_gbps=8.0)
    assert result.makespan_s == 10.0
    assert result.samples_per_s == 3 * BATCH / 10.0
    assert result.ps_utilisation == pytest.approx(3 / 10)
    one = result.vws[0]
    assert one.wave_done_s == (4.0, 7.0, 10.0) and one.gate_wait_s == 0.0 and one.pull_s == 0.0
    assert result.gates == ()


def test_one_vw_pulls_when_its_rule_runs_the_optimizer_at_the_ps_by_hand() -> None:
    # The same VW under aggregation "server" (read off the rule's traits, not its name): its weights move only
    # at pulls, so WAIT2 pulls W_1. PUSH0 3-4 on the link; the pull, handed over at 3, waits for the gate
    # (wave 0 complete at 4) and goes 4-5; PUSH1 6-7. At WAIT2 (6) the pull is there: F2 6-7, B2 7-9, PUSH2
    # 9-10.
    served = dataclasses.replace(plan(vw(stage(1.0, 2.0, params=int(GB)))), aggregation="server")
    result = simulate(served, waves=3, ps_gbps=8.0)
    one = result.vws[0]
    assert result.makespan_s == 10.0 and result.ps_utilisation == pytest.approx(4 / 10)
    assert one.wave_done_s == (4.0, 7.0, 10.0) and one.pull_s == 1.0 and one.gate_wait_s == 0.0
    assert [(g.vw, g.wave) for g in result.gates] == [(0, 2)]


def test_push_and_pull_timed_on_the_shared_ps_link_by_hand() -> None:
    # Two such VWs on one PS link (1 s per transfer, first come first served, vw0 first at equal times).
    # Both F0 0-1, B0 1-3; PUSH0 at 3: vw0's 3-4, vw1's queued 4-5. Each hands over WAIT2's pull at 3 (its
    # own push of wave 0 is out); the gate (c_global >= 1) opens at 5, so the PS sends vw0's pull 5-6 and
    # vw1's 6-7. F1 3-4, B1 4-6; PUSH1 at 6: vw0's 7-8, vw1's 8-9. WAIT2: vw0's pull is there at 6, F2 6-7,
    # B2 7-9, PUSH2 9-10; vw1 waits for its pull until 7, F2 7-8, B2 8-10, PUSH2 10-11.
    one = vw(stage(1.0, 2.0, params=int(GB)))
    result = simulate(plan(one, one), waves=3, ps_gbps=8.0)
    assert result.makespan_s == 11.0
    assert result.ps_utilisation == pytest.approx(8 / 11)
    assert result.vws[0].wave_done_s == (4.0, 8.0, 10.0) and result.vws[1].wave_done_s == (5.0, 9.0, 11.0)
    assert result.vws[0].pull_s == 1.0 and result.vws[1].pull_s == 2.0  # vw1's queued behind vw0's
    assert result.vws[0].gate_wait_s == 0.0 and result.vws[1].gate_wait_s == 1.0
    assert [(g.time_s, g.vw, g.wave, g.completed) for g in result.gates] == [
        (6.0, 0, 2, (1, 1)),
        (7.0, 1, 2, (1, 1)),
    ]


def test_transfers_split_between_forward_and_backward() -> None:
    three = vw(
        stage(1.0, 2.0, recv=0.2, send=0.4), stage(1.0, 2.0, recv=0.4, send=0.6), stage(1.0, 2.0, recv=0.6)
    )
    forward, backward = stage_times(three)
    # stage 0 sends its activation forward and receives a gradient backward; the last stage the reverse
    assert forward == pytest.approx([1.4, 1.5, 1.6]) and backward == pytest.approx([2.2, 2.5, 2.0])
    assert [f + b for f, b in zip(forward, backward, strict=True)] == pytest.approx(
        [s.time_s for s in three.stages]
    )


def test_full_pipeline_approaches_batch_over_bottleneck() -> None:
    four = vw(stage(1.0, 2.0), stage(1.5, 2.5, recv=0.2, send=0.2), stage(1.0, 1.0), stage(0.5, 1.5), nm=4)
    assert four.bottleneck_s == pytest.approx(4.4)
    rates = [simulate(plan(four), waves=w, ps_gbps=math.inf).samples_per_s for w in (2, 8, 32)]
    assert rates[0] < rates[1] < rates[2] < BATCH / four.bottleneck_s
    assert rates[2] > 0.95 * BATCH / four.bottleneck_s
    steady = simulate(plan(four), waves=8, ps_gbps=math.inf).vws[0].wave_s
    assert steady == pytest.approx(4 * four.bottleneck_s)  # nm minibatches per wave at the bottleneck's pace


@pytest.mark.parametrize("nm", [1, 2, 3, 5])
@pytest.mark.parametrize("staleness", [0, 1, 100])
def test_agrees_with_the_schedule_timeline_when_ps_is_free(nm: int, staleness: int) -> None:
    three = vw(
        stage(1.0, 2.0, send=0.25),
        stage(1.5, 2.5, recv=0.25, send=0.5),
        stage(0.5, 1.0, recv=0.5),
        nm=nm,
        param_bytes=10**6,
    )
    result = simulate(plan(three, staleness=staleness), waves=6, ps_gbps=math.inf)
    timeline = simulate_schedule(wsp_schedule(3, nm, 6, staleness), *stage_times(three))
    compute = {
        (e.stage, e.action, e.start, e.end) for e in result.events if e.action.kind in (FORWARD, BACKWARD)
    }
    assert compute == {
        (e.stage, e.action, e.start, e.end) for e in timeline.events if e.action.kind in (FORWARD, BACKWARD)
    }
    assert result.makespan_s == timeline.makespan
    assert result.samples_per_s == BATCH * timeline.throughput


# ------------------------------------------------------------------------------------------ WSP across VWs


def two_speeds(staleness: int, params: int = 0) -> Plan:
    """VW 0 four times as fast as VW 1, two stages each, nm = 2."""
    return plan(pipeline(2, 1.0, 2.0, 2, params), pipeline(2, 4.0, 8.0, 2, params), staleness=staleness)


def test_d0_holds_the_fast_worker_to_the_slow_one() -> None:
    result = simulate(two_speeds(0), waves=12, ps_gbps=math.inf)
    fast, slow = result.vws
    assert result.gates and all(g.lead <= 1 and g.wave - min(g.completed) <= 1 for g in result.gates)
    assert fast.gate_wait_s > 0 and slow.gate_wait_s == 0
    assert fast.wave_s == pytest.approx(slow.wave_s, rel=0.05)  # held to the slow pace, not 4x faster
    assert slow.wave_s == pytest.approx(2 * 12.0)  # nm x (f + b) of its bottleneck stage


@pytest.mark.parametrize("staleness", [0, 1, 2, 3])
def test_every_gate_keeps_the_bound(staleness: int) -> None:
    result = simulate(two_speeds(staleness), waves=12, ps_gbps=math.inf)
    assert result.gates
    for gate in result.gates:
        assert min(gate.completed) >= gate.wave - staleness - 1  # the gate rule, docs/wsp.md#gate
        assert gate.lead <= staleness + 1
    assert max(g.lead for g in result.gates) == staleness  # the fast VW runs right up to the bound


def test_larger_d_lets_the_fast_worker_run_ahead_and_raises_throughput() -> None:
    free = {d: simulate(two_speeds(d), waves=12, ps_gbps=math.inf) for d in (0, 1, 3, 20)}
    finish = [free[d].vws[0].finish_s for d in (0, 1, 3, 20)]
    assert finish[0] > finish[1] > finish[2] > finish[3]
    assert free[20].vws[0].wave_s == pytest.approx(2 * 3.0)  # unbounded: its own pace
    # Fixed waves per VW, free PS: the slow VW never waits, so the run's length and throughput do not depend
    # on D.
    assert len({r.samples_per_s for r in free.values()}) == 1
    # With a shared PS link the slow VW's own pushes queue behind the fast one's; a larger D waits for
    # older waves, so it blocks less and the whole run goes faster.
    # (At 1 Gbit/s the pushes hide behind compute entirely; at 0.1 they queue.)
    loaded = [
        simulate(two_speeds(d, params=10**8), waves=12, ps_gbps=0.1).samples_per_s for d in (0, 1, 3, 20)
    ]
    assert loaded[0] < loaded[1] < loaded[2] < loaded[3]


# ---------------------------------------------------------------------------------------------- node links

# The PS on n0; every node's egress 8 Gbit/s (1 s per GB), n0's loopback 80 (0.1 s per GB).
NETWORK = PsNetwork("n0", {"n0": 8.0, "n1": 8.0, "n2": 8.0}, {"n0": 80.0, "n1": 80.0, "n2": 80.0})


def test_pushes_leave_over_their_own_nodes_egress_and_share_the_ps_nodes_ingress() -> None:
    # The shared-link case above, with vw0 on n1 and vw1 on n2: PUSH0 at 3 crosses n1's and n2's egress at
    # once, but both enter n0 over its ingress: vw0's lands at 4, vw1's at 5. The gate opens at 5; both pulls
    # leave over n0's egress: vw0's 5-6, vw1's 6-7. F1 3-4, B1 4-6 each; PUSH1 at 6 lands 7 and 8. F2 6-7 and
    # 7-8 (after each pull), B2 7-9 and 8-10; PUSH2 9-10 and 10-11.
    result = simulate(
        plan(
            vw(stage(1.0, 2.0, params=int(GB), gpu="n1:0")), vw(stage(1.0, 2.0, params=int(GB), gpu="n2:0"))
        ),
        waves=3,
        ps_gbps=math.inf,
        network=NETWORK,
    )
    assert result.makespan_s == 11.0
    assert result.vws[0].wave_done_s == (4.0, 7.0, 10.0) and result.vws[1].wave_done_s == (5.0, 8.0, 11.0)
    assert (result.vws[0].pull_s, result.vws[1].pull_s) == (1.0, 2.0)
    assert result.ps_link == "n0 ingress"
    assert result.ps_utilisation == pytest.approx(6 / 11)  # n0's ingress carried all 6 pushes
    shared = simulate(
        plan(
            vw(stage(1.0, 2.0, params=int(GB), gpu="n1:0")), vw(stage(1.0, 2.0, params=int(GB), gpu="n2:0"))
        ),
        waves=3,
        ps_gbps=8.0,
    )
    assert shared.makespan_s == 11.0  # without the network: one link for everything, as worked out above


def test_a_vw_on_the_ps_node_crosses_its_loopback_and_the_ps_rate_still_caps_it() -> None:
    def makespan(gpu: str, ps_gbps: float = math.inf) -> float:
        one = plan(vw(stage(1.0, 2.0, params=int(GB), gpu=gpu)))
        return simulate(one, waves=3, ps_gbps=ps_gbps, network=NETWORK).makespan_s

    assert makespan("n1:0") == 10.0  # pushes of 1 s each, as on one 8 Gbit/s link
    assert makespan("n0:0") == pytest.approx(9.1)  # F0 B0 at 0-3, F1 B1 3-6, F2 B2 6-9; each push 0.1 s
    assert makespan("n0:0", ps_gbps=8.0) == 10.0  # the PS itself moves no faster than 8 Gbit/s


def test_local_placement_keeps_a_vws_traffic_on_the_node_holding_its_layers() -> None:
    # The layer lives on n1's shard. vw0 (on n1) reaches it over n1's loopback: each push and pull 0.1 s. vw1
    # (on n2) pushes over n2's egress (1 s) and pulls over n1's (1 s): PUSH0 3-4, so the gate opens at 4;
    # vw1's pull 4-5, vw0's 4-4.1. F1 3-4, B1 4-6; PUSH1 6-6.1 and 6-7; F2 6-7, B2 7-9; PUSH2 9-9.1 and 9-10.
    local = PsNetwork("n0", NETWORK.egress_gbps, NETWORK.inside_gbps, layer_nodes=("n1",))
    result = simulate(
        plan(
            vw(stage(1.0, 2.0, params=int(GB), gpu="n1:0")), vw(stage(1.0, 2.0, params=int(GB), gpu="n2:0"))
        ),
        waves=3,
        ps_gbps=math.inf,
        network=local,
    )
    assert result.makespan_s == 10.0
    assert result.vws[0].wave_done_s == pytest.approx((3.1, 6.1, 9.1)) and result.vws[1].wave_done_s == (
        4.0,
        7.0,
        10.0,
    )
    assert (result.vws[0].pull_s, result.vws[1].pull_s) == pytest.approx((0.1, 1.0))


def test_a_stage_spanning_shards_splits_its_bytes_by_layer() -> None:
    split = PsNetwork(
        "n0", NETWORK.egress_gbps, NETWORK.inside_gbps, layer_nodes=("n1", "n2"), layer_bytes=(3.0, 1.0)
    )
    assert split.parts("n1:0", 0, 2, 100.0, push=True) == [
        ("n1 loopback", 80.0, 75.0),
        ("n1 egress", 8.0, 25.0),
        ("n2 ingress", 8.0, 25.0),
    ]
    assert split.parts("n1:0", 0, 2, 100.0, push=False) == [
        ("n1 loopback", 80.0, 75.0),
        ("n2 egress", 8.0, 25.0),
        ("n1 ingress", 8.0, 25.0),
    ]
    even = PsNetwork("n0", NETWORK.egress_gbps, NETWORK.inside_gbps, layer_nodes=("n1", "n2"))
    assert [p[2] for p in even.parts("n2:0", 0, 2, 100.0, push=True)] == [50.0, 50.0, 50.0]
    with pytest.raises(UsageError, match=r"layers \[1, 3\) of 'n1:0' are outside the 2 layers"):
        even.parts("n1:0", 1, 3, 1.0, push=True)


def test_a_network_without_the_plans_node_says_so() -> None:
    with pytest.raises(UsageError, match="node 'n7'.*nodes: n0, n1, n2"):
        simulate(plan(vw(stage(1.0, 2.0, params=1, gpu="n7:0"))), waves=1, ps_gbps=1.0, network=NETWORK)


# ---------------------------------------------------------------------------------------------- relays


def test_a_relay_pushes_once_its_group_has_and_pulls_once_for_it_by_hand() -> None:
    # Two VWs on n1 through n1's relay; the PS on n0 (NETWORK: egress 1 s per GB, loopback 0.1 s). Both hand
    # PUSH0 to the relay at 3 over n1's loopback: vw0's lands 3.1, vw1's 3.2; the relay pushes 1 GB over n1's
    # egress 3.2-4.2, when both have completed wave 0. The gate of WAIT2 opens then: the relay's one pull over
    # n0's egress 4.2-5.2, then over n1's loopback to vw0 5.2-5.3 and vw1 5.3-5.4. PUSH1 at 6: 6.2-7.2 up;
    # WAIT2 does not wait; PUSH2 at 9: 9.2-10.2 up.
    two = plan(
        vw(stage(1.0, 2.0, params=int(GB), gpu="n1:0")), vw(stage(1.0, 2.0, params=int(GB), gpu="n1:1"))
    )
    relay = Relay((0, 1), "n1", 0.0)  # with a PsNetwork its loopback is the inside link
    result = simulate(two, waves=3, ps_gbps=math.inf, network=NETWORK, relays=[relay])
    assert result.makespan_s == pytest.approx(10.2)
    for one in result.vws:
        assert one.wave_done_s == pytest.approx((4.2, 7.2, 10.2)) and one.gate_wait_s == 0.0
    assert (result.vws[0].pull_s, result.vws[1].pull_s) == pytest.approx((1.1, 1.2))
    moved = {name: nbytes / GB for name, nbytes in result.link_bytes}
    # 6 pushes + 2 pulls on n1's loopback; 3 relayed pushes out of n1 into n0, 1 pull back
    assert moved == {
        "n1 loopback": 8.0,
        "n1 egress": 3.0,
        "n0 ingress": 3.0,
        "n0 egress": 1.0,
        "n1 ingress": 1.0,
    }
    alone = simulate(two, waves=3, ps_gbps=math.inf, network=NETWORK)
    assert {name: nbytes / GB for name, nbytes in alone.link_bytes} == {
        "n1 egress": 6.0,
        "n0 ingress": 6.0,
        "n0 egress": 2.0,
        "n1 ingress": 2.0,
    }


def test_node_aggregation_halves_the_bytes_over_the_remote_nodes_egress_and_the_wave() -> None:
    # Two nodes of two GPUs, one VW per GPU, the PS on n0, each egress 1 s per GB and each VW's 1 GB of
    # weights computed in 0.3 s a wave: the links bind. Each wave, n1's egress carries its two VWs' pushes
    # (2 s) and n0's their pulls; through n1's relay, one push and one pull (1 s). D = 2 lets the waves queue.
    gpus = ["n0:0", "n0:1", "n1:0", "n1:1"]
    four = plan(*(vw(stage(0.1, 0.2, params=int(GB), gpu=g)) for g in gpus), staleness=2)
    relays = plan_relays([[g] for g in gpus], True, lambda node: 80.0)
    assert [r.vws for r in relays] == [(0, 1), (2, 3)]
    off = simulate(four, waves=12, ps_gbps=math.inf, network=NETWORK)
    on = simulate(four, waves=12, ps_gbps=math.inf, network=NETWORK, relays=relays)
    off_bytes, on_bytes = dict(off.link_bytes), dict(on.link_bytes)
    assert off_bytes["n1 egress"] == 12 * 2 * GB and on_bytes["n1 egress"] == 12 * GB
    assert on_bytes["n0 egress"] == off_bytes["n0 egress"] / 2  # one pull per wave for n1's two VWs
    assert off.ps_link == on.ps_link == "n1 egress"
    assert max(v.wave_s for v in off.vws) == pytest.approx(2.0)
    assert max(v.wave_s for v in on.vws) == pytest.approx(1.0)
    assert on.samples_per_s > 1.8 * off.samples_per_s
    # the same without the network: the one PS link carries each group's copy, the relays' hops stay on the
    # nodes (80 Gbit/s inside links)
    shared_off = simulate(four, waves=12, ps_gbps=8.0)
    shared_on = simulate(four, waves=12, ps_gbps=8.0, relays=relays)
    assert dict(shared_on.link_bytes)["PS"] == dict(shared_off.link_bytes)["PS"] / 2
    assert set(dict(shared_on.link_bytes)) == {"PS", "n0 loopback", "n1 loopback"}
    assert max(v.wave_s for v in shared_on.vws) < 0.55 * max(v.wave_s for v in shared_off.vws)


def test_no_relays_run_as_before_and_bad_relays_say_how_to_build_them() -> None:
    four = plan(*(vw(stage(0.1, 0.2, params=10**8, gpu=f"n{i}:0")) for i in range(3)))
    assert plan_relays([vw.gpus for vw in four.vws], True, lambda node: 1.0) == ()
    assert simulate(four, waves=4, ps_gbps=1.0, relays=()) == simulate(four, waves=4, ps_gbps=1.0)
    with pytest.raises(UsageError, match="at most once; build them with"):
        simulate(four, waves=1, ps_gbps=1.0, relays=[Relay((0, 1), "n0", 1.0), Relay((1, 2), "n1", 1.0)])
    with pytest.raises(UsageError, match="plan's 3 VWs"):
        simulate(four, waves=1, ps_gbps=1.0, relays=[Relay((2, 3), "n0", 1.0)])


@settings(max_examples=25, deadline=None)
@given(
    speeds=st.lists(st.sampled_from([1.0, 2.0, 3.0, 5.0]), min_size=2, max_size=3),
    staleness=st.integers(0, 3),
    nm=st.integers(1, 3),
    ps_gbps=st.sampled_from([math.inf, 1.0, 0.1]),
)
def test_bound_holds_for_any_speeds(speeds: list[float], staleness: int, nm: int, ps_gbps: float) -> None:
    workers = [pipeline(2, 1.0 / s, 2.0 / s, nm, params=10**7) for s in speeds]
    result = simulate(plan(*workers, staleness=staleness), waves=6, ps_gbps=ps_gbps)
    assert all(min(g.completed) >= g.wave - staleness - 1 and g.lead <= staleness + 1 for g in result.gates)
    assert all(len(v.wave_done_s) == 6 for v in result.vws)


def test_ps_bandwidth_towards_zero_drops_throughput() -> None:
    bandwidths = [math.inf, 10.0, 1.0, 0.1, 0.01]
    runs = [simulate(two_speeds(1, params=10**8), waves=8, ps_gbps=gbps) for gbps in bandwidths]
    rates = [r.samples_per_s for r in runs]
    assert all(
        a >= b for a, b in zip(rates, rates[1:], strict=False)
    )  # pushes overlap compute while they can
    assert rates[2] > 2 * rates[3] > 4 * rates[4]
    assert runs[0].ps_utilisation == 0.0 and runs[-1].ps_utilisation > 0.95


def test_shards_add_bandwidth() -> None:
    two = simulate(two_speeds(1, params=10**8), waves=6, ps_gbps=1.0, ps_shards=2)
    one = simulate(two_speeds(1, params=10**8), waves=6, ps_gbps=2.0)
    assert two.samples_per_s == one.samples_per_s


def test_stage_param_bytes_from_stages_or_split_by_layers() -> None:
    assert stage_param_bytes(vw(stage(1, 1, params=5), stage(1, 1, params=0))) == [5.0, 0.0]
    unknown = vw(stage(1, 1, layers=1), StagePlan("n0:1", "g", 1, 4, 1, 1, 0, 0, 0, 0), param_bytes=400)
    assert stage_param_bytes(unknown) == [100.0, 300.0]


def test_per_stage_param_bytes_survive_json() -> None:
    original = plan(vw(stage(1.0, 2.0, params=7)))
    assert Plan.from_json(original.to_json()) == original


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"waves": 0, "ps_gbps": 1.0}, "waves must be >= 1"),
        ({"waves": 1, "ps_gbps": 0.0}, "ps_gbps must be > 0"),
        ({"waves": 1, "ps_gbps": 1.0, "ps_shards": 0}, "ps_shards must be >= 1"),
    ],
)
def test_bad_arguments(kwargs: dict, match: str) -> None:
    with pytest.raises(UsageError, match=match):
        simulate(plan(vw(stage(1.0, 1.0))), **kwargs)
    with pytest.raises(UsageError, match="no virtual workers"):
        simulate(plan(), waves=1, ps_gbps=1.0)


# ---------------------------------------------------------------------------------------------- baselines


def test_allreduce_runs_at_the_slowest_gpu_pace() -> None:
    assert simulate_allreduce([1.0, 1.0, 1.0, 4.0], 0, 10.0, BATCH).samples_per_s == 4 * BATCH / 4.0
    # ring all-reduce of 1 GB over 8 Gbit/s among 4: 2 x 3/4 x 1 s
    result = simulate_allreduce([1.0, 1.0, 1.0, 4.0], int(GB), 8.0, BATCH)
    assert result.comm_s == 1.5 and result.step_s == 5.5 and result.samples_per_s == 4 * BATCH / 5.5
    assert simulate_allreduce([2.0], int(GB), 8.0, BATCH).samples_per_s == BATCH / 2.0  # alone: no all-reduce
    with pytest.raises(UsageError, match="one time > 0 per GPU"):
        simulate_allreduce([], 0, 1.0, BATCH)


@pytest.mark.parametrize(("k", "m"), [(4, 4), (4, 8), (3, 1), (2, 5)])
def test_sync_pipeline_takes_m_plus_k_minus_1_microbatch_slots(k: int, m: int) -> None:
    result = simulate_sync_pipeline(pipeline(k, 1.0, 2.0, 1), m, BATCH)
    assert result.step_s == pytest.approx((m + k - 1) * 3.0 / m)
    assert result.samples_per_s == pytest.approx(BATCH / result.step_s) and result.comm_s == 0.0
