"""The weights a stage's forwards and recomputed backwards run on (docs/schedules.md): stashed copies of
weight versions and their reuse, spectrain's predicted copies, PipeMare's corrected weights. No I/O."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from hetpipe.compute.optim import LocalOptimizer, predicted_step
from hetpipe.core.pipeline.mitigation import Lag, dc_gamma

if TYPE_CHECKING:
    from hetpipe.compute.stage_compute import StageRules

__all__ = ["WeightVersions"]

Weights = dict[str, Tensor]


class WeightVersions:
    """A stage's weight versions: the stashed copy of the current one (made at its first forward, into a
    retired copy's tensors when one is spare), spectrain's copy predicted ahead and PipeMare's weights moved
    back for an unstashed recomputed backward; the last two extrapolate from each update's change
    (`observe`)."""

    def __init__(
        self,
        params: Mapping[str, Tensor],
        rules: StageRules,
        lags: Mapping[int, Lag],
        optimizer: LocalOptimizer | torch.optim.Optimizer | None,
        optimizer_name: str,
    ) -> None:
        self.params = params
        self.rules = rules
        self._lags = lags
        self._optimizer = optimizer
        self.current: Weights | None = None  # the current weight version's stashed copy
        self._spare: list[Weights] = []  # stashed copies no forward needs any more, reused by new versions
        mit = rules.mitigation
        self._predict = "spectrain" in mit and optimizer is not None and rules.stashing
        self._last_step: Weights | None = {} if self._predict and optimizer_name == "sgd" else None
        dc = "pipemare" in mit and optimizer is not None and not rules.stashing and rules.recompute
        self._dc = {k: torch.zeros_like(t) for k, t in params.items()} if dc else None
        self._dc_gamma = dc_gamma(max((lag.backward for lag in lags.values()), default=0))

    @property
    def observes_updates(self) -> bool:
        """Whether each update's change must reach `observe` (PipeMare's moving average, plain SGD's last
        step for spectrain)."""
        return self._dc is not None or self._last_step is not None

    def observe(self, keys: list[str], deltas: list[Tensor]) -> None:
        """One update's change per tracked key: dc = dc * gamma + Δ * (1 - gamma) (PipeMare T2); spectrain
        with plain SGD keeps Δ as its last step."""
        for key, delta in zip(keys, deltas, strict=True):
            if self._dc is not None and key in self._dc:
                self._dc[key].mul_(self._dc_gamma).add_(delta, alpha=1 - self._dc_gamma)
            if self._last_step is not None and key in self.params:
                self._last_step[key] = delta.clone()

    # ---- the versions forwards run on -----------------------------------------------------------------
    def for_forward(self, p: int) -> Weights | None:
        """The stashed copy of the current weight version (made at its first forward, p), or None (live)."""
        if not self.rules.stashing or p in self.rules.unstashed:
            return None
        if self.current is None:
            lag = self._lags[p].update if self._predict and p in self._lags else 0
            self.current = self._copy() if lag == 0 else self._predicted_copy(lag)
        return self.current

    def _copy(self) -> Weights:
        """Plain copies of the live weights, in one multi-tensor copy rather than a kernel per tensor."""
        live = list(self.params.values())
        if self._spare:  # a retired version's tensors (leaves that need no grad set up again)
            stash = self._spare.pop()
            copies = list(stash.values())
        else:
            copies = [torch.empty_like(w, requires_grad=w.requires_grad) for w in live]
            stash = dict(zip(self.params, copies, strict=True))
        if copies:
            with torch.no_grad():  # into leaves that require grad: not a step autograd may see
                torch._foreach_copy_(copies, live)
        return stash

    def _predicted_copy(self, lag: int) -> Weights:
        """spectrain: each weight `lag` (> 0) updates ahead, a leaf that needs grad where the weight does."""
        return {
            k: self._predicted(i, k, w, lag).requires_grad_(w.requires_grad)
            for i, (k, w) in enumerate(self.params.items())
        }

    def _predicted(self, index: int, key: str, w: Tensor, lag: int) -> Tensor:
        """spectrain: w + step * lag, the weights `lag` (> 0) updates ahead; a plain copy without a step
        yet."""
        step = (
            predicted_step(self._optimizer, index, w) if self._last_step is None else self._last_step.get(key)
        )
        return w.detach().clone() if step is None else w.detach() + step * float(lag)

    def corrected(self, p: int) -> Weights | None:
        """PipeMare T2: the live weights moved back by s updates of their moving average, for an unstashed
        backward of p that s updates came before; None when nothing moved."""
        s = self._lags[p].backward if self._dc is not None and p in self._lags else 0
        if s == 0:
            return None
        assert self._dc is not None
        return {
            k: (w.detach() - self._dc[k] * float(s)).requires_grad_(w.requires_grad)
            for k, w in self.params.items()
        }

    # ---- a version's end ------------------------------------------------------------------------------
    def drop_current(self) -> Weights | None:
        """The weights just changed: the next forward stashes a new copy. Returns the old one (to retire)."""
        old, self.current = self.current, None
        return old

    def retire(self, weights: Weights | None, in_flight: Iterable[Weights | None]) -> None:
        """Keep a stashed copy for the next weight version once no forward in flight (`in_flight`: the
        versions they ran on) needs it: a new version then costs one multi-tensor copy, not an allocation per
        tensor (on CUDA, host time a plain loop does not spend). On a device the copy into it is queued after
        the backward that read it, so it cannot overtake."""
        if (
            weights is None
            or not self.rules.stashing
            or weights is self.current
            or len(self._spare) >= 2
            or any(w is weights for w in in_flight)
        ):
            return
        self._spare.append(weights)
