"""Virtual workers that are alike (docs/planning.md#search-at-scale): GPUs of one type and memory in one node
are interchangeable, and when the links depend only on whether two GPUs share a node, so are whole nodes of
the same GPUs. A VW's kind is its GPUs up to that renaming; the partitioner solves one VW per kind and the
others take its plan with their own GPU names. Pure."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Sequence

from hetpipe.core.planning.partition import Gpu
from hetpipe.core.planning.plan import VwPlan

__all__ = ["links_node_blind", "order_kind", "rename", "rename_in_order", "vw_kind"]


def _node(gpu: Gpu) -> str:
    return gpu[0].rsplit(":", 1)[0]


def vw_kind(gpus: Sequence[Gpu]) -> tuple:
    """The VW up to renaming nodes and GPUs: the sorted multiset of its nodes, each the sorted (type, memory)
    of its GPUs in the VW. Equal kinds have the same best order, split and Nm when links are node-blind."""
    by_node: dict[str, list[tuple[str, int]]] = {}
    for g in gpus:
        by_node.setdefault(_node(g), []).append((g[1], g[2]))
    return tuple(sorted(tuple(sorted(members)) for members in by_node.values()))


def order_kind(gpus: Sequence[Gpu]) -> tuple:
    """A VW in this stage order up to renaming: each GPU's (type, memory) and, for each GPU, the position of
    the first GPU on its node (so which stages share a node)."""
    first: dict[str, int] = {}
    return tuple((g[1], g[2], first.setdefault(_node(g), i)) for i, g in enumerate(gpus))


def rename(found: VwPlan, gpus: Sequence[Gpu], reserve: int) -> VwPlan:
    """`found` (a plan of another VW of the same kind, vw_kind, split with `reserve` bytes kept free per GPU)
    on `gpus`: each of its nodes mapped to one of `gpus`' nodes that holds the same GPUs (in sorted order, so
    deterministically), each of its GPUs to one of the same type and memory there."""
    theirs: dict[str, list[tuple[str, int]]] = {}
    for s in found.stages:
        theirs.setdefault(s.gpu.rsplit(":", 1)[0], []).append((s.gpu_type, s.memory_limit_bytes + reserve))
    mine: dict[str, list[Gpu]] = {}
    for g in gpus:
        mine.setdefault(_node(g), []).append(g)
    free: dict[tuple, list[str]] = {}
    for node in sorted(mine):
        free.setdefault(_members(mine[node]), []).append(node)
    node_of = {node: free[tuple(sorted(members))].pop(0) for node, members in sorted(theirs.items())}
    left = {node: sorted(members) for node, members in mine.items()}
    stages = []
    for s in found.stages:
        pool = left[node_of[s.gpu.rsplit(":", 1)[0]]]
        g = next(g for g in pool if (g[1], g[2]) == (s.gpu_type, s.memory_limit_bytes + reserve))
        pool.remove(g)
        stages.append(dataclasses.replace(s, gpu=g[0]))
    return dataclasses.replace(found, stages=tuple(stages))


def rename_in_order(found: VwPlan, gpus: Sequence[Gpu]) -> VwPlan:
    """`found` (split over another VW of the same order_kind, in stage order) on `gpus`: stage j on
    gpus[j]."""
    stages = tuple(dataclasses.replace(s, gpu=g[0]) for s, g in zip(found.stages, gpus, strict=True))
    return dataclasses.replace(found, stages=stages)


def _members(gpus: Sequence[Gpu]) -> tuple[tuple[str, int], ...]:
    return tuple(sorted((g[1], g[2]) for g in gpus))


def links_node_blind(link: Callable[[str, str], float], gpus_by_node: Sequence[Sequence[str]]) -> bool:
    """Whether `link(a, b)` depends only on a and b sharing a node, probed on the first two GPUs of every
    node and the first GPU of every pair of nodes (then VWs of one kind are alike, vw_kind)."""
    inside, across = set(), set()
    for gpus in gpus_by_node:
        if len(gpus) > 1:
            inside.add(link(gpus[0], gpus[1]))
    for a, b in itertools.combinations([g[0] for g in gpus_by_node if g], 2):
        across.add(link(a, b))
        if len(across) > 1:
            return False
    return len(inside) <= 1
