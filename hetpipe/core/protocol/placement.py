"""Which PS shard holds which parameter key: pure functions every client computes identically."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence

from hetpipe.core.errors import UsageError

__all__ = [
    "PLACEMENTS",
    "balanced_placement",
    "get_placement",
    "keys_by_shard",
    "layer_of_key",
    "layer_shards",
    "local_placement",
    "spread_layers",
    "spread_placement",
]

Placement = Callable[[Mapping[str, int], int], dict[str, int]]


def balanced_placement(sizes: Mapping[str, int], num_shards: int) -> dict[str, int]:
    """Greedy by bytes: largest key first onto the least-loaded shard (ties: lower shard, then key name).

    `sizes` must list the whole model's keys (not one stage's), so that every VW, however it splits
    the model, places each key on the same shard.
    """
    if num_shards < 1:
        raise UsageError(f"num_shards must be >= 1, got {num_shards}")
    load = [0] * num_shards
    out: dict[str, int] = {}
    for key in sorted(sizes, key=lambda k: (-sizes[k], k)):
        shard = min(range(num_shards), key=lambda s: (load[s], s))
        out[key] = shard
        load[shard] += sizes[key]
    return out


def spread_layers(layer_bytes: Sequence[int], num_shards: int) -> tuple[int, ...]:
    """The shard of each layer under the "spread" placement: whole layers, largest first, each onto the
    least-loaded shard (ties: lower shard, then the earlier layer), so that every node's shard holds about an
    even share of the model's bytes and each node's link carries about an even share of a wave's pulls."""
    if num_shards < 1:
        raise UsageError(f"num_shards must be >= 1, got {num_shards}")
    load = [0] * num_shards
    out = [0] * len(layer_bytes)
    for layer in sorted(range(len(layer_bytes)), key=lambda i: (-layer_bytes[i], i)):
        shard = min(range(num_shards), key=lambda s: (load[s], s))
        out[layer] = shard
        load[shard] += layer_bytes[layer]
    return tuple(out)


def spread_placement(sizes: Mapping[str, int], num_shards: int) -> dict[str, int]:
    """One shard per node, each holding whole layers (spread_layers of the keys' bytes by layer), so the PS's
    traffic fans out over every node's link instead of crossing the PS node's alone. `sizes` lists the whole
    model's keys, as for balanced_placement."""
    layers = max((layer_of_key(key) for key in sizes), default=-1) + 1
    layer_bytes = [0] * layers
    for key, size in sizes.items():
        layer_bytes[layer_of_key(key)] += size
    return local_placement(sizes, spread_layers(layer_bytes, num_shards))


PLACEMENTS: dict[str, Placement] = {  # "local" needs a layout: local_placement
    "balanced": balanced_placement,
    "spread": spread_placement,
}


def layer_of_key(key: str) -> int:
    """The layer a key belongs to: "3.weight" and "3.attn.qkv.bias" (hetpipe.models.stages) and "audit/3"."""
    head = key.removeprefix("audit/").split(".", 1)[0]
    if not head.isdigit():
        raise UsageError(f"key {key!r} names no layer (expected '<layer>.<name>' or 'audit/<layer>')")
    return int(head)


def layer_shards(gpus: Sequence[str], split: Sequence[int], nodes: Sequence[str]) -> tuple[int, ...]:
    """For each layer of a VW (its GPUs "n1:0" in stage order, layers per stage), the index in `nodes` of the
    node whose GPU runs it: the shard that holds the layer under the "local" placement."""
    if len(gpus) != len(split):
        raise UsageError(f"{len(gpus)} GPUs but {len(split)} stage sizes: give one layer count per GPU")
    out = []
    for gpu, count in zip(gpus, split, strict=True):
        node = gpu.rsplit(":", 1)[0]
        if node not in nodes:
            raise UsageError(
                f"GPU {gpu!r} is on node {node!r}, which is not one of the nodes {', '.join(nodes)}"
            )
        out += [list(nodes).index(node)] * count
    return tuple(out)


def local_placement(keys: Iterable[str], shard_of_layer: Sequence[int]) -> dict[str, int]:
    """ED-local (the HetPipe paper's): each key on the shard of the node that runs its layer (layer_shards of
    the first VW, so every VW places each key alike; with ED every VW runs a layer on the same node, so its
    pushes and pulls stay inside that node)."""
    out = {}
    for key in keys:
        layer = layer_of_key(key)
        if not 0 <= layer < len(shard_of_layer):
            raise UsageError(
                f"key {key!r} is in layer {layer}, but the layout has {len(shard_of_layer)} layers"
            )
        out[key] = shard_of_layer[layer]
    return out


def get_placement(name: str) -> Placement:
    try:
        return PLACEMENTS[name]
    except KeyError:
        known = ", ".join(sorted(PLACEMENTS))
        raise UsageError(f"unknown parameter placement {name!r}; known: {known}") from None


def keys_by_shard(placement: Mapping[str, int], keys: list[str], num_shards: int) -> list[list[str]]:
    """Split `keys` (one stage's, in order) into one list per shard."""
    out: list[list[str]] = [[] for _ in range(num_shards)]
    for key in keys:
        out[placement[key]].append(key)
    return out
