"""Node-local aggregation's groups (docs/wsp.md#node-local-aggregation): which virtual workers push and pull
through one relay on their node, and the order a wave's sum adds them in. Pure.

The VWs whose GPUs all sit on one node form that node's group when there are two or more of them; every
other VW (alone on its node, or spanning nodes) is a group of its own and talks to the PS directly. Groups are
ordered by their first VW, and a wave's sum is

    S_t = G_a(t) + G_b(t) + ...        G_g(t) = (k_i P_i(t) + k_j P_j(t)) + ...   (i < j < ... in group g)

(k_v: VW v's weight by samples where the rule weighs the key, else 1). With every group alone this is the
plain VW-order sum, bit for bit.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["group_node", "node_groups", "relay_node", "relayed"]


def _node(gpu: str) -> str:
    return gpu.rsplit(":", 1)[0]


def node_groups(vw_gpus: Sequence[Sequence[str]], on: bool = True) -> tuple[tuple[int, ...], ...]:
    """The groups of a run whose VW v runs on the GPUs `vw_gpus[v]` ("node:index"), ordered by their first VW;
    with `on` false (node_aggregation off) every VW is a group of its own."""
    by_node: dict[str, list[int]] = {}
    alone: list[tuple[int]] = []
    for v, gpus in enumerate(vw_gpus):
        nodes = {_node(g) for g in gpus}
        if on and len(nodes) == 1:
            by_node.setdefault(nodes.pop(), []).append(v)
        else:
            alone.append((v,))
    groups = [tuple(vs) for vs in by_node.values() if len(vs) > 1]
    groups += [(vs[0],) for vs in by_node.values() if len(vs) == 1]
    return tuple(sorted(groups + alone))


def relayed(groups: Sequence[Sequence[int]]) -> tuple[tuple[int, ...], ...]:
    """The groups that run through a relay: those of two or more VWs."""
    return tuple(tuple(g) for g in groups if len(g) > 1)


def group_node(vw_gpus: Sequence[Sequence[str]], group: Sequence[int]) -> str:
    """The node a relayed group's VWs sit on (where its relay runs)."""
    return _node(vw_gpus[group[0]][0])


def relay_node(vw_gpus: Sequence[Sequence[str]], vw: int, on: bool) -> str | None:
    """The node whose relay VW `vw` pushes and pulls through, or None when it talks to the PS itself."""
    for group in relayed(node_groups(vw_gpus, on)):
        if vw in group:
            return group_node(vw_gpus, group)
    return None
