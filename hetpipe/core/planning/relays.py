"""Node-local aggregation as the planner prices it (docs/planning.md#node-local-aggregation): a plan's
relayed groups (hetpipe.core.wsp.groups), each with its node and that node's inside link, and the bytes a wave
moves over the PS link when each group pushes and pulls one copy of the weights. Pure."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from hetpipe.core.planning.plan import VwPlan
from hetpipe.core.wsp.groups import group_node, node_groups, relayed

__all__ = [
    "Relay",
    "home_node",
    "node_kinds",
    "plan_relays",
    "prefix_ps_bytes",
    "ps_bytes_per_wave",
    "relay_text",
]


@dataclass(frozen=True)
class Relay:
    """A group of two or more VWs wholly on one node that push and pull through one relay there: each
    stage's push and pull cross the node's inside link (`inside_gbps`, for weights) to and from the relay, and
    the relay sends one push of the whole model's weights upstream once every VW of the group has finished the
    wave, and makes one pull per wave whose reply it hands to every stage of the group."""

    vws: tuple[int, ...]  # the plan's VW indices, in order
    node: str
    inside_gbps: float


def plan_relays(
    vw_gpus: Sequence[Sequence[str]], on: bool, inside_gbps: Callable[[str], float]
) -> tuple[Relay, ...]:
    """The relayed groups of a plan whose VW v runs on `vw_gpus[v]` with [ps] node_aggregation `on` (none when
    off, or when no node holds two VWs wholly), each with its node's inside link `inside_gbps(node)`."""
    if not on:
        return ()
    out = []
    for group in relayed(node_groups(vw_gpus, on)):
        node = group_node(vw_gpus, group)
        out.append(Relay(tuple(group), node, inside_gbps(node)))
    return tuple(out)


def ps_bytes_per_wave(vws: Sequence[VwPlan], relays: Sequence[Relay], pulls: bool) -> float:
    """Bytes (float32 weights) one wave of every VW moves over the PS link: each VW's weights pushed (and
    pulled when it pulls), a relayed group's once for all its VWs (the largest of theirs: one VW's)."""
    per_pass = 2 if pulls else 1
    moved = sum(vw.param_bytes for vw in vws) * per_pass
    for relay in relays:
        group = [vws[v].param_bytes for v in relay.vws]
        moved -= (sum(group) - max(group)) * per_pass
    return moved


def home_node(gpus: Sequence[str]) -> str | None:
    """The node all of a VW's GPUs ("node:index") sit on, or None when they span nodes (never relayed)."""
    nodes = {g.rsplit(":", 1)[0] for g in gpus}
    return nodes.pop() if len(nodes) == 1 else None


def prefix_ps_bytes(vws: Sequence[VwPlan]) -> list[int]:
    """Bytes one pass of the weights (every push, or every pull) of the first 1, 2, ... of `vws` moves over
    the PS link with node aggregation: each VW spanning nodes its own, and per node one copy for the VWs
    wholly on it (the largest of theirs: relayed, or alone): ps_bytes_per_wave of each prefix, all in
    O(VWs)."""
    out, total = [], 0
    largest: dict[str, int] = {}
    for vw in vws:
        node = home_node(vw.gpus)
        if node is None:
            total += vw.param_bytes
        elif vw.param_bytes > largest.get(node, 0):
            total += vw.param_bytes - largest.get(node, 0)
            largest[node] = vw.param_bytes
        out.append(total)
    return out


def node_kinds(members: Sequence[tuple[int, str | None]]) -> dict[str, tuple[int, ...]]:
    """The relayed groups of VWs given as (kind, home node): per node holding two or more, their kinds."""
    by_node: dict[str, list[int]] = {}
    for kind, node in members:
        if node is not None:
            by_node.setdefault(node, []).append(kind)
    return {node: tuple(sorted(kinds)) for node, kinds in by_node.items() if len(kinds) > 1}


def relay_text(groups: Sequence[Sequence[int]], vw_gpus: Sequence[Sequence[str]], shown: int = 4) -> str:
    """What node aggregation does to a plan whose VW v runs on `vw_gpus[v]`: "vw0+vw1 through n0's relay,
    vw2+vw3 through n1's" (the first `shown` groups, then how many more), or that no node holds two VWs
    wholly."""
    if not groups:
        return "on, but no node holds two VWs wholly: every VW pushes and pulls itself"
    parts = [
        f"{'+'.join(f'vw{v}' for v in group)} through {group_node(vw_gpus, group)}'s"
        + (" relay" if n == 0 else "")
        for n, group in enumerate(groups[:shown])
    ]
    more = f" and {len(groups) - shown} more groups" if len(groups) > shown else ""
    return (
        ", ".join(parts)
        + more
        + " (each group pushes and pulls one copy of the weights per wave over the PS's "
        "links; its VWs' traffic stays on the node)"
    )
