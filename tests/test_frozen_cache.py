"""train.freeze_cache_mib (hetpipe.compute.frozen_cache, docs/wsp.md#the-frozen-layers-cache): each sample's
output of a stage's frozen layers, kept and reused where the data repeat; runs with it equal the reference,
which keeps its own rows, bit for bit."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from hetpipe.compute.frozen_cache import FrozenCache
from hetpipe.compute.stage_freezing import run_layers
from hetpipe.core.config.files import load_config
from hetpipe.core.config.overrides import apply_overrides
from hetpipe.core.errors import ConfigError

from conftest import write_config
from equivalence import assert_equals_reference


def _net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3))


def test_a_minibatch_of_kept_samples_skips_the_frozen_layers_and_gets_their_rows() -> None:
    net, x = _net(), torch.randn(8, 6)
    cache = FrozenCache(2**20)
    first = cache.run(net, x[:4], 2, [10, 11, 12, 13])
    assert (cache.hits, cache.misses, len(cache.rows)) == (0, 1, 4)
    assert torch.equal(first, run_layers(net, x[:4], 2))
    # the same samples in another order: served from the rows, whatever the inputs say
    again = cache.run(net, torch.zeros(4, 6), 2, [13, 12, 11, 10])
    assert cache.hits == 1 and torch.equal(again, first.flip(0))
    assert again.requires_grad  # the layers after the frozen ones still train
    # one sample not kept: the frozen layers run on it alone, its row is kept, the others' rows serve
    mixed = cache.run(net, torch.cat([torch.zeros(3, 6), x[4:5]]), 2, [10, 11, 12, 14])
    assert cache.misses == 2 and len(cache.rows) == 5
    assert torch.equal(mixed[:3], first[:3]) and torch.equal(mixed[3], run_layers(net, x[4:5], 2)[0])
    assert torch.equal(cache.run(net, torch.zeros(1, 6), 2, [14])[0], mixed[3])


def test_kept_rows_are_forgotten_when_the_frozen_weights_or_count_change() -> None:
    net, x = _net(), torch.randn(4, 6)
    cache = FrozenCache(2**20)
    cache.run(net, x, 2, [0, 1, 2, 3])
    with torch.no_grad():
        net[0].weight.add_(0.5)  # a pull brought other values for a frozen layer
    changed = cache.run(net, x, 2, [0, 1, 2, 3])
    assert cache.misses == 2 and torch.equal(changed, run_layers(net, x, 2))
    with torch.no_grad():
        net[2].weight.add_(0.5)  # a layer that trains: the rows stay
    cache.run(net, x, 2, [0, 1, 2, 3])
    assert cache.hits == 1
    cache.run(net, x, 1, [0, 1, 2, 3])  # another frozen count: other rows
    assert cache.misses == 3 and cache.rows[0].shape == (5,)


def test_untouched_frozen_tensors_are_not_compared(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same tensors with the same version counters are taken as unchanged without a comparison (on CUDA
    one would wait for the device each minibatch); a write in place bumps the counter: they are compared."""
    import hetpipe.compute.frozen_cache as frozen_cache

    compared = []
    real = frozen_cache._equal
    monkeypatch.setattr(frozen_cache, "_equal", lambda a, b: compared.append(1) or real(a, b))
    net, x = _net(), torch.randn(4, 6)
    cache = FrozenCache(2**20)
    cache.run(net, x, 2, [0, 1, 2, 3])
    cache.run(net, x, 2, [0, 1, 2, 3])
    cache.run(net, x, 2, [0, 1, 2, 3])
    assert not compared and cache.hits == 2  # the first call starts afresh (a new frozen count)
    with torch.no_grad():
        net[0].bias.copy_(net[0].bias)  # rewritten with its own values: compared, equal, rows kept
    cache.run(net, x, 2, [0, 1, 2, 3])
    assert len(compared) == 1 and cache.hits == 3


def test_rows_are_kept_up_to_the_limit_and_none_without_ids_or_limit() -> None:
    net, x = _net(), torch.randn(6, 6)
    row = 5 * 4  # five float32 outputs of the frozen Linear + ReLU
    cache = FrozenCache(3 * row)
    cache.run(net, x, 2, list(range(6)))
    assert len(cache.rows) == 3 and cache.bytes == 3 * row
    off, unnamed = FrozenCache(0), FrozenCache(2**20)
    assert torch.equal(off.run(net, x, 2, list(range(6))), run_layers(net, x, 2))
    assert torch.equal(unnamed.run(net, x, 2, None), run_layers(net, x, 2))
    assert not off.rows and not unnamed.rows and off.misses == unnamed.misses == 0


def test_freeze_cache_mib_must_be_a_whole_number_of_mib(tmp_path: Path) -> None:
    path = write_config(tmp_path, vws=[["n0:0"]], nm=2, staleness=0, waves=2)
    assert apply_overrides(load_config(path), ["train.freeze_cache_mib=64"]).train.freeze_cache_mib == 64
    with pytest.raises(ConfigError, match="train.freeze_cache_mib: must be >= 0"):
        apply_overrides(load_config(path), ["train.freeze_cache_mib=-1"])


@pytest.mark.parametrize(
    ("settings", "splits"),
    [
        ([], [(2, 2), (1, 2, 1)]),
        (['train.schedule="1f1b-flush"', "train.recompute=true"], [(2, 2), (1, 2, 1)]),
        (
            [
                'model.name="mnist-cnn"',
                "model.options={ batch_norm = true, channels = [4, 8], hidden = 16 }",
                'ps.aggregation="mean"',
                # each VW's own BatchNorm statistics: averaged ones keep moving after the freeze (the VWs'
                # meet at their mean over some waves), and rows made with them are forgotten meanwhile
                'ps.buffers="local"',
                "train.freeze=[[2, 3]]",
            ],
            [(2, 4), (3, 2, 1)],
        ),
        (["train.freeze=[]", "train.autofreeze_every=2"], [(2, 2), (1, 2, 1)]),
    ],
    ids=["mlp", "mlp-recompute", "bn-cnn-mean", "mlp-autofreeze"],
)
def test_runs_with_the_cache_equal_the_reference_and_use_it(
    tmp_path: Path, settings: list[str], splits: list[tuple[int, ...]]
) -> None:
    """2 VWs (one of two stages, one of three) on 800 samples at batch 64: each VW's shard repeats every 6
    minibatches, so from the second epoch of the frozen waves the kept rows serve (the few samples an epoch
    left out run alone); D = 1, so pulls after the
    freeze still bring the frozen layers' last updates and the rows made before are forgotten. The runtime
    and the reference (its own rows) end bit for bit alike, and the stages report the hits; with the freeze
    points the adaptive rule chooses too (docs/wsp.md#adaptive-freezing)."""
    path = write_config(
        tmp_path, vws=[["n0:0", "n0:1"], ["n0:2", "n0:3", "n0:4"]], nm=2, staleness=1, waves=12, batch_size=64
    )
    config = apply_overrides(
        load_config(path),
        [
            "data.options={ classes = [5, 6] }",
            "train.freeze=[[2, 2]]",
            "train.freeze_cache_mib=16",
            *settings,
        ],
    )
    summary, _ = assert_equals_reference(tmp_path, config, splits, order=1)
    cache = summary["frozen_cache"]
    assert cache["hits"] > 0 and cache["misses"] > 0 and 0 < cache["mib"] < 16, cache
