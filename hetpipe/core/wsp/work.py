"""Each virtual worker's work per wave (Nm_v minibatches of b_v samples) and the weights by samples that the
PS folds `mean`, `server` and buffers with (docs/wsp.md#per-vw-work). Pure."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["VwWork", "sample_weights"]


@dataclass(frozen=True)
class VwWork:
    """One VW's wave: `nm` minibatches of `batch` samples each."""

    nm: int
    batch: int

    @property
    def samples(self) -> int:
        """Samples behind one wave's update."""
        return self.nm * self.batch


def sample_weights(work: Sequence[VwWork]) -> tuple[int, ...]:
    """Each VW's weight in a sample-weighted fold: its samples per wave over the greatest common divisor of
    every VW's, so that VWs doing equal work weigh 1 each (and the fold is the plain mean over VWs)."""
    if not work:
        return ()
    unit = math.gcd(*(w.samples for w in work))
    return tuple(w.samples // unit for w in work)
