"""A fixed freezing schedule (issue 39, docs/wsp.md#freezing): which layers are frozen in each wave, and what
that means for a stage's forward, step, backward, push and pull and for the PS's fold. Pure.

From wave f of a freeze point (f, n) on, the model's first n layers are frozen: a minibatch of wave >= f runs
them without autograd and steps none of their weights, and the pushes of waves >= f leave their keys out, so
the PS folds nothing into them after W_f. A stage still pulls a frozen layer's keys through the version W_f
(the gate of wave f + D + 1 pulls it; own updates of waves >= f are none, so the rebase gives W_f exactly)
and never after, but in a stage's first pull since it registered, which carries every key: from wave
f + D + 1 on every VW computes with the same frozen values, the PS's. Only parameters are left out; buffers
and ledgers always travel. A stage whose layers are all frozen in a wave runs no backward for its minibatches,
and the next stage sends it no input gradient: both ends know it from the schedule, so no message says so.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

__all__ = ["FreezePoint", "FreezeSchedule", "layer_of"]


def layer_of(key: str) -> int | None:
    """The model layer a synced key belongs to: its name's first part ("3.weight", "7.attn.qkv.bias"; the
    stages name their tensors by global layer index); None for a key of no layer (an audit ledger)."""
    head = key.split(".", 1)[0]
    return int(head) if head.isdigit() else None


@dataclass(frozen=True)
class FreezePoint:
    """From wave `wave` on, the model's first `layers` layers are frozen."""

    wave: int
    layers: int


@dataclass(frozen=True)
class FreezeSchedule:
    """Freeze points in order: waves and frozen prefixes both strictly increasing (a layer never thaws)."""

    points: tuple[FreezePoint, ...] = ()

    @classmethod
    def at(cls, pairs: Sequence[tuple[int, int]]) -> FreezeSchedule:
        """The schedule of pairs validated before ([train] freeze as the config holds it)."""
        return cls(tuple(FreezePoint(wave, layers) for wave, layers in pairs))

    @classmethod
    def of(
        cls, pairs: Sequence[Sequence[int]], num_layers: int | None, waves: int, where: str
    ) -> FreezeSchedule:
        """Validated [[wave, layers], ...]; `where` names the field for the errors (e.g. the config file's
        `train.freeze`). At least one layer stays trainable (`num_layers` None: the model is not known yet,
        so only that some layer freezes), and every point lies inside the run."""
        points: list[FreezePoint] = []
        for i, pair in enumerate(pairs):
            if len(pair) != 2 or not all(isinstance(v, int) and not isinstance(v, bool) for v in pair):
                raise ValueError(f"{where}[{i}] = {list(pair)!r}: write [wave, layers], two integers")
            wave, layers = pair
            if not 1 <= wave < waves:
                raise ValueError(
                    f"{where}[{i}]: wave {wave} is outside the run's waves 1 ... {waves - 1}; freeze from a "
                    "wave after the first and before the last"
                )
            if num_layers is None and layers < 1:
                raise ValueError(f"{where}[{i}]: {layers} layers frozen: freeze at least 1")
            if num_layers is not None and not 1 <= layers < num_layers:
                raise ValueError(
                    f"{where}[{i}]: {layers} layers frozen, but the model has {num_layers}: freeze 1 ... "
                    f"{num_layers - 1} (at least one layer stays trainable)"
                )
            if points and (wave <= points[-1].wave or layers <= points[-1].layers):
                raise ValueError(
                    f"{where}[{i}] = [{wave}, {layers}] after [{points[-1].wave}, {points[-1].layers}]: list "
                    "the points by wave, each freezing more layers than the one before (a layer never thaws)"
                )
            points.append(FreezePoint(wave, layers))
        return cls(tuple(points))

    def frozen(self, wave: int) -> int:
        """How many of the model's first layers are frozen in wave `wave` (0: none)."""
        return max((p.layers for p in self.points if p.wave <= wave), default=0)

    def frozen_from(self, layer: int) -> int | None:
        """The wave `layer` is frozen from, or None when it never is."""
        return next((p.wave for p in self.points if layer < p.layers), None)

    def trains(self, layer: int, wave: int) -> bool:
        """Whether the minibatches of wave `wave` run `layer` with autograd and step its weights."""
        return layer >= self.frozen(wave)

    def pushes(self, layer: int, wave: int) -> bool:
        """Whether the push of wave `wave` carries `layer`'s keys (the PS folds them into W_{wave+1})."""
        return self.trains(layer, wave)

    def pulls(self, layer: int, version: int) -> bool:
        """Whether a pull of W_version carries `layer`'s keys: through W_f, its last folded version."""
        f = self.frozen_from(layer)
        return f is None or version <= f

    def key_pushed(self, key: str, wave: int) -> bool:
        """Whether the push of `wave` carries parameter `key` (a key of no layer always travels)."""
        layer = layer_of(key)
        return layer is None or self.pushes(layer, wave)

    def key_pulled(self, key: str, version: int) -> bool:
        """Whether a pull of W_version carries parameter `key` (a puller's first pull since it registered
        carries every key: the caller's part, as a joining VW has no W_f yet)."""
        layer = layer_of(key)
        return layer is None or self.pulls(layer, version)

    def pushed(self, keys: Iterable[str], is_param: Callable[[str], bool], wave: int) -> list[str]:
        """The keys of `keys` a push of `wave` carries: all but the parameters (`is_param`) frozen by then."""
        return [k for k in keys if not self.points or not is_param(k) or self.key_pushed(k, wave)]

    def pulled(self, keys: Iterable[str], is_param: Callable[[str], bool], version: int) -> list[str]:
        """The keys of `keys` a (not first) pull of W_version carries: all but the parameters frozen before
        it."""
        return [k for k in keys if not self.points or not is_param(k) or self.key_pulled(k, version)]

    def runs_backward(self, start: int, stop: int, wave: int) -> bool:
        """Whether the stage of layers start ... stop - 1 runs the backward of wave `wave`'s minibatches (some
        layer of it trains)."""
        return stop > self.frozen(wave)

    def wants_input_gradient(self, start: int, wave: int) -> bool:
        """Whether the stage whose first layer is `start` sends its input's gradient back to the stage before
        it for wave `wave`'s minibatches (that stage trains a layer); the first stage never does."""
        return start > 0 and self.frozen(wave) < start
