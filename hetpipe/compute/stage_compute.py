"""The arithmetic of one stage (hetpipe.md §2-3), without transport: forward with weight stashing,
backward with the local optimizer step, per-wave update sums, and the rebase after a pull.

Order of floating-point operations is fixed here (and mirrored by hetpipe.compute.reference), so runs are
reproducible bit for bit:
  after each optimizer step:   Δ = t - baseline;  sums[wave] += Δ;  baseline = t
  rebase after a pull:         t = pulled;  t += sums[w] for own waves w > own_through, in order
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor, nn
from torch.func import functional_call

__all__ = ["InFlight", "StageCompute", "make_optimizer", "synced_tensors"]


def make_optimizer(params: list[nn.Parameter], name: str, lr: float, momentum: float, weight_decay: float):
    """The local optimizer of a stage: sgd, momentum (SGD with momentum) or adam; None without parameters."""
    if not params:
        return None
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, weight_decay=weight_decay)
    if name == "momentum":
        return torch.optim.SGD(params, lr=lr, momentum=momentum, weight_decay=weight_decay)
    if name == "adam":
        return torch.optim.Adam(params, lr=lr, weight_decay=weight_decay)
    raise ValueError(f"unknown optimizer {name!r}: use sgd, momentum or adam")


def synced_tensors(module: nn.Module) -> dict[str, Tensor]:
    """What the PS holds for a stage: every floating-point parameter and buffer, by global name."""
    return {k: t for k, t in module.state_dict(keep_vars=True).items() if t.is_floating_point()}


@dataclass
class InFlight:
    """What a forward leaves for its backward."""

    inputs: Tensor
    output: Tensor
    weights: dict[str, Tensor] | None  # the stashed weight version (None: no stashing)
    loss: Tensor | None = None


class StageCompute:
    """One stage's layers, optimizer and update bookkeeping."""

    def __init__(
        self, module: nn.Module, optimizer_name: str, lr: float, momentum: float, weight_decay: float,
        *, nm: int, weight_stashing: bool = True, extra: Mapping[str, Tensor] | None = None,
        on_step: Callable[[int], None] | None = None,
    ) -> None:
        """`extra`: more synced tensors (e.g. the audit ledger) that `on_step(p)` may change after the
        optimizer step of minibatch p, before the step's update is recorded."""
        self.module = module
        self.params = dict(module.named_parameters())
        self.synced = {**synced_tensors(module), **(extra or {})}
        self.on_step = on_step
        self.optimizer = make_optimizer(list(self.params.values()), optimizer_name, lr, momentum, weight_decay)
        self.nm = nm
        self.weight_stashing = weight_stashing
        self.in_flight: dict[int, InFlight] = {}
        self.baseline = {k: t.detach().clone() for k, t in self.synced.items()}
        self.sums: dict[int, dict[str, Tensor]] = {}  # own update sums per wave, until a pull contains them

    # ---- weights ------------------------------------------------------------------------------------
    @torch.no_grad()
    def load(self, values: Mapping[str, np.ndarray | Tensor]) -> None:
        """Set the synced tensors (e.g. to the PS's W_0); resets the update baseline."""
        for key, t in self.synced.items():
            t.copy_(torch.as_tensor(values[key]))
        self.baseline = {k: t.detach().clone() for k, t in self.synced.items()}

    def wave_of(self, minibatch: int) -> int:
        return minibatch // self.nm

    # ---- forward / backward -------------------------------------------------------------------------
    def forward(
        self, p: int, inputs: Tensor, target: Tensor | None = None, loss_fn=None, input_grad: bool = True
    ) -> InFlight:
        """Forward of minibatch p; with stashing, on a private copy of the current weights. `input_grad`:
        the backward must produce the gradient w.r.t. the input (every stage but the first)."""
        if input_grad and inputs.is_floating_point():
            inputs = inputs.detach().requires_grad_(True)
        if self.weight_stashing:
            weights = {k: w.detach().clone().requires_grad_(w.requires_grad) for k, w in self.params.items()}
            output = functional_call(self.module, weights, (inputs,), strict=False)
        else:
            weights = None
            with torch.no_grad():
                output = self.module(inputs)
        flight = InFlight(inputs, output, weights)
        if target is not None:
            flight.loss = loss_fn(output, target) if self.weight_stashing else None
        self.in_flight[p] = flight
        return flight

    def backward(self, p: int, grad_output: Tensor | None = None, target: Tensor | None = None, loss_fn=None):
        """Backward of minibatch p (from its loss on the last stage, else from grad_output), then the local
        optimizer step; returns (gradient w.r.t. the stage input or None, the loss or None)."""
        flight = self.in_flight.pop(p)
        if flight.weights is None:  # no stashing: recompute the forward with today's weights
            flight = InFlight(flight.inputs, self.module(flight.inputs), None)
            if target is not None:
                flight.loss = loss_fn(flight.output, target)
        if flight.loss is not None:
            flight.loss.backward()
        elif flight.output.requires_grad:  # else: no weights here and no input gradient wanted
            flight.output.backward(grad_output)
        if flight.weights is not None:
            for key, param in self.params.items():
                param.grad = flight.weights[key].grad
        if self.optimizer is not None:
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        if self.on_step is not None:
            self.on_step(p)
        self._record_update(self.wave_of(p))
        grad_in = flight.inputs.grad if flight.inputs.requires_grad else None
        return grad_in, (None if flight.loss is None else flight.loss.detach())

    @torch.no_grad()
    def _record_update(self, wave: int) -> None:
        sums = self.sums.setdefault(wave, {})
        for key, t in self.synced.items():
            delta = t - self.baseline[key]
            if key in sums:
                sums[key] += delta
            else:
                sums[key] = delta
            self.baseline[key].copy_(t)

    # ---- WSP ------------------------------------------------------------------------------------------
    def wave_update(self, wave: int) -> dict[str, np.ndarray]:
        """Σ Δ of `wave` as float32 numpy arrays for the push (kept until a pull contains it)."""
        sums = self.sums.get(wave)
        if sums is None:
            sums = self.sums[wave] = {k: torch.zeros_like(t) for k, t in self.synced.items()}
        return {k: v.detach().cpu().numpy() for k, v in sums.items()}

    @torch.no_grad()
    def rebase(self, pulled: Mapping[str, np.ndarray | Tensor], own_through: int) -> None:
        """weights = pulled global + own updates the snapshot does not contain yet (hetpipe.md §3)."""
        for wave in [w for w in self.sums if w <= own_through]:
            del self.sums[wave]
        for key, t in self.synced.items():
            t.copy_(torch.as_tensor(pulled[key]))
            for wave in sorted(self.sums):
                t += self.sums[wave][key]
            self.baseline[key].copy_(t)
