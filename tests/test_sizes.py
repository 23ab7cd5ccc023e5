"""Tests for hetpipe/compute/sizes.py: the sizes the memory check uses are the profiler's, without timing."""

from __future__ import annotations

import pytest
import torch

from hetpipe.compute.profiler import profile_model
from hetpipe.compute.sizes import model_sizes
from hetpipe.core.errors import UsageError
from hetpipe.models import get_model

SIZE_FIELDS = ("param_bytes", "optimizer_bytes", "output_bytes", "saved_bytes", "working_bytes")


@pytest.mark.parametrize(
    ("name", "options", "batch", "optimizer"),
    [
        ("mlp", {"hidden": [32, 16]}, 5, "adam"),
        ("mnist-cnn", {}, 3, "momentum"),
        ("char-gpt", {"n_layer": 1, "n_embd": 16, "n_head": 2, "block_size": 8}, 4, "sgd"),
        ("resnet18", {"image_size": 32, "num_classes": 10}, 3, "momentum"),
    ],
)
def test_sizes_equal_the_profilers_at_that_batch(
    name: str, options: dict, batch: int, optimizer: str
) -> None:
    torch.set_num_threads(1)
    spec = get_model(name, **options)
    sizes = model_sizes(spec, batch, optimizer)
    measured = profile_model(spec, batch, optimizer=optimizer, repeats=1)
    assert sizes.input_bytes == measured.input_bytes and sizes.batch_size == batch
    assert [layer.name for layer in sizes.layers] == [layer.name for layer in measured.layers]
    for mine, theirs in zip(sizes.layers, measured.layers, strict=True):
        assert {f: getattr(mine, f) for f in SIZE_FIELDS} == {f: getattr(theirs, f) for f in SIZE_FIELDS}, (
            mine.name
        )
        assert mine.forward_s == mine.backward_s == 0.0


def test_sizes_leave_the_callers_rng_and_threads_alone() -> None:
    torch.set_num_threads(2)
    torch.manual_seed(5)
    expected = torch.rand(3)
    torch.manual_seed(5)
    model_sizes(get_model("mlp", hidden=[8]), 4, "sgd")
    assert torch.equal(torch.rand(3), expected)
    assert torch.get_num_threads() == 2
    torch.set_num_threads(1)


def test_sizes_refuse_bad_arguments() -> None:
    spec = get_model("mlp", hidden=[8])
    with pytest.raises(UsageError, match="batch_size must be an integer >= 1"):
        model_sizes(spec, 0, "sgd")
    with pytest.raises(UsageError, match='unknown optimizer "adamw"'):
        model_sizes(spec, 2, "adamw")
