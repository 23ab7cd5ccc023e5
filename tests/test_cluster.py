"""Allocation policies (NP, ED, HD, explicit), VW capacity and ED-local placement, on literal clusters."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hetpipe.core.config.files import default_config_path, load_config
from hetpipe.core.config.parse import parse_config
from hetpipe.core.config.schema import GpuRef, GpuType, Node
from hetpipe.core.errors import UsageError
from hetpipe.core.planning.cluster import allocate, vw_capacity
from hetpipe.core.planning.plan import StagePlan

TYPES = {
    "fast": GpuType("fast", 2.0, 8.0),
    "slow": GpuType("slow", 1.0, 4.0),
}
# The paper's cluster (docs/planning.md#the-papers-cluster): one GPU type per node, 4 GPUs each.
PAPER_TYPES = {
    "titan-v": GpuType("titan-v", 14.9, 12.0),
    "titan-rtx": GpuType("titan-rtx", 16.3, 24.0),
    "rtx-2060": GpuType("rtx-2060", 6.5, 6.0),
    "p4000": GpuType("p4000", 5.3, 8.0),
}
PAPER = (PAPER_TYPES, tuple(Node(f"n{i}", "h", (name,) * 4) for i, name in enumerate(PAPER_TYPES)))


def refs(*texts: str) -> list[GpuRef]:
    return [GpuRef.parse(t) for t in texts]


def table(vws: list[list[GpuRef]]) -> list[str]:
    return [" ".join(map(str, vw)) for vw in vws]


# ---------------------------------------------------------------------------------------------- 2 x 2


MIXED = (TYPES, (Node("n0", "h", ("fast", "slow")), Node("n1", "h", ("fast", "slow"))))
SPLIT = (TYPES, (Node("n0", "h", ("fast", "fast")), Node("n1", "h", ("slow", "slow"))))


@pytest.mark.parametrize(
    ("cluster", "policy", "expected"),
    [
        (MIXED, "np", ["n0:0 n0:1", "n1:0 n1:1"]),
        (MIXED, "ed", ["n0:0 n0:1", "n1:0 n1:1"]),  # one fast + one slow each: that is a node here
        # nodes tie on speed (3, 3): n0 is dealt fast->a, slow->b; n1 starts with b (less capacity)
        (MIXED, "hd", ["n0:0 n1:1", "n0:1 n1:0"]),
        (SPLIT, "np", ["n0:0 n0:1", "n1:0 n1:1"]),
        (SPLIT, "ed", ["n0:0 n1:0", "n0:1 n1:1"]),
        (SPLIT, "hd", ["n0:0 n1:0", "n0:1 n1:1"]),
        (MIXED, "dp", ["n0:0", "n0:1", "n1:0", "n1:1"]),  # every GPU its own VW, in cluster order
    ],
)
def test_two_nodes_of_two(cluster, policy: str, expected: list[str]) -> None:
    assert table(allocate(cluster, policy)) == expected


def test_paper_cluster_np_gives_homogeneous_node_workers() -> None:
    vws = allocate(PAPER, "np")
    assert table(vws) == [
        "n0:0 n0:1 n0:2 n0:3",
        "n1:0 n1:1 n1:2 n1:3",
        "n2:0 n2:1 n2:2 n2:3",
        "n3:0 n3:1 n3:2 n3:3",
    ]
    assert [vw_capacity(PAPER, vw) for vw in vws] == pytest.approx([59.6, 65.2, 26.0, 21.2])


def test_paper_cluster_ed_gives_one_gpu_of_each_type() -> None:
    vws = allocate(PAPER, "ed")
    assert table(vws) == [
        "n0:0 n1:0 n2:0 n3:0",
        "n0:1 n1:1 n2:1 n3:1",
        "n0:2 n1:2 n2:2 n3:2",
        "n0:3 n1:3 n2:3 n3:3",
    ]
    assert [vw_capacity(PAPER, vw) for vw in vws] == pytest.approx([43.0] * 4)


def test_paper_cluster_hd_pairs_fastest_with_slowest_node() -> None:
    # Ranked by speed: n1 (titan-rtx) > n0 (titan-v) > n2 (rtx-2060) > n3 (p4000); pairs (n1, n3), (n0, n2);
    # each pair makes two VWs of half a fast node + half a slow node, one network crossing each.
    vws = allocate(PAPER, "hd")
    assert table(vws) == [
        "n1:0 n1:2 n3:0 n3:2",
        "n1:1 n1:3 n3:1 n3:3",
        "n0:0 n0:2 n2:0 n2:2",
        "n0:1 n0:3 n2:1 n2:3",
    ]
    assert [vw_capacity(PAPER, vw) for vw in vws] == pytest.approx([43.2, 43.2, 42.8, 42.8])


def test_ed_with_unequal_type_counts_gives_the_same_mix_to_each() -> None:
    cluster = (TYPES, (Node("a", "h", ("fast", "slow", "slow")), Node("b", "h", ("fast", "slow", "slow"))))
    assert table(allocate(cluster, "ed")) == ["a:0 a:1 a:2", "b:0 b:1 b:2"]
    assert table(allocate(cluster, "ed", 1)) == ["a:0 a:1 a:2 b:0 b:1 b:2"]


def test_hd_with_odd_node_count_leaves_the_middle_node_whole() -> None:
    cluster = (
        TYPES,
        (Node("a", "h", ("slow",) * 2), Node("b", "h", ("fast",) * 2), Node("c", "h", ("fast", "slow"))),
    )
    # speeds: b 4, c 3, a 2 -> pair (b, a), c alone
    assert table(allocate(cluster, "hd")) == ["a:0 b:0", "a:1 b:1", "c:0 c:1"]


def test_explicit_keeps_the_listed_stage_order() -> None:
    data = {
        "name": "x",
        "gpu_types": {"g": {"speed": 1, "memory_gib": 2}},
        "nodes": [{"name": "a", "gpus": ["g", "g"]}, {"name": "b", "gpus": ["g"]}],
        "allocation": {"policy": "explicit"},
        "virtual_workers": [{"gpus": ["b:0", "a:1"]}, {"gpus": ["a:0"]}],
    }
    cfg = parse_config(data, Path("mem.toml"))
    assert table(allocate(cfg, "explicit")) == ["b:0 a:1", "a:0"]
    assert table(allocate(cfg, "np")) == ["a:0 a:1", "b:0"]


def test_packaged_config_allocates() -> None:
    cfg = load_config(default_config_path())
    assert table(allocate(cfg, cfg.allocation.policy)) == ["n0:0 n0:1", "n1:0 n1:1"]


@pytest.mark.parametrize(
    ("cluster", "policy", "num_vws", "match"),
    [
        (PAPER, "ed", 3, r'type "titan-v" has 4; use num_vws in \{1, 2, 4\}'),
        (PAPER, "np", 2, "one virtual worker per node.*use num_vws=4"),
        (PAPER, "hd", 8, "use num_vws=4"),
        (PAPER, "explicit", None, "add \\[\\[virtual_workers\\]\\]"),
        (PAPER, "hdd", None, 'did you mean "hd"'),
        (PAPER, "np", 0, "num_vws must be >= 1"),
        (
            PAPER,
            "dp",
            4,
            'one virtual worker per GPU: 16 GPUs, but num_vws=4; use num_vws=16, or policy "ed"',
        ),
        ((TYPES, (Node("a", "h", ("fastt",)),)), "np", None, 'unknown type "fastt"'),
    ],
)
def test_policy_errors_name_the_fix(cluster, policy: str, num_vws: int | None, match: str) -> None:
    with pytest.raises(UsageError, match=match):
        allocate(cluster, policy, num_vws)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.sampled_from(["fast", "slow"]), min_size=1, max_size=5), min_size=1, max_size=5))
def test_every_policy_uses_every_gpu_once(node_types: list[list[str]]) -> None:
    cluster = (TYPES, tuple(Node(f"n{i}", "h", tuple(types)) for i, types in enumerate(node_types)))
    every = sorted(GpuRef(f"n{i}", j) for i, types in enumerate(node_types) for j in range(len(types)))
    for policy in ("np", "ed", "hd", "dp"):
        vws = allocate(cluster, policy)
        assert all(vws) and sorted(g for vw in vws for g in vw) == every
        assert allocate(cluster, policy) == vws  # deterministic
    ed = allocate(cluster, "ed")
    mixes = {frozenset(Counter(cluster[1][int(g.node[1:])].gpus[g.index] for g in vw).items()) for vw in ed}
    assert len(mixes) == 1
    assert len(allocate(cluster, "hd")) == len(node_types)
    assert all(len(vw) == 1 for vw in allocate(cluster, "dp"))


# ---------------------------------------------------------------------------------------------- placement


def stage(gpu: str, start: int, stop: int) -> StagePlan:
    return StagePlan(gpu, "g", start, stop, 1.0, 2.0, 0.0, 0.0, 0, 0)
