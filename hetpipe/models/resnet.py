"""ResNet-18/50/152 as a layer list: stem, one layer per residual block, pool + fc head."""

from __future__ import annotations

from functools import partial

import torch
from torch import Tensor, nn

from hetpipe.core.errors import UsageError
from hetpipe.models.spec import ModelSpec

__all__ = ["resnet", "BasicBlock", "Bottleneck", "RESNET_DEPTHS"]

# depth -> (block kind, blocks per group); He et al. 2016, table 1.
RESNET_DEPTHS = {
    18: ("basic", (2, 2, 2, 2)),
    50: ("bottleneck", (3, 4, 6, 3)),
    152: ("bottleneck", (3, 8, 36, 3)),
}
_WIDTHS = (64, 128, 256, 512)


def _init(module: nn.Module) -> None:
    for sub in module.modules():
        if isinstance(sub, nn.Conv2d):
            nn.init.kaiming_normal_(sub.weight, mode="fan_out", nonlinearity="relu")
        elif isinstance(sub, nn.BatchNorm2d):
            nn.init.ones_(sub.weight)
            nn.init.zeros_(sub.bias)


def _conv_bn(c_in: int, c_out: int, kernel: int, stride: int = 1) -> list[nn.Module]:
    return [nn.Conv2d(c_in, c_out, kernel, stride, padding=kernel // 2, bias=False), nn.BatchNorm2d(c_out)]


def _shortcut(c_in: int, c_out: int, stride: int) -> nn.Module:
    if stride == 1 and c_in == c_out:
        return nn.Identity()
    return nn.Sequential(*_conv_bn(c_in, c_out, 1, stride))


class BasicBlock(nn.Module):
    """Two 3x3 convolutions with a residual connection (ResNet-18/34)."""

    expansion = 1

    def __init__(self, c_in: int, width: int, stride: int) -> None:
        super().__init__()
        self.body = nn.Sequential(
            *_conv_bn(c_in, width, 3, stride), nn.ReLU(inplace=True), *_conv_bn(width, width, 3)
        )
        self.shortcut = _shortcut(c_in, width, stride)
        _init(self)

    def forward(self, x: Tensor) -> Tensor:
        return torch.relu(self.body(x) + self.shortcut(x))


class Bottleneck(nn.Module):
    """1x1 reduce, 3x3 (strided), 1x1 expand x4, with a residual connection (ResNet-50+)."""

    expansion = 4

    def __init__(self, c_in: int, width: int, stride: int) -> None:
        super().__init__()
        c_out = width * self.expansion
        self.body = nn.Sequential(
            *_conv_bn(c_in, width, 1),
            nn.ReLU(inplace=True),
            *_conv_bn(width, width, 3, stride),
            nn.ReLU(inplace=True),
            *_conv_bn(width, c_out, 1),
        )
        self.shortcut = _shortcut(c_in, c_out, stride)
        _init(self)

    def forward(self, x: Tensor) -> Tensor:
        return torch.relu(self.body(x) + self.shortcut(x))


def _stem(in_channels: int, small: bool, width: int = 64) -> nn.Module:
    if small:  # CIFAR-style: keep resolution for 28x28 / 32x32 inputs
        stem = nn.Sequential(*_conv_bn(in_channels, width, 3), nn.ReLU(inplace=True))
    else:  # ImageNet-style: 7x7 stride 2, then 3x3 max-pool stride 2
        stem = nn.Sequential(
            *_conv_bn(in_channels, width, 7, 2), nn.ReLU(inplace=True), nn.MaxPool2d(3, 2, padding=1)
        )
    _init(stem)
    return stem


def _head(features: int, num_classes: int) -> nn.Module:
    return nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(features, num_classes))


def resnet(
    depth: int,
    *,
    seed: int = 0,
    num_classes: int = 1000,
    in_channels: int = 3,
    image_size: int = 224,
    small_stem: bool | None = None,
    width: int = 64,
) -> ModelSpec:
    """ResNet of the given depth; small_stem (default: image_size < 100) drops the stem's downsampling;
    `width`: the stem's and first group's channels (64 in the paper; the groups double it), e.g. 8 for a small
    model."""
    if isinstance(width, bool) or not isinstance(width, int) or width < 1:
        raise UsageError(f"resnet option width must be an integer >= 1 (64 in the paper), got {width!r}")
    if depth not in RESNET_DEPTHS:
        raise UsageError(f"no ResNet-{depth}; known depths: {', '.join(map(str, RESNET_DEPTHS))}")
    kind, counts = RESNET_DEPTHS[depth]
    block = BasicBlock if kind == "basic" else Bottleneck
    small = image_size < 100 if small_stem is None else small_stem
    names, factories, c_in = ["stem"], [partial(_stem, in_channels, small, width)], width
    for g, (group_width, count) in enumerate(zip(_WIDTHS, counts, strict=True)):
        for b in range(count):
            stride = 2 if g > 0 and b == 0 else 1
            names.append(f"layer{g + 1}.{b}")
            factories.append(partial(block, c_in, group_width * width // 64, stride))
            c_in = group_width * width // 64 * block.expansion
    names.append("head")
    factories.append(partial(_head, c_in, num_classes))
    return ModelSpec(
        f"resnet{depth}",
        tuple(names),
        tuple(factories),
        (in_channels, image_size, image_size),
        torch.float32,
        "classification",
        num_classes,
        seed,
    )
