"""Node-local aggregation as the planner prices it (hetpipe/core/planning/relays.py): the relayed groups and
the bytes a wave moves over the PS link, from the rules."""

from __future__ import annotations

from hetpipe.core.planning.plan import StagePlan, VwPlan
from hetpipe.core.planning.relays import (
    Relay,
    home_node,
    node_kinds,
    plan_relays,
    prefix_ps_bytes,
    ps_bytes_per_wave,
    relay_text,
)

MIB = 2**20
TWO_BY_TWO = [["n0:0"], ["n0:1"], ["n1:0"], ["n1:1"]]  # one VW per GPU, two GPUs per node


def vw(*gpus: str, param_bytes: int = MIB) -> VwPlan:
    stages = tuple(StagePlan(g, "t", j, j + 1, 0.1, 0.2, 0.0, 0.0, 0, 1) for j, g in enumerate(gpus))
    return VwPlan(stages, 2, param_bytes)


def test_the_vws_wholly_on_one_node_are_relayed_with_their_nodes_inside_link() -> None:
    inside = {"n0": 100.0, "n1": 40.0}
    assert plan_relays(TWO_BY_TWO, True, inside.__getitem__) == (
        Relay((0, 1), "n0", 100.0),
        Relay((2, 3), "n1", 40.0),
    )
    assert plan_relays(TWO_BY_TWO, False, inside.__getitem__) == ()
    # a VW spanning both nodes talks to the PS itself; n1's two single-GPU VWs still share a relay
    assert plan_relays([["n0:0", "n1:0"], ["n1:1"], ["n1:2"]], True, inside.__getitem__) == (
        Relay((1, 2), "n1", 40.0),
    )
    # every VW alone on its node: nothing to relay
    assert plan_relays([["n0:0", "n0:1"], ["n1:0"]], True, inside.__getitem__) == ()


def test_a_relayed_group_moves_one_copy_of_the_weights_over_the_ps_link() -> None:
    vws = [vw(*gpus) for gpus in TWO_BY_TWO]
    relays = plan_relays(TWO_BY_TWO, True, lambda node: 100.0)
    # off: 4 VWs push and pull 1 MiB each; on: each of the 2 groups once
    assert ps_bytes_per_wave(vws, (), pulls=True) == 8 * MIB
    assert ps_bytes_per_wave(vws, relays, pulls=True) == 4 * MIB
    assert ps_bytes_per_wave(vws, relays, pulls=False) == 2 * MIB
    three = [vw("n0:0"), vw("n0:1"), vw("n0:2"), vw("n1:0", "n2:0")]
    assert ps_bytes_per_wave(three, plan_relays([v.gpus for v in three], True, lambda n: 1.0), True) == (
        2 * MIB + 2 * MIB
    )


def test_prefixes_and_kinds_by_node_agree_with_the_groups() -> None:
    """What the fast search computes per grouping without building its relays: the bytes of every prefix of
    the VWs in one pass, and the relayed groups as kinds per node."""
    gpus = [["n0:0"], ["n1:0", "n2:0"], ["n0:1"], ["n1:1"], ["n0:2"], ["n1:2"]]
    vws = [vw(*g, param_bytes=MIB * (1 + v % 2)) for v, g in enumerate(gpus)]
    assert [home_node(g) for g in gpus] == ["n0", None, "n0", "n1", "n0", "n1"]
    for n in range(1, len(vws) + 1):
        relays = plan_relays(gpus[:n], True, lambda node: 1.0)
        assert prefix_ps_bytes(vws)[n - 1] == ps_bytes_per_wave(vws[:n], relays, pulls=False)
    kinds = [7, 8, 7, 9, 9, 7]
    assert node_kinds([(kinds[v], home_node(g)) for v, g in enumerate(gpus)]) == {
        "n0": (7, 7, 9),
        "n1": (7, 9),
    }


def test_the_report_names_each_group_and_its_node() -> None:
    text = relay_text([(0, 1), (2, 3)], TWO_BY_TWO)
    assert text.startswith("vw0+vw1 through n0's relay, vw2+vw3 through n1's (each group pushes and pulls")
    assert relay_text([], TWO_BY_TWO).startswith("on, but no node holds two VWs wholly")
    many = [[f"n{i // 2}:{i % 2}"] for i in range(12)]
    folded = relay_text([(2 * i, 2 * i + 1) for i in range(6)], many, shown=2)
    assert "vw2+vw3 through n1's and 4 more groups (" in folded
