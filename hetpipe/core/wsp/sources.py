"""What a push or registration carries for a key (a numpy array, or a view over received frames) and the
three things the shard does with one: add it into an array, copy it out, or take it as an array."""

from __future__ import annotations

from typing import Protocol

import numpy as np

__all__ = ["Source", "TensorSource", "add_into", "as_array", "copy_of"]


class TensorSource(Protocol):
    """What a push or registration may carry besides a plain array (hetpipe.core.protocol.wire.TensorView
    fits)."""

    dtype: np.dtype
    shape: tuple[int, ...]

    def copy_into(self, dst: np.ndarray) -> None: ...

    def add_into(self, dst: np.ndarray) -> None: ...

    def added_to(self, base: np.ndarray) -> np.ndarray: ...


Source = np.ndarray | TensorSource


def add_into(dst: np.ndarray, src: Source) -> None:
    """dst += src, in place, straight from the frames when src is not an array."""
    if isinstance(src, np.ndarray):
        np.add(dst, src, out=dst)
    else:
        src.add_into(dst)


def as_array(src: Source) -> np.ndarray:
    """src itself when it is an array, else a float32 copy of it."""
    return src if isinstance(src, np.ndarray) else copy_of(src)


def copy_of(src: Source) -> np.ndarray:
    """A fresh float32 array holding src's values."""
    out = np.empty(tuple(src.shape), dtype=np.float32)
    if isinstance(src, np.ndarray):
        np.copyto(out, src)
    else:
        src.copy_into(out)
    return out
