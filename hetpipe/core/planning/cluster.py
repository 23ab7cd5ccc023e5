"""Grouping a cluster's GPUs into virtual workers (NP, ED, HD, DP, explicit). Pure."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence

from hetpipe.core.config.schema import ClusterConfig, GpuRef, GpuType, Node, VirtualWorkerSpec
from hetpipe.core.errors import UsageError, did_you_mean

__all__ = [
    "POLICIES",
    "Cluster",
    "allocate",
    "check_vw_index",
    "vw_capacity",
    "vw_count",
    "vw_gpus",
]

# A validated config, or just its GPU types and nodes (enough for every policy but "explicit").
Cluster = ClusterConfig | tuple[Mapping[str, GpuType], Sequence[Node]]

POLICIES = ("np", "ed", "hd", "dp", "explicit")


class _Parts:
    """The pieces of a Cluster the policies read, with GPU speeds and the cluster order of nodes."""

    def __init__(self, cluster: Cluster) -> None:
        if isinstance(cluster, ClusterConfig):
            self.gpu_types, nodes, self.listed = cluster.gpu_types, cluster.nodes, cluster.virtual_workers
        else:
            (self.gpu_types, nodes), self.listed = cluster, None
        self.nodes = tuple(nodes)
        for node in self.nodes:
            for i, name in enumerate(node.gpus):
                if name not in self.gpu_types:
                    raise UsageError(
                        f'node {node.name!r}: GPU {i} has unknown type "{name}"; '
                        f"declare it among the GPU types ({', '.join(self.gpu_types)})"
                    )
        self.position = {node.name: n for n, node in enumerate(self.nodes)}
        self.by_name = {node.name: node for node in self.nodes}

    def speed(self, ref: GpuRef) -> float:
        return self.gpu_types[self.by_name[ref.node].gpus[ref.index]].speed

    def type_of(self, ref: GpuRef) -> str:
        return self.by_name[ref.node].gpus[ref.index]

    def order(self, refs: Sequence[GpuRef]) -> list[GpuRef]:
        """Cluster order: nodes as listed in the config, then GPU index."""
        return sorted(refs, key=lambda r: (self.position[r.node], r.index))

    def gpus(self, node: Node) -> list[GpuRef]:
        return [GpuRef(node.name, i) for i in range(len(node.gpus))]


def allocate(cluster: Cluster, policy: str, num_vws: int | None = None) -> list[list[GpuRef]]:
    """The virtual workers `policy` makes from the cluster's GPUs (docs/planning.md#allocation-policies),
    deterministically.

    np        one VW per node (nodes without GPUs are skipped), GPUs in index order.
    ed        every VW gets the same mix of GPU types: each type's GPUs, in cluster order, are cut
              into num_vws equal consecutive blocks, block v going to VW v. num_vws defaults to
              the gcd of the per-type counts (one GPU of each type when all counts are equal).
    hd        nodes ranked by total speed (ties: config order); the fastest is paired with the
              slowest, the second fastest with the second slowest, and so on. Each pair makes two
              VWs: each node's GPUs, fastest first (ties: index), are dealt alternately to the two,
              the deal starting with the VW of lower capacity so far (ties: the first). So each VW
              has about half a fast node and half a slow node, crosses the network once, and the
              two VWs of a pair have nearly equal capacity. With an odd number of nodes the middle
              one in the ranking forms a VW on its own. Always one VW per node.
    dp        data parallelism through the PS: every GPU its own one-stage VW, in cluster order (each
              must hold the whole model; the planner pipelines those that cannot with the others of their
              node that cannot, leaves out a lone one, and those that would slow the rest).
    explicit  the config's [[virtual_workers]], GPUs in the listed (stage) order.

    Except for explicit, each VW lists its GPUs in cluster order (config node order, then index);
    the partitioner chooses the stage order. `num_vws`, when given, must match what the policy
    can make; UsageError says which values work.
    """
    parts = _Parts(cluster)
    if policy not in _POLICY_FUNCTIONS:
        near = did_you_mean(policy, POLICIES, cutoff=0.5)
        raise UsageError(f"unknown allocation policy {policy!r}; use one of {', '.join(POLICIES)}{near}")
    if num_vws is not None and num_vws < 1:
        raise UsageError(f"num_vws must be >= 1, got {num_vws}; or leave it out to let the policy choose")
    return _POLICY_FUNCTIONS[policy](parts, num_vws)


def vw_capacity(cluster: Cluster, gpus: Sequence[GpuRef]) -> float:
    """A virtual worker's capacity: the sum of its GPUs' relative speeds."""
    parts = _Parts(cluster)
    return sum(parts.speed(ref) for ref in gpus)


def _np(parts: _Parts, num_vws: int | None) -> list[list[GpuRef]]:
    vws = [parts.gpus(node) for node in parts.nodes if node.gpus]
    if num_vws is not None and num_vws != len(vws):
        raise UsageError(
            f'policy "np" makes one virtual worker per node: {len(vws)} nodes with GPUs, '
            f"but num_vws={num_vws}; "
            f'use num_vws={len(vws)}, or policy "ed" or "explicit" for another number of virtual workers'
        )
    return vws


def _ed(parts: _Parts, num_vws: int | None) -> list[list[GpuRef]]:
    by_type: dict[str, list[GpuRef]] = {}
    for node in parts.nodes:
        for ref in parts.gpus(node):
            by_type.setdefault(parts.type_of(ref), []).append(ref)
    common = math.gcd(*(len(refs) for refs in by_type.values()))
    count = common if num_vws is None else num_vws
    uneven = [(name, len(refs)) for name, refs in by_type.items() if len(refs) % count]
    if uneven:
        name, have = uneven[0]
        choices = [str(d) for d in range(1, common + 1) if common % d == 0]
        raise UsageError(
            'policy "ed" gives every virtual worker the same mix of GPU types, so each type\'s GPU count '
            f'must be a multiple of num_vws={count}, but type "{name}" has {have}; use num_vws in '
            f'{{{", ".join(choices)}}}, or policy "hd" or "np"'
        )
    vws: list[list[GpuRef]] = [[] for _ in range(count)]
    for refs in by_type.values():
        size = len(refs) // count
        for v in range(count):
            vws[v] += refs[v * size : (v + 1) * size]
    return [parts.order(vw) for vw in vws]


def _hd(parts: _Parts, num_vws: int | None) -> list[list[GpuRef]]:
    nodes = [node for node in parts.nodes if node.gpus]
    if num_vws is not None and num_vws != len(nodes):
        raise UsageError(
            f'policy "hd" makes one virtual worker per node (two per fast/slow node pair): {len(nodes)} '
            f'nodes with GPUs, but num_vws={num_vws}; use num_vws={len(nodes)}, or policy "ed" or "explicit"'
        )

    def capacity(refs: Sequence[GpuRef]) -> float:
        return sum(parts.speed(ref) for ref in refs)

    ranked = sorted(range(len(nodes)), key=lambda n: (-capacity(parts.gpus(nodes[n])), n))
    vws: list[list[GpuRef]] = []
    for rank in range(len(nodes) // 2):
        pair: tuple[list[GpuRef], list[GpuRef]] = ([], [])
        for node in (nodes[ranked[rank]], nodes[ranked[-1 - rank]]):
            first = 0 if capacity(pair[0]) <= capacity(pair[1]) else 1
            dealt = sorted(parts.gpus(node), key=lambda r: (-parts.speed(r), r.index))
            for i, ref in enumerate(dealt):
                pair[(first + i) % 2].append(ref)
        vws += [parts.order(vw) for vw in pair]
    if len(nodes) % 2:
        vws.append(parts.gpus(nodes[ranked[len(nodes) // 2]]))
    return vws


def _dp(parts: _Parts, num_vws: int | None) -> list[list[GpuRef]]:
    vws = [[ref] for node in parts.nodes for ref in parts.gpus(node)]
    if num_vws is not None and num_vws != len(vws):
        raise UsageError(
            f'policy "dp" makes one virtual worker per GPU: {len(vws)} GPUs, but num_vws={num_vws}; '
            f'use num_vws={len(vws)}, or policy "ed" or "explicit" for another number of virtual workers'
        )
    return vws


def _explicit(parts: _Parts, num_vws: int | None) -> list[list[GpuRef]]:
    listed: Sequence[VirtualWorkerSpec] | None = parts.listed
    if not listed:
        raise UsageError(
            'policy "explicit" takes the virtual workers listed in the config, and none are listed; '
            'add [[virtual_workers]] tables with gpus = ["n0:0", ...], or use policy "np", "ed" or "hd"'
        )
    if num_vws is not None and num_vws != len(listed):
        raise UsageError(
            f"the config lists {len(listed)} virtual workers but num_vws={num_vws}; "
            f"use num_vws={len(listed)} or edit the [[virtual_workers]] tables"
        )
    return [list(spec.gpus) for spec in listed]


_POLICY_FUNCTIONS: dict[str, Callable[[_Parts, int | None], list[list[GpuRef]]]] = {
    "np": _np,
    "ed": _ed,
    "hd": _hd,
    "dp": _dp,
    "explicit": _explicit,
}


def vw_count(config: ClusterConfig) -> int:
    """How many virtual workers the config makes: those it lists, or its allocation policy's groups."""
    return len(vw_gpus(config))


def vw_gpus(config: ClusterConfig) -> list[list[str]]:
    """Each virtual worker's GPUs ("node:index", in stage order): those the config lists, or its allocation
    policy's groups."""
    if config.allocation.policy != "explicit":
        return [[str(g) for g in vw] for vw in allocate(config, config.allocation.policy)]
    return [[str(g) for g in vw.gpus] for vw in config.virtual_workers]


def check_vw_index(config: ClusterConfig, vw: int) -> None:
    """UsageError when `vw` is not one of the config's virtual workers (imports no torch: `hetpipe worker`
    refuses a wrong --vw at once, before it imports torch)."""
    count = vw_count(config)
    if not 0 <= vw < count:
        raise UsageError(
            f"--vw {vw} is out of range: {config.path} has {count} virtual workers (0..{count - 1})"
        )
