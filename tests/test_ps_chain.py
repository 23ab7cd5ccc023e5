"""Tests of hetpipe.core.planning.ps_chain: a wave's pushes, then its pulls, over the nodes' links, and the
shortest wave they allow at each D."""

from __future__ import annotations

import pytest

from hetpipe.core.planning.plan import StagePlan, VwPlan
from hetpipe.core.planning.ps_chain import gate_bound_s, wave_phases_s
from hetpipe.core.planning.relays import Relay
from hetpipe.core.planning.simulate import PsNetwork

GB = 1e9  # bytes: 1 s over an 8 Gbit/s egress, 0.1 s over an 80 Gbit/s loopback


def vw(gpu: str, layers: int = 3) -> VwPlan:
    stage = StagePlan(gpu, "t", 0, layers, 1.0, 2.0, 0.0, 0.0, 0, 1, param_bytes=int(GB))
    return VwPlan((stage,), nm=1, param_bytes=int(GB))


def network(**extra) -> PsNetwork:
    nodes = ("n0", "n1", "n2")
    return PsNetwork("n0", dict.fromkeys(nodes, 8.0), dict.fromkeys(nodes, 80.0), **extra)


def test_one_shard_node_sends_every_pull_over_its_own_link():
    vws = [vw("n0:0"), vw("n1:0"), vw("n2:0")]
    # pushes: n1 and n2 egress 1 GB each (1 s), both into n0's ingress (2 s), n0's over its loopback (0.1 s);
    # pulls: n0's egress carries n1's and n2's (2 s)
    assert wave_phases_s(vws, network()) == pytest.approx((2.0, 2.0))
    assert wave_phases_s(vws, network(), pulls=False) == pytest.approx((2.0, 0.0))
    # no link is faster than the PS itself: 0.5 GB/s makes n0's ingress 4 s and its egress 4 s
    assert wave_phases_s(vws, network(), ps_bytes_per_s=0.5 * GB) == pytest.approx((4.0, 4.0))


def test_one_remote_vw_is_bound_by_its_own_links():
    """n1's push crosses n1's egress and n0's ingress, each 1 s at once (not one after the other)."""
    assert wave_phases_s([vw("n1:0")], network()) == pytest.approx((1.0, 1.0))


def test_shards_on_every_node_fan_the_pulls_out():
    """A third of the weights on each node: each node's egress carries two thirds of a push (to the other two
    shards) and its own third to each of the two other nodes' pulls; its ingress a third from each other node
    both ways."""
    spread = network(layer_nodes=("n0", "n1", "n2"))
    vws = [vw("n0:0"), vw("n1:0"), vw("n2:0")]
    assert wave_phases_s(vws, spread) == pytest.approx((2 / 3, 2 / 3))


def test_a_relayed_group_crosses_its_node_link_once():
    """Two VWs on n1 through n1's relay: their stages reach the relay over n1's loopback (2 GB, 0.2 s); the
    relay pushes one copy over n1's egress (1 s) and the PS on n0 sends one pull back (1 s)."""
    vws = [vw("n1:0"), vw("n1:1")]
    relay = Relay((0, 1), "n1", 80.0)
    assert wave_phases_s(vws, network(), (relay,)) == pytest.approx((1.0, 1.0))
    assert wave_phases_s(vws, network()) == pytest.approx((2.0, 2.0))  # without: each VW's own


def test_the_gate_spreads_the_round_trip_over_d_plus_one_waves_and_each_phase_within_one():
    assert gate_bound_s((3.0, 1.0), 0) == 4.0
    assert gate_bound_s((3.0, 1.0), 1) == 3.0  # the pushes of one wave before the next wave's
    assert gate_bound_s((2.0, 2.0), 3) == 2.0
    assert gate_bound_s((1.0, 1.0), 1) == 1.0
