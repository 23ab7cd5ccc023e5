"""Keys in a fixed order, each a slice of one flat float32 buffer: the layout of a stage's push and pull
buffers.

Torch-free, so the PS agent process (worker/agent_process.py) cuts the same buffers the same way without
importing torch: `views` cuts a torch tensor, `array_views` a numpy array.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from torch import Tensor

__all__ = ["FlatLayout"]


@dataclass(frozen=True)
class FlatLayout:
    """Keys in a fixed order, each a slice of one flat float32 buffer."""

    keys: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]

    @classmethod
    def of(cls, tensors: Mapping[str, Any]) -> FlatLayout:
        return cls(tuple(tensors), tuple(tuple(t.shape) for t in tensors.values()))

    @functools.cached_property
    def sizes(self) -> tuple[int, ...]:
        return tuple(int(np.prod(shape)) for shape in self.shapes)

    @property
    def numel(self) -> int:
        return sum(self.sizes)

    def views(self, flat: Tensor) -> dict[str, Tensor]:
        """Each key's slice of `flat`, shaped (one split, then a view per key that is not flat already)."""
        parts = flat.split_with_sizes(self.sizes)
        return {
            key: part if len(shape) == 1 else part.view(shape)
            for key, shape, part in zip(self.keys, self.shapes, parts, strict=True)
        }

    def array_views(self, flat: np.ndarray) -> dict[str, np.ndarray]:
        """Each key's slice of a flat numpy array, shaped (views of it, as `views` gives for a tensor)."""
        ends = np.cumsum(self.sizes)
        return {
            key: flat[end - size : end].reshape(shape)
            for key, shape, size, end in zip(self.keys, self.shapes, self.sizes, ends.tolist(), strict=True)
        }
