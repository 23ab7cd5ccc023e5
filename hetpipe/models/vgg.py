"""VGG-11/19 as a layer list: one layer per conv group (ending in max-pool), adaptive pool, classifier."""

from __future__ import annotations

from functools import partial

import torch
from torch import nn

from hetpipe.core.errors import UsageError
from hetpipe.models.spec import ModelSpec

__all__ = ["vgg", "VGG_DEPTHS"]

# depth -> conv widths per group; every group ends in a 2x2 max-pool (Simonyan & Zisserman, table 1).
VGG_DEPTHS = {
    11: ((64,), (128,), (256, 256), (512, 512), (512, 512)),
    19: ((64, 64), (128, 128), (256,) * 4, (512,) * 4, (512,) * 4),
}


def _conv_group(c_in: int, widths: tuple[int, ...], batch_norm: bool) -> nn.Module:
    layers: list[nn.Module] = []
    for width in widths:
        layers.append(nn.Conv2d(c_in, width, 3, padding=1))
        if batch_norm:
            layers.append(nn.BatchNorm2d(width))
        layers.append(nn.ReLU(inplace=True))
        c_in = width
    layers.append(nn.MaxPool2d(2))
    group = nn.Sequential(*layers)
    for sub in group.modules():
        if isinstance(sub, nn.Conv2d):
            nn.init.kaiming_normal_(sub.weight, mode="fan_out", nonlinearity="relu")
            nn.init.zeros_(sub.bias)
    return group


def _pool(size: int) -> nn.Module:
    return nn.Sequential(nn.AdaptiveAvgPool2d(size), nn.Flatten())


def _fc(fan_in: int, fan_out: int) -> nn.Module:
    return nn.Sequential(nn.Linear(fan_in, fan_out), nn.ReLU(inplace=True))


def vgg(depth: int, *, seed: int = 0, num_classes: int = 1000, in_channels: int = 3, image_size: int = 224,
        batch_norm: bool = True, pool_size: int | None = None, fc_hidden: int | None = None) -> ModelSpec:
    """VGG; for image_size < 100 the classifier defaults to a 1x1 pool and 512-wide fc layers (CIFAR-style)."""
    if depth not in VGG_DEPTHS:
        raise UsageError(f"no VGG-{depth}; known depths: {', '.join(map(str, VGG_DEPTHS))}")
    if image_size < 32:
        raise UsageError(f"VGG halves the image 5 times, so image_size must be >= 32 (got {image_size})")
    small = image_size < 100
    pool_size = (1 if small else 7) if pool_size is None else pool_size
    fc_hidden = (512 if small else 4096) if fc_hidden is None else fc_hidden
    names, factories, c_in = [], [], in_channels
    for g, widths in enumerate(VGG_DEPTHS[depth]):
        names.append(f"conv{g + 1}")
        factories.append(partial(_conv_group, c_in, widths, batch_norm))
        c_in = widths[-1]
    names += ["pool", "fc6", "fc7", "head"]
    factories += [partial(_pool, pool_size), partial(_fc, c_in * pool_size * pool_size, fc_hidden),
                  partial(_fc, fc_hidden, fc_hidden), partial(nn.Linear, fc_hidden, num_classes)]
    return ModelSpec(f"vgg{depth}", tuple(names), tuple(factories), (in_channels, image_size, image_size),
                     torch.float32, "classification", num_classes, seed)
