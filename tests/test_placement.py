"""Tests of hetpipe.core.placement: balanced by bytes, deterministic, independent of how a model is split."""

from __future__ import annotations

import pytest

from hetpipe.core.errors import UsageError
from hetpipe.core.placement import balanced_placement, get_placement, keys_by_shard


def test_balanced_literal():
    sizes = {"a": 10, "b": 7, "c": 5, "d": 3, "e": 3}
    # a->0 (10), b->1 (7), c->1 (12), d->0 (13), e->1 (15)
    assert balanced_placement(sizes, 2) == {"a": 0, "b": 1, "c": 1, "d": 0, "e": 1}


def test_one_shard_takes_everything_and_order_of_input_does_not_matter():
    sizes = {f"k{i}": (i * 37) % 11 + 1 for i in range(30)}
    assert set(balanced_placement(sizes, 1).values()) == {0}
    reversed_sizes = dict(reversed(list(sizes.items())))
    assert balanced_placement(sizes, 4) == balanced_placement(reversed_sizes, 4)


def test_loads_are_within_the_largest_key():
    sizes = {f"k{i}": (i * 7919) % 1000 + 1 for i in range(200)}
    place = balanced_placement(sizes, 4)
    loads = [sum(n for k, n in sizes.items() if place[k] == s) for s in range(4)]
    assert max(loads) - min(loads) <= max(sizes.values())


def test_keys_by_shard_keeps_stage_order():
    assert keys_by_shard({"x": 1, "y": 0, "z": 1}, ["z", "y", "x"], 2) == [["y"], ["z", "x"]]


def test_errors():
    with pytest.raises(UsageError, match="known: balanced"):
        get_placement("random")
    with pytest.raises(UsageError):
        balanced_placement({"a": 1}, 0)
