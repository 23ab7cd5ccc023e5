"""The MNIST CNN as a layer list: conv, ReLU+pool, conv, ReLU+pool, flatten+fc, head."""

from __future__ import annotations

from functools import partial

import torch
from torch import nn

from hetpipe.core.errors import UsageError
from hetpipe.models.spec import ModelSpec

__all__ = ["mnist_cnn"]


def _relu_pool() -> nn.Module:
    return nn.Sequential(nn.ReLU(), nn.MaxPool2d(2))


def _conv(c_in: int, c_out: int, batch_norm: bool) -> nn.Module:
    conv = nn.Conv2d(c_in, c_out, 3, padding=1)
    return nn.Sequential(conv, nn.BatchNorm2d(c_out)) if batch_norm else conv


def _flatten_fc(fan_in: int, hidden: int) -> nn.Module:
    return nn.Sequential(nn.Flatten(), nn.Linear(fan_in, hidden), nn.ReLU())


def mnist_cnn(
    *,
    seed: int = 0,
    in_channels: int = 1,
    image_size: int = 28,
    channels: tuple[int, int] = (32, 64),
    hidden: int = 128,
    num_classes: int = 10,
    batch_norm: bool = False,
) -> ModelSpec:
    """Two 3x3 conv layers (each followed by ReLU and 2x2 max-pool; with `batch_norm`, by BatchNorm
    first), a hidden fc layer and a head."""
    if image_size < 4:
        raise UsageError(f"mnist-cnn pools twice by 2, so image_size must be >= 4 (got {image_size})")
    c1, c2 = channels
    side = image_size // 4
    names = ("conv1", "pool1", "conv2", "pool2", "fc", "head")
    factories = (
        partial(_conv, in_channels, c1, batch_norm),
        _relu_pool,
        partial(_conv, c1, c2, batch_norm),
        _relu_pool,
        partial(_flatten_fc, c2 * side * side, hidden),
        partial(nn.Linear, hidden, num_classes),
    )
    return ModelSpec(
        "mnist-cnn",
        names,
        factories,
        (in_channels, image_size, image_size),
        torch.float32,
        "classification",
        num_classes,
        seed,
    )
