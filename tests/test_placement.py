"""Tests of hetpipe.core.protocol.placement: balanced by bytes, deterministic, independent of how a model is
split; local by node; spread by whole layers."""

from __future__ import annotations

import pytest

from hetpipe.core.errors import UsageError
from hetpipe.core.protocol.placement import (
    balanced_placement,
    get_placement,
    keys_by_shard,
    layer_of_key,
    layer_shards,
    local_placement,
    spread_layers,
    spread_placement,
)


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


def test_local_puts_each_layer_on_the_shard_of_the_node_that_runs_it():
    # the first VW: n2:0 runs layers 0-1, n1:0 layers 2-3, n0:0 layers 4-9 (nodes n0 n1 n2 are shards 0 1 2)
    shards = layer_shards(("n2:0", "n1:0", "n0:0"), (2, 2, 6), ("n0", "n1", "n2"))
    assert shards == (2, 2, 1, 1, 0, 0, 0, 0, 0, 0)
    keys = ["0.weight", "1.bias", "3.attn.qkv.weight", "9.weight", "audit/2"]
    assert local_placement(keys, shards) == {
        "0.weight": 2,
        "1.bias": 2,
        "3.attn.qkv.weight": 1,
        "9.weight": 0,
        "audit/2": 1,
    }
    # two stages on one node: both on its shard
    assert layer_shards(("n1:0", "n1:1"), (1, 2), ("n0", "n1")) == (1, 1, 1)


def test_local_placement_errors_name_the_key_or_gpu():
    assert [layer_of_key(k) for k in ("12.weight", "audit/3", "0.running_mean")] == [12, 3, 0]
    with pytest.raises(UsageError, match="key 'head.weight' names no layer"):
        local_placement(["head.weight"], (0,))
    with pytest.raises(UsageError, match="key '5.weight' is in layer 5, but the layout has 2 layers"):
        local_placement(["5.weight"], (0, 1))
    with pytest.raises(UsageError, match="node 'n7'"):
        layer_shards(("n7:0",), (3,), ("n0", "n1"))
    with pytest.raises(UsageError, match="2 GPUs but 1 stage sizes"):
        layer_shards(("n0:0", "n1:0"), (3,), ("n0", "n1"))


def test_a_run_with_local_placement_places_the_models_keys_by_its_first_vw(tmp_path):
    from hetpipe.compute.build import VwLayout, ps_placement
    from hetpipe.core.config.files import load_config
    from hetpipe.core.config.overrides import apply_overrides
    from hetpipe.models import get_model

    from conftest import write_config

    path = write_config(tmp_path, vws=[["n0:0", "n0:1"]], nm=1, staleness=0, waves=1, hidden=(8, 8, 8))
    path.write_text(path.read_text() + '\n[[nodes]]\nname = "n1"\ngpus = ["g0"]\n')
    config = apply_overrides(load_config(path), ['ps.placement="local"', "ps.shards=2"])
    spec = get_model("mlp", hidden=[8, 8, 8])  # a flatten, then 4 linear layers: "1.0.weight" ... "4.bias"
    place = ps_placement(
        config, spec, first_vw=VwLayout(("n1:0", "n0:0"), (2, 3))
    )  # layers 0-1 on n1, 2-4 on n0
    assert place == {
        "1.0.weight": 1,
        "1.0.bias": 1,
        "2.0.weight": 0,
        "2.0.bias": 0,
        "3.0.weight": 0,
        "3.0.bias": 0,
        "4.weight": 0,
        "4.bias": 0,
    }
    with pytest.raises(UsageError, match="follows the first VW"):
        ps_placement(config, spec)


def test_spread_deals_whole_layers_largest_first_onto_the_least_loaded_shard():
    # bytes by layer: 10, 60, 5, 30, 5 over 3 shards. 60 -> s0; 30 -> s1; 10 -> s2; 5 (layer 2) -> s2
    # (10 < 30); 5 (layer 4) -> s2 (15 < 30): loads 60 / 30 / 20
    assert spread_layers([10, 60, 5, 30, 5], 3) == (2, 0, 2, 1, 2)
    assert spread_layers([4, 4, 4, 4], 2) == (0, 1, 0, 1)  # ties: the lower shard, the earlier layer first
    assert spread_layers([7, 3], 1) == (0, 0)
    with pytest.raises(UsageError, match="num_shards"):
        spread_layers([1], 0)


def test_spread_placement_keeps_a_layers_keys_together_and_is_registered():
    sizes = {"0.weight": 40, "0.bias": 4, "1.weight": 100, "1.bias": 10, "2.weight": 50, "audit/2": 8}
    # bytes by layer: 0 -> 44, 1 -> 110, 2 -> 58 (its ledger counted); 110 -> s0, 58 -> s1, then 44 -> s1,
    # the less loaded (58 < 110)
    assert spread_placement(sizes, 2) == {
        "0.weight": 1,
        "0.bias": 1,
        "1.weight": 0,
        "1.bias": 0,
        "2.weight": 1,
        "audit/2": 1,
    }
    assert get_placement("spread") is spread_placement
    with pytest.raises(UsageError, match="names no layer"):
        spread_placement({"head.weight": 4}, 2)
