"""[train] freeze as one stage sees it (docs/wsp.md#freezing): how many of its layers a minibatch runs frozen,
whether its backward has work and sends an input gradient, which keys a pull brought, and running the layers
with the frozen ones in eval mode without autograd."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from hetpipe.compute.build import model_of
from hetpipe.compute.optimizer_state import drop_state
from hetpipe.core.config.schema import ClusterConfig
from hetpipe.core.wsp.autofreeze import AutoFreezeState
from hetpipe.core.wsp.freezing import FreezePoint, FreezeSchedule, layer_of

__all__ = ["StageFreezing", "auto_freeze_state", "run_frozen", "run_layers"]


class StageFreezing:
    """The freeze rule for the stage of layers [start, stop) of a VW at `nm` minibatches a wave."""

    def __init__(
        self,
        module: nn.Module,
        freeze: FreezeSchedule,
        nm: int,
        exact_pulls: bool,
        auto: AutoFreezeState | None = None,
    ) -> None:
        names = [name for name, _ in module.named_children()]
        # hetpipe.models.build_stage names each child by its global layer index
        self.start = int(names[0]) if names and names[0].isdigit() else 0
        self.stop = self.start + len(names)
        self.freeze, self.nm, self.exact_pulls = freeze, nm, exact_pulls
        self.auto = auto  # [train] autofreeze: the points decided so far make `freeze`
        self._pulled_before = False  # the first pull since this process registered carries every key
        self._released = 0  # this stage's first layers whose optimizer state is gone

    def observe(self, movement: Sequence[Sequence[Any]]) -> list[tuple[int, FreezePoint]]:
        """[train] autofreeze: take a pull's movement records (hetpipe.core.wsp.movement), in order; a freeze
        point they decide joins `freeze` before the wave it starts at (docs/wsp.md#adaptive-freezing).
        Returns the new points, each with the boundary that decided it."""
        new: list[tuple[int, FreezePoint]] = []
        if self.auto is None:
            return new
        for boundary, rows in movement:
            point = self.auto.observe(boundary, {layer: (q, n) for layer, q, n in rows})
            if point is not None:
                new.append((boundary, point))
                self.freeze = self.auto.schedule
        return new

    def saved(self) -> dict[str, Any] | None:
        """[train] autofreeze's place for a stage snapshot: the boundaries taken and the points decided (a
        resumed stage may run actions of waves whose points came with pulls before the snapshot)."""
        if self.auto is None:
            return None
        return {"decided": list(self.auto.decided), "points": [[p.wave, p.layers] for p in self.auto.points]}

    def restore(self, saved: Mapping[str, Any] | None) -> None:
        """Take back what `saved` gave (None: nothing to take)."""
        if self.auto is None or saved is None:
            return
        self.auto.decided = list(saved["decided"])
        self.auto.points = [FreezePoint(wave, layers) for wave, layers in saved["points"]]
        self.freeze = self.auto.schedule

    def frozen_here(self, p: int) -> int:
        """How many of this stage's first layers minibatch p runs frozen."""
        if not self.freeze.points:
            return 0
        return min(max(self.freeze.frozen(p // self.nm) - self.start, 0), self.stop - self.start)

    def release(self, p: int, optimizer: Any, names: list[str]) -> None:
        """After U p: forget the optimizer state of the layers frozen in p's wave. Updates run in minibatch
        order, so none of an earlier wave, the last that stepped them, comes later."""
        frozen = self.frozen_here(p)
        if frozen > self._released:
            last = self.start + frozen
            drop_state(optimizer, names, {k for k in names if _below(layer_of(k), last)})
            self._released = frozen

    def runs_backward(self, p: int) -> bool:
        """Whether minibatch p's backward has work here (some layer of the stage trains in its wave): a stage
        all frozen receives no output gradient for it."""
        return self.freeze.runs_backward(self.start, self.stop, p // self.nm)

    def sends_input_gradient(self, p: int) -> bool:
        """Whether minibatch p's backward sends its input's gradient to the stage before (that stage trains a
        layer in p's wave); the first stage never does."""
        return self.start > 0 and self.freeze.wants_input_gradient(self.start, p // self.nm)

    def drops_input_gradient(self, p: int) -> bool:
        """Whether freezing spares minibatch p's input its gradient (the stage before is all frozen)."""
        return bool(self.freeze.points) and not self.sends_input_gradient(p)

    def carried(
        self, pulled: Mapping[str, Tensor], version: int | None, params: Mapping[str, Tensor]
    ) -> Mapping[str, Tensor]:
        """The keys of `pulled` (every key's slot) that a pull of W_version brought: an exact pull leaves out
        the parameters frozen before it, but the first since the stage registered."""
        first, self._pulled_before = not self._pulled_before, True
        if not self.freeze.points or not self.exact_pulls or version is None or first:
            return pulled
        return {k: pulled[k] for k in self.freeze.pulled(pulled, params.__contains__, version)}


def auto_freeze_state(config: ClusterConfig) -> AutoFreezeState | None:
    """A fresh state of [train] autofreeze for a stage or the reference (None: off)."""
    rule = config.train.autofreeze
    if rule is None:
        return None
    return AutoFreezeState(rule, model_of(config).num_layers, config.wsp.staleness, config.train.waves)


def _below(layer: int | None, last: int) -> bool:
    return layer is not None and layer < last


def run_layers(module: nn.Module, inputs: Tensor, frozen: int) -> Tensor:
    """`module` (an nn.Sequential) on `inputs`, its first `frozen` children in eval mode without autograd, so
    their weights get no gradient and their buffers stay as they are."""
    if not frozen:
        return module(inputs)
    layers = list(module.children())
    x = run_frozen(layers[:frozen], inputs)
    for layer in layers[frozen:]:
        x = layer(x)
    return x


def run_frozen(layers: Sequence[nn.Module], inputs: Tensor) -> Tensor:
    """`layers` in turn on `inputs`, each in eval mode without autograd."""
    x = inputs
    with torch.no_grad():
        for layer in layers:
            mode = layer.training
            layer.train(False)
            try:
                x = layer(x)
            finally:
                layer.train(mode)
    return x
