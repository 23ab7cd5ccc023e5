"""hetpipe.compute.flops: a training step's FLOPs, checked against the count from the layers' shapes."""

from __future__ import annotations

import pytest

from hetpipe.compute.flops import training_flops
from hetpipe.models import get_model


@pytest.mark.parametrize("batch", [1, 64])
def test_mlp_step_flops_follow_from_its_matmuls(batch: int) -> None:
    """A linear layer of fan_in x fan_out on B samples: 2 B fan_in fan_out FLOPs forward, as many for the
    weight gradient, and as many again for the input gradient - except in the first layer, whose input needs
    none."""
    spec = get_model("mlp", image_size=8, hidden=(32, 16))
    shapes = [(64, 32), (32, 16), (16, 10)]
    per_layer = [2 * batch * a * b for a, b in shapes]
    assert training_flops(spec, batch) == 3 * sum(per_layer) - per_layer[0]


def test_convolution_flops_are_counted() -> None:
    """vgg-fc's first conv: 3x3 over 1 channel into 32 at 28x28: 2 x 9 x 32 x 784 FLOPs per sample forward;
    its weight gradient costs as much (no input gradient: it is the model's input). The head (6272 -> 10)
    counts three times, its input gradient included."""
    one_conv = get_model("vgg-fc", channels=((32,),), fc=())
    head = 2 * 2 * (32 * 14 * 14) * 10
    assert training_flops(one_conv, 2) == 2 * (2 * 2 * 9 * 32 * 784) + 3 * head
