"""VGG-11/19 as a layer list (one layer per conv group, ending in max-pool; adaptive pool; classifier), and
vgg-fc: a small VGG-like net whose large fully connected layers hold most of its parameters."""

from __future__ import annotations

from functools import partial

import torch
from torch import nn

from hetpipe.core.errors import UsageError
from hetpipe.models.spec import ModelSpec

__all__ = ["vgg", "vgg_fc", "VGG_DEPTHS"]

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


def vgg(
    depth: int,
    *,
    seed: int = 0,
    num_classes: int = 1000,
    in_channels: int = 3,
    image_size: int = 224,
    batch_norm: bool = True,
    pool_size: int | None = None,
    fc_hidden: int | None = None,
) -> ModelSpec:
    """VGG; for image_size < 100 the classifier defaults to a 1x1 pool and 512-wide fc layers
    (CIFAR-style)."""
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
    factories += [
        partial(_pool, pool_size),
        partial(_fc, c_in * pool_size * pool_size, fc_hidden),
        partial(_fc, fc_hidden, fc_hidden),
        partial(nn.Linear, fc_hidden, num_classes),
    ]
    return ModelSpec(
        f"vgg{depth}",
        tuple(names),
        tuple(factories),
        (in_channels, image_size, image_size),
        torch.float32,
        "classification",
        num_classes,
        seed,
    )


def _flatten_fc(fan_in: int, fan_out: int, flatten: bool) -> nn.Module:
    linear = nn.Linear(fan_in, fan_out)
    nn.init.kaiming_normal_(linear.weight, nonlinearity="relu")  # He init, as the MLP: deep ReLU stacks train
    nn.init.zeros_(linear.bias)
    return nn.Sequential(*((nn.Flatten(),) if flatten else ()), linear, nn.ReLU(inplace=True))


def _head(fan_in: int, num_classes: int, flatten: bool) -> nn.Module:
    linear = nn.Linear(fan_in, num_classes)
    return nn.Sequential(nn.Flatten(), linear) if flatten else linear


def vgg_fc(
    *,
    seed: int = 0,
    in_channels: int = 1,
    image_size: int = 28,
    channels: tuple[tuple[int, ...], ...] = ((32,), (64, 64), (128,)),
    fc: tuple[int, ...] = (512, 512),
    num_classes: int = 10,
    batch_norm: bool = False,
) -> ModelSpec:
    """A VGG-like net sized for CPU emulation and communication-heavy like VGG-19 (docs/testbed.md).

    Conv groups of 3x3 convs (each group one layer, ending in a 2x2 max-pool), then fully connected layers
    (the first flattens) and a head. With the defaults on MNIST (1x28x28): 128x3x3 = 1152 features into fc
    layers of 512, 0.99 M parameters of which 87% in the fc layers (VGG-19: 86%), and at batch 64 a step of
    5.9 GFLOP: about 2x VGG-19's parameters per FLOP at batch 32, so data parallelism pays for its all-reduce
    as in the HetPipe paper's regime, while a stage boundary in the fc part carries 64 x 512 floats.
    """
    if not channels or not all(channels):
        raise UsageError(
            "vgg-fc needs at least one conv group, each of at least one conv: e.g. channels = [[32], [64]]"
        )
    side = image_size // 2 ** len(channels)
    if side < 1:
        raise UsageError(
            f"vgg-fc halves the image once per conv group: {len(channels)} groups need image_size >= "
            f"{2 ** len(channels)} (got {image_size})"
        )
    names, factories, c_in = [], [], in_channels
    for g, widths in enumerate(channels):
        names.append(f"conv{g + 1}")
        factories.append(partial(_conv_group, c_in, tuple(widths), batch_norm))
        c_in = widths[-1]
    fan_in = c_in * side * side
    for i, width in enumerate(fc):
        names.append(f"fc{i + 1}")
        factories.append(partial(_flatten_fc, fan_in, width, i == 0))
        fan_in = width
    names.append("head")
    factories.append(partial(_head, fan_in, num_classes, not fc))
    return ModelSpec(
        "vgg-fc",
        tuple(names),
        tuple(factories),
        (in_channels, image_size, image_size),
        torch.float32,
        "classification",
        num_classes,
        seed,
    )
