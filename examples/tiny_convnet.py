"""A model of your own for hetpipe: a small ConvNet for 28x28 digits, written as a list of layers.

Train it with `hetpipe train examples/tiny_convnet.toml` (from the repository root) and get the trained
module back with `hetpipe export runs/tiny-convnet/latest` or `hetpipe.app.export.load_model(RUN_DIR)`.

The contract (README "Your own model"): the function returns a list of nn.Modules (or an nn.Sequential),
each taking one tensor and returning one, the last one returning logits; hetpipe may cut the pipeline
between any two of them, so each entry is a unit a stage holds whole. Its keyword arguments come from
[model] options in the config, except input_shape / input_dtype / task / num_classes, which tell hetpipe
what the model eats and predicts. Initial weights come from torch's default generator, which hetpipe seeds
the same way in every process.
"""

from __future__ import annotations

from torch import nn

__all__ = ["build"]


def block(c_in: int, c_out: int) -> nn.Sequential:
    """Conv 3x3, BatchNorm, ReLU, then halve the image: one pipeline unit."""
    return nn.Sequential(
        nn.Conv2d(c_in, c_out, 3, padding=1, bias=False), nn.BatchNorm2d(c_out), nn.ReLU(), nn.MaxPool2d(2)
    )


def build(width: int = 8, hidden: int = 64, num_classes: int = 10) -> list[nn.Module]:
    """Two conv blocks (28 -> 14 -> 7), then a two-layer classifier: five layers for hetpipe to split."""
    return [
        block(1, width),
        block(width, 2 * width),
        nn.Flatten(),
        nn.Sequential(nn.Linear(2 * width * 7 * 7, hidden), nn.ReLU()),
        nn.Linear(hidden, num_classes),
    ]
