"""The adaptive freezing rule (issue 39, docs/wsp.md#adaptive-freezing), after PipeTransformer's AutoFreeze:
at every `interval`-th global version the layers' movement decides how many of the model's first layers
freeze, D + 1 waves later. Pure.

The movement of layer l over the interval (b - K, b] is sqrt(Q_b[l] / N_b[l]): Q_b[l] the sum over the
interval's waves t of ||W_{t+1}[l] - W_t[l]||^2 (the global wave update, the PS's view of the layer's summed
gradient), N_b[l] = ||W_b[l]||^2, both over the layer's parameters (buffers and ledgers are not movement). The
shards add up their own keys' parts (hetpipe.core.wsp.movement); whoever decides adds the shards' parts in
shard order, so every stage of every VW decides alike.

The rule (PipeTransformer, Eq. 1, with its argmin taken over the relative movement, so that a small layer and
a large one compare): with n frozen before the boundary, the layers l >= n that have parameters, the last
layer excepted, are the candidates; m is the one that moved least. Then
    n' = max(n, min(m + 1, n + floor(rate * (L - n)), floor(ceiling * L), L - 1))
and n' > n is the freeze point (b + D + 1, n'): the gate of wave b + D + 1 pulls W_b, so every stage knows
W_b's movement before that wave starts, whatever its VW's lead. A point at or past the run's last wave is
none.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from hetpipe.core.wsp.freezing import FreezePoint, FreezeSchedule

__all__ = ["AutoFreeze", "AutoFreezeState", "LayerMovement"]

LayerMovement = Mapping[int, tuple[float, float]]  # layer -> (Q: summed squared updates, N: squared norm)


@dataclass(frozen=True)
class AutoFreeze:
    """[train] autofreeze: decide every `interval` waves; at most `rate` of the trainable layers and
    `ceiling` of all layers frozen."""

    interval: int
    rate: float = 0.5
    ceiling: float = 0.75

    def boundary(self, version: int) -> bool:
        """Whether W_version closes an interval (a decision is taken on it)."""
        return version > 0 and version % self.interval == 0

    def frozen_after(self, frozen: int, num_layers: int, movement: LayerMovement) -> int:
        """The frozen prefix after a boundary with `frozen` layers frozen before it and `movement` the
        interval's (Q, N) by layer (layers without parameters absent)."""
        candidates = [(_relative(*movement[layer]), layer) for layer in sorted(movement)]
        candidates = [(m, layer) for m, layer in candidates if frozen <= layer < num_layers - 1]
        if not candidates:
            return frozen
        least = min(candidates)[1]  # the least moved (the first of equals)
        cap = min(
            frozen + math.floor(self.rate * (num_layers - frozen)),
            math.floor(self.ceiling * num_layers),
            num_layers - 1,
        )
        return max(frozen, min(least + 1, cap))


def _relative(q: float, n: float) -> float:
    """A layer's movement relative to its size; a layer of all zeros moved infinitely (it is no candidate
    but last)."""
    return math.sqrt(q / n) if n > 0 else math.inf


@dataclass
class AutoFreezeState:
    """The freeze points decided so far, from each boundary's movement in turn: a small state machine every
    stage and the reference run alike."""

    rule: AutoFreeze
    num_layers: int
    staleness: int  # D
    num_waves: int
    decided: list[int] = field(default_factory=list)  # the boundaries seen, in order
    points: list[FreezePoint] = field(default_factory=list)

    @property
    def schedule(self) -> FreezeSchedule:
        return FreezeSchedule(tuple(self.points))

    @property
    def frozen(self) -> int:
        return self.points[-1].layers if self.points else 0

    def observe(self, boundary: int, movement: LayerMovement) -> FreezePoint | None:
        """Take W_boundary's movement; returns the freeze point it adds (None: none). A boundary seen before
        (a retried or repeated pull) changes nothing; boundaries must come in order."""
        if boundary in self.decided:
            return None
        if not self.rule.boundary(boundary) or (self.decided and boundary < self.decided[-1]):
            raise ValueError(
                f"movement of W_{boundary} after W_{self.decided[-1] if self.decided else 0}: boundaries are "
                f"every {self.rule.interval} versions, in order"
            )
        self.decided.append(boundary)
        wave = boundary + self.staleness + 1
        layers = self.rule.frozen_after(self.frozen, self.num_layers, movement)
        if layers <= self.frozen or wave >= self.num_waves:
            return None
        point = FreezePoint(wave, layers)
        self.points.append(point)
        return point
