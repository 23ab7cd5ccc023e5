"""Which PS shard holds which parameter key: pure functions every client computes identically."""

from __future__ import annotations

from collections.abc import Callable, Mapping

from hetpipe.core.errors import UsageError

__all__ = ["PLACEMENTS", "balanced_placement", "get_placement", "keys_by_shard"]

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


PLACEMENTS: dict[str, Placement] = {"balanced": balanced_placement}


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
