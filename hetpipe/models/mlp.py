"""Multi-layer perceptron as a layer list: flatten, linear+ReLU blocks, linear head."""

from __future__ import annotations

import math
from functools import partial

import torch
from torch import nn

from hetpipe.models.spec import ModelSpec

__all__ = ["mlp"]


def _block(fan_in: int, fan_out: int) -> nn.Module:
    linear = nn.Linear(fan_in, fan_out)
    nn.init.kaiming_normal_(linear.weight, nonlinearity="relu")  # He init: deep ReLU stacks keep their scale
    nn.init.zeros_(linear.bias)
    return nn.Sequential(linear, nn.ReLU())


def mlp(
    *,
    seed: int = 0,
    in_channels: int = 1,
    image_size: int = 28,
    hidden: int | tuple[int, ...] = (256, 256),
    num_classes: int = 10,
) -> ModelSpec:
    """MLP over (in_channels, image_size, image_size) inputs; one layer per hidden width."""
    widths = (hidden,) if isinstance(hidden, int) else tuple(hidden)
    input_shape = (in_channels, image_size, image_size)
    sizes = (math.prod(input_shape), *widths)
    names = ("flatten", *(f"fc{i + 1}" for i in range(len(widths))), "head")
    factories = (
        nn.Flatten,
        *(partial(_block, a, b) for a, b in zip(sizes, sizes[1:], strict=False)),
        partial(nn.Linear, sizes[-1], num_classes),
    )
    return ModelSpec("mlp", names, factories, input_shape, torch.float32, "classification", num_classes, seed)
