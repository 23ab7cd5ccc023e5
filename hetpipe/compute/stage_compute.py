"""The arithmetic of one stage (docs/schedules.md, docs/wsp.md, docs/buffers.md), without transport:
forward with weight stashing or recomputation, backward, the update (U) on the mean gradient, per-wave
push sums, and the rebase after a pull.

Order of floating-point operations is fixed here (and written independently in hetpipe.compute.reference),
so runs are reproducible bit for bit:
  backward of p:           acc += grad(p)                       (per parameter; the first grad is taken as is)
  U (n backwards applied): grad = acc / n (n > 1, in place); optimizer step; for aggregation sum/mean the
                           update is recorded by wave, lazily: the updates of one wave since the baseline
                           are folded in at once, Δ = t - baseline; sums[wave] += Δ; baseline = t, when a
                           U of another wave comes, and before PUSH and WAIT (per update under pipemare and
                           spectrain, which need each update's Δ); aggregation server: gsum[wave] += acc
                           (the PS runs the optimizer)
  PUSH c:                  fold; params: sums[c] (or gsum[c] / Nm); ledgers: sums[c]; buffers: their values
  WAIT (rebase):           fold; t = pulled; t += sums[w] for own waves w > own_through, in wave order
                           (aggregation server: t = pulled); buffers are replaced out of place
Mitigations (train.mitigation, hetpipe.core.pipeline.mitigation; "none" leaves all of the above untouched):
  warmup, pipemare (T1):   before U p's step: optimizer lr = lr * factor (warm-up factor x PipeMare factor)
  pipemare (T2):           after U: dc = dc * gamma + Δ * (1 - gamma); an unstashed backward of p recomputes
                           on w - dc * s (s: updates since F p) instead of the live w
  spectrain:               a new weight version's stashed copy is w + step * s (step: the optimizer's
                           predicted next step, plain SGD its last update; s: updates between F p and p's U);
                           aggregation server: the rebase sets t = pulled + (pulled - last pulled) * (D + 1)
  average:                 the rebase adds own parameter sums as sums[w] / VWs (ledgers whole)
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from hetpipe.compute.optim import make_optimizer, predicted_step, set_lr
from hetpipe.compute.weight_swap import WeightSwap
from hetpipe.core.config import ClusterConfig
from hetpipe.core.pipeline.mitigation import Lag, dc_gamma, pipemare_lr_factor, stage_lags, warmup_lr_factor
from hetpipe.core.pipeline.schedule import Action, get_schedule, unstashed_forwards
from hetpipe.core.wsp.aggregation import get_aggregation

__all__ = ["InFlight", "StageCompute", "StageRules", "buffer_slots", "set_buffer", "stage_buffers"]


def stage_buffers(module: nn.Module) -> dict[str, Tensor]:
    """The persistent buffers of a stage (BatchNorm running statistics and counters), by global name."""
    params = dict(module.named_parameters())
    return {k: t for k, t in module.state_dict(keep_vars=True).items() if k not in params}


def _slot(module: nn.Module, name: str) -> tuple[nn.Module, str]:
    """The module that owns the buffer `name` (a global name) and its attribute there."""
    owner, _, leaf = name.rpartition(".")
    return (module.get_submodule(owner) if owner else module), leaf


def set_buffer(module: nn.Module, name: str, value: Tensor) -> None:
    """Replace a buffer by another tensor (out of place: graphs that saved the old one keep it)."""
    owner, leaf = _slot(module, name)
    owner._buffers[leaf] = value


def buffer_slots(module: nn.Module) -> dict[str, tuple[nn.Module, str]]:
    """Where each of stage_buffers(module) lives (owning module, attribute), found once: reading a buffer
    through its slot is a dict lookup, not a walk of the module tree (state_dict: ~0.6 ms for resnet50, per
    call)."""
    return {name: _slot(module, name) for name in stage_buffers(module)}


def _float_copies(tensors: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """float32 copies of `tensors`, by key: the float32 ones copied in one multi-tensor op (x * 1.0: bit for
    bit x, -0.0 and NaN too, unless torch.set_flush_denormal is on; _foreach_clone is too new to rely on), the
    others converted."""
    same = [k for k, t in tensors.items() if t.dtype == torch.float32]
    copied = dict(zip(same, torch._foreach_mul([tensors[k] for k in same], 1.0), strict=True)) if same else {}
    return {k: copied[k] if k in copied else t.float() for k, t in tensors.items()}


def _add_into(totals: dict[str, Tensor], new: list[tuple[str, Tensor]]) -> None:
    """totals[key] += tensor for the keys totals holds, in one multi-tensor add (not a kernel per tensor); the
    others are taken as they are (the caller owns them)."""
    held = [(totals[k], t) for k, t in new if k in totals]
    if held:
        torch._foreach_add_([total for total, _ in held], [t for _, t in held])
    totals.update({k: t for k, t in new if k not in totals})


@dataclass(frozen=True)
class StageRules:
    """How a stage computes, from the config and its schedule (validated at load, docs/schedules.md)."""

    nm: int
    stashing: bool = True  # forwards run on a stashed copy of their weight version (else on the live weights)
    # forwards keep only their input; the backward recomputes them (on the weights then live: without
    # stashing, an update in between changes them, as PipeDream without weight stashing does)
    recompute: bool = False
    # the stage steps its own optimizer and pushes its updates (else it pushes mean gradients and the PS
    # steps: the aggregation rule's trait, hetpipe.core.wsp.aggregation)
    local_optimizer: bool = True
    buffers: str = "average"  # average: pulls replace the buffers; local: each VW keeps its own
    precision: str = "fp32"  # fp32 | bf16 (autocast; weights, gradients and updates stay fp32)
    mitigation: tuple[str, ...] = ()  # staleness mitigations (hetpipe.core.pipeline.mitigation); () = none
    num_vws: int = 1  # VWs of the run (warmup's starting share, average's share)
    warmup_waves: int = 0  # warmup ramp and PipeMare T1 annealing, in waves
    staleness: int = 0  # D (spectrain with aggregation server predicts D + 1 versions ahead)
    lags: Mapping[int, Lag] | None = None  # per minibatch of this stage (hetpipe.core.pipeline.mitigation)
    # minibatches whose weights no U or WAIT changes between F and B (hetpipe.core.pipeline.schedule
    # .unstashed_forwards): forwards on the live weights, no stashed copy (the same numbers, a copy less)
    unstashed: frozenset[int] = frozenset()

    @classmethod
    def of(cls, config: ClusterConfig, actions: Sequence[Action], num_vws: int) -> StageRules:
        """The rules of a stage running `actions` (its list of the run's schedule) in a run of `num_vws` VWs:
        the schedule's modes and the aggregation rule's traits, read from their registries."""
        t = config.train
        modes = get_schedule(t.schedule).modes(t.weight_stashing, t.recompute)
        return cls(
            nm=config.wsp.nm,
            stashing=modes.stashing,
            recompute=modes.recompute,
            local_optimizer=get_aggregation(config.ps.aggregation).local_optimizer,
            buffers=config.ps.buffers,
            precision=t.precision,
            mitigation=t.mitigations,
            num_vws=num_vws,
            warmup_waves=t.warmup_waves,
            staleness=config.wsp.staleness,
            lags=stage_lags(actions) if t.mitigations else None,
            unstashed=unstashed_forwards(actions),
        )


@dataclass
class InFlight:
    """What a forward leaves for its backward."""

    inputs: Tensor
    output: Tensor | None  # None when the backward recomputes the forward
    weights: dict[str, Tensor] | None  # the stashed weight version (None: the live weights)
    loss: Tensor | None = None


class StageCompute:
    """One stage's layers, optimizer and update bookkeeping."""

    def __init__(
        self,
        module: nn.Module,
        optimizer_name: str,
        lr: float,
        momentum: float,
        weight_decay: float,
        rules: StageRules,
        *,
        ledgers: Mapping[str, Tensor] | None = None,
        on_update: Callable[[list[int]], None] | None = None,
    ) -> None:
        """`ledgers`: audit counters that `on_update(minibatches)` may change at each update, before its
        change is recorded (they travel as updates and are always summed)."""
        self.module = module
        self._swap = WeightSwap(module)  # forwards on a stashed weight version
        self._buffer_slots = buffer_slots(module)
        self.rules = rules
        self.params = dict(module.named_parameters())
        self.ledgers = dict(ledgers or {})
        self.on_update = on_update
        local = rules.local_optimizer
        self.optimizer = (
            make_optimizer(list(self.params.values()), optimizer_name, lr, momentum, weight_decay)
            if local
            else None
        )
        self.tracked = {**(self.params if local else {}), **self.ledgers}  # what updates are recorded for
        self.baseline = {k: t.detach().clone() for k, t in self.tracked.items()}
        self.sums: dict[int, dict[str, Tensor]] = {}  # own update sums per wave, until a pull contains them
        self.gsums: dict[int, dict[str, Tensor]] = {}  # aggregation server: gradient sums per wave
        self.in_flight: dict[int, InFlight] = {}
        self.acc: dict[str, Tensor] = {}  # gradients of the backwards since the last update
        self.pending: list[int] = []  # those backwards' minibatches
        self._stash: dict[str, Tensor] | None = None  # the current weight version's stashed copy
        self._open_wave: int | None = None  # the wave whose updates since the baseline are not in sums yet
        self._spare: list[
            dict[str, Tensor]
        ] = []  # stashed copies no forward needs any more, reused by new versions
        device = next(iter(self.params.values())).device if self.params else torch.device("cpu")
        self._autocast = (
            torch.autocast(device.type, dtype=torch.bfloat16) if rules.precision == "bf16" else None
        )
        self.base_lr = lr
        mit = rules.mitigation
        self._lags = dict(rules.lags or {})
        self._scale_lr = self.optimizer is not None and ("warmup" in mit or "pipemare" in mit)
        self._predict = "spectrain" in mit and self.optimizer is not None and rules.stashing
        self._last_step: dict[str, Tensor] | None = {} if self._predict and optimizer_name == "sgd" else None
        self._predict_pulls = "spectrain" in mit and self.optimizer is None
        self._last_pulled: dict[str, Tensor] = {}  # spectrain, aggregation server: the weights last pulled
        dc = "pipemare" in mit and self.optimizer is not None and not rules.stashing and rules.recompute
        self._dc = {k: torch.zeros_like(t) for k, t in self.params.items()} if dc else None
        self._dc_gamma = dc_gamma(max((lag.backward for lag in self._lags.values()), default=0))
        self._average = rules.num_vws if "average" in mit and rules.num_vws > 1 else 0

    # ---- keys -------------------------------------------------------------------------------------
    def buffers(self) -> dict[str, Tensor]:
        """The stage's persistent buffers now (stage_buffers(self.module), through their slots)."""
        return {key: owner._buffers[leaf] for key, (owner, leaf) in self._buffer_slots.items()}

    def _set_buffer(self, key: str, value: Tensor) -> None:
        """set_buffer(self.module, key, value), through its slot."""
        owner, leaf = self._buffer_slots[key]
        owner._buffers[leaf] = value

    def kinds(self) -> dict[str, str]:
        """Every key this stage syncs with the PS and its kind (hetpipe.core.wsp.aggregation)."""
        return {
            **dict.fromkeys(self.params, "param"),
            **dict.fromkeys(self.ledgers, "ledger"),
            **dict.fromkeys(self._buffer_slots, "buffer"),
        }

    def values(self) -> dict[str, Tensor]:
        """The current value of every synced key, buffers as float32 (what registration sends)."""
        return {**self.params, **self.ledgers, **{k: b.float() for k, b in self.buffers().items()}}

    @torch.no_grad()
    def load(self, values: Mapping[str, Tensor]) -> None:
        """Set every synced tensor (e.g. to the PS's W_0); resets the update baseline."""
        for key, t in {**self.params, **self.ledgers}.items():
            t.copy_(values[key])
        self._replace_buffers(values)
        self.baseline = {k: t.detach().clone() for k, t in self.tracked.items()}
        self._open_wave = None
        if self._predict_pulls:
            self._last_pulled = {k: t.detach().clone() for k, t in self.params.items()}
        self._stash = None

    def _replace_buffers(self, values: Mapping[str, Tensor]) -> None:
        for key, old in self.buffers().items():
            new = values[key].to(old.device)
            new = new.round().to(old.dtype) if not old.is_floating_point() else new.to(old.dtype, copy=True)
            self._set_buffer(key, new)

    def wave_of(self, minibatch: int) -> int:
        return minibatch // self.rules.nm

    # ---- forward / backward -----------------------------------------------------------------------
    def _compute(self) -> contextlib.AbstractContextManager:
        return self._autocast if self._autocast is not None else contextlib.nullcontext()

    def _weights(self, p: int) -> dict[str, Tensor] | None:
        """The stashed copy of the current weight version (made at its first forward, p), or None (live)."""
        if not self.rules.stashing or p in self.rules.unstashed:
            return None
        if self._stash is None:
            lag = self._lags[p].update if self._predict and p in self._lags else 0
            if lag == 0:  # plain copies, in one multi-tensor copy rather than a kernel per tensor
                live = list(self.params.values())
                if self._spare:  # a retired version's tensors (leaves that need no grad set up again)
                    self._stash = self._spare.pop()
                    copies = list(self._stash.values())
                else:
                    copies = [torch.empty_like(w, requires_grad=w.requires_grad) for w in live]
                    self._stash = dict(zip(self.params, copies, strict=True))
                if copies:
                    with torch.no_grad():  # into leaves that require grad: not a step autograd may see
                        torch._foreach_copy_(copies, live)
            else:
                self._stash = {
                    k: self._predicted(i, k, w, lag).requires_grad_(w.requires_grad)
                    for i, (k, w) in enumerate(self.params.items())
                }
        return self._stash

    def _predicted(self, index: int, key: str, w: Tensor, lag: int) -> Tensor:
        """spectrain: w + step * lag, the weights `lag` (> 0) updates ahead; a plain copy without a step
        yet."""
        step = (
            predicted_step(self.optimizer, index, w) if self._last_step is None else self._last_step.get(key)
        )
        return w.detach().clone() if step is None else w.detach() + step * float(lag)

    def _corrected(self, p: int) -> dict[str, Tensor] | None:
        """PipeMare T2: the live weights moved back by s updates of their moving average, for an unstashed
        backward of p that s updates came before; None when nothing moved."""
        s = self._lags[p].backward if self._dc is not None and p in self._lags else 0
        if s == 0:
            return None
        return {
            k: (w.detach() - self._dc[k] * float(s)).requires_grad_(w.requires_grad)
            for k, w in self.params.items()
        }

    def _recompute(self, p: int, flight: InFlight) -> None:
        if flight.weights is None:
            flight.weights = self._corrected(p)
        with self._buffers_kept():
            flight.output = self._run(flight.weights, flight.inputs)

    def _run(self, weights: dict[str, Tensor] | None, inputs: Tensor) -> Tensor:
        with self._compute():
            if weights is None:
                return self.module(inputs)
            with self._swap.using(weights):
                return self.module(inputs)

    def forward(
        self, p: int, inputs: Tensor, target: Tensor | None = None, loss_fn=None, input_grad: bool = True
    ) -> Tensor:
        """Forward of minibatch p; returns its output (what goes to the next stage). `input_grad`: the
        backward must produce the gradient w.r.t. the input (every stage but the first)."""
        if input_grad and inputs.is_floating_point():
            inputs = inputs.detach().requires_grad_(True)
        weights = self._weights(p)
        if self.rules.recompute:
            with torch.no_grad():
                output = self._run(weights, inputs)
            self.in_flight[p] = InFlight(inputs, None, weights)
            return output
        output = self._run(weights, inputs)
        loss = loss_fn(output, target) if target is not None else None
        self.in_flight[p] = InFlight(inputs, output, weights, loss)
        return output

    @contextlib.contextmanager
    def _buffers_kept(self) -> Iterator[None]:
        """Run a recomputed forward without letting it move the running statistics a second time."""
        kept = {k: b.detach().clone() for k, b in self.buffers().items()}
        try:
            yield
        finally:
            for key, value in kept.items():
                self._set_buffer(key, value)

    def backward(self, p: int, grad_output: Tensor | None = None, target: Tensor | None = None, loss_fn=None):
        """Backward of minibatch p (from its loss on the last stage, else from grad_output); its parameter
        gradients wait in `acc` for the next update. Returns (gradient w.r.t. the stage input or None,
        the loss or None)."""
        flight = self.in_flight.pop(p)
        if flight.output is None:  # recompute the forward, on the weights it ran on (or today's, unstashed)
            self._recompute(p, flight)
            if target is not None:
                flight.loss = loss_fn(flight.output, target)
        weights = flight.weights if flight.weights is not None else self.params
        names = [k for k, w in weights.items() if w.requires_grad]
        wrt = [weights[k] for k in names] + ([flight.inputs] if flight.inputs.requires_grad else [])
        root, seed = (flight.loss, None) if flight.loss is not None else (flight.output, grad_output)
        if wrt and root.requires_grad:
            grads = torch.autograd.grad(root, wrt, seed, allow_unused=True)
        else:  # no weights here and no input gradient wanted
            grads = (None,) * len(wrt)
        with torch.no_grad():
            _add_into(self.acc, [(key, g) for key, g in zip(names, grads, strict=False) if g is not None])
        self.pending.append(p)
        self._retire(flight.weights)
        grad_in = grads[-1] if flight.inputs.requires_grad else None
        return grad_in, (None if flight.loss is None else flight.loss.detach())

    def loss_of(self, p: int, target: Tensor, loss_fn) -> Tensor:
        """The loss of minibatch p's forward on the last stage, a detached 0-d tensor on the stage's device
        (recomputing the forward if it was not kept; the backward then reuses it). Reading its value waits for
        the device, so a CUDA stage reads it late (worker/stage.py)."""
        flight = self.in_flight[p]
        if flight.output is None:
            self._recompute(p, flight)
        if flight.loss is None:
            flight.loss = loss_fn(flight.output, target)
        return flight.loss.detach()

    def skip(self, p: int) -> None:
        """Drop minibatch p (train.on_nan = "skip"): no gradient, not counted in the next update's mean."""
        self._retire(self.in_flight.pop(p).weights)

    def _new_version(self) -> None:
        """The weights just changed: the next forward stashes a new copy (the old one is retired if
        unused)."""
        old, self._stash = self._stash, None
        self._retire(old)

    def _retire(self, weights: dict[str, Tensor] | None) -> None:
        """Keep a stashed copy for the next weight version once no forward in flight needs it: a new version
        then costs one multi-tensor copy, not an allocation per tensor (on CUDA, host time a plain loop does
        not spend). On a device the copy into it is queued after the backward that read it, so it cannot
        overtake."""
        if (
            weights is None
            or not self.rules.stashing
            or weights is self._stash
            or len(self._spare) >= 2
            or any(f.weights is weights for f in self.in_flight.values())
        ):
            return
        self._spare.append(weights)

    # ---- the update -------------------------------------------------------------------------------
    @torch.no_grad()
    def update(self, p: int) -> None:
        """U p: apply the mean gradient of the pending backwards (p the last of them, all one wave)."""
        covered, count = self.pending, len(self.pending)
        wave = self.wave_of(p)
        if self.optimizer is not None:
            if self._scale_lr:
                set_lr(self.optimizer, self.base_lr * self._lr_factor(p))
            if count > 1 and self.acc:  # the mean gradient; acc is ours, so in place
                torch._foreach_div_(list(self.acc.values()), float(count))
            for key, param in self.params.items():
                param.grad = self.acc.get(key)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        elif self.params:  # aggregation server: the PS steps on the wave's mean gradient
            gsum = self.gsums.setdefault(wave, {})
            for key, g in self.acc.items():
                if key in gsum:
                    gsum[key] += g
                else:
                    gsum[key] = g.clone()
        self.acc, self.pending = {}, []
        if self.on_update is not None:
            self.on_update(covered)
        self._record_update(wave)
        self._new_version()

    def _lr_factor(self, p: int) -> float:
        """warmup x PipeMare T1 for the update of minibatch p (hetpipe.core.pipeline.mitigation)."""
        wave, rules = self.wave_of(p), self.rules
        factor = 1.0
        if "warmup" in rules.mitigation:
            factor *= warmup_lr_factor(wave, rules.num_vws, rules.warmup_waves)
        if "pipemare" in rules.mitigation:
            factor *= pipemare_lr_factor(self._lags[p].update, wave, rules.warmup_waves)
        return factor

    def _record_update(self, wave: int) -> None:
        """Note an update of `wave`: folded into the sums with the wave's other updates (one subtraction, add
        and copy for all of them, since on CUDA a stage's host time per minibatch is what it must keep under
        the device's), or at once where a mitigation needs each update's change."""
        if self._open_wave is not None and self._open_wave != wave:
            self._fold()
        self._open_wave = wave
        if self._dc is not None or self._last_step is not None:
            self._fold()

    @torch.no_grad()
    def _fold(self) -> None:
        """Add what the updates since the baseline changed (tracked - baseline) to their wave's sums and move
        the baseline, over all tensors at once (torch._foreach_*)."""
        wave, self._open_wave = self._open_wave, None
        keys = list(self.tracked)
        if wave is None or not keys:
            return
        now = [self.tracked[k] for k in keys]
        deltas = torch._foreach_sub(now, [self.baseline[k] for k in keys])
        sums = self.sums.setdefault(wave, {})
        for key, delta in zip(keys, deltas, strict=True):
            if self._dc is not None and key in self._dc:
                self._dc[key].mul_(self._dc_gamma).add_(delta, alpha=1 - self._dc_gamma)
            if self._last_step is not None and key in self.params:
                self._last_step[key] = delta.clone()
        _add_into(sums, list(zip(keys, deltas, strict=True)))
        torch._foreach_copy_([self.baseline[k] for k in keys], now)

    # ---- WSP --------------------------------------------------------------------------------------
    @torch.no_grad()
    def wave_push(self, wave: int, copy_buffers: bool = True) -> dict[str, Tensor]:
        """What PUSH `wave` sends, as tensors on this stage's device: parameter updates (or mean gradients),
        ledger updates and the buffers' current values (float32 copies; with `copy_buffers` false the buffers
        themselves, for a caller that copies them before the next forward moves them, as CUDA staging does in
        stream order)."""
        self._fold()
        if (
            wave not in self.sums
        ):  # a wave without an update (not setdefault: its zeros would be made every time)
            self.sums[wave] = {k: torch.zeros_like(t) for k, t in self.tracked.items()}
        sums = self.sums[wave]
        out = {k: sums[k] for k in self.tracked}
        if self.optimizer is None:
            gsum = self.gsums.pop(wave, {})
            for key, param in self.params.items():
                g = gsum.get(key)
                out[key] = torch.zeros_like(param) if g is None else g / self.rules.nm
        out.update(_float_copies(self.buffers()) if copy_buffers else self.buffers())
        return out

    def forget(self, through: int) -> None:
        """Drop own update sums of waves <= through (a pull contains them, or no pull will ever come)."""
        for wave in [w for w in self.sums if w <= through]:
            del self.sums[wave]

    @torch.no_grad()
    def rebase(self, pulled: Mapping[str, Tensor], own_through: int) -> None:
        """weights = pulled global + own updates the snapshot does not contain yet (docs/wsp.md); buffers
        replaced out of place (buffers = "average"); aggregation server: weights = pulled."""
        self._fold()
        self.forget(own_through)
        keys = list(self.tracked)
        if keys:  # per tensor: t = pulled, then t += each wave's own sum in wave order; all tensors at once
            now = [self.tracked[k] for k in keys]
            torch._foreach_copy_(now, [pulled[k] for k in keys])
            for wave in sorted(self.sums):
                own = [self.sums[wave][k] for k in keys]
                if self._average:
                    own = [
                        t / self._average if k in self.params else t for k, t in zip(keys, own, strict=True)
                    ]
                torch._foreach_add_(now, own)
            torch._foreach_copy_([self.baseline[k] for k in keys], now)
        if self.optimizer is None:
            ahead = float(self.rules.staleness + 1)
            for key, t in self.params.items():
                if self._predict_pulls:
                    now = pulled[key].to(t.device, copy=True)
                    t.copy_(now + (now - self._last_pulled[key]) * ahead)
                    self._last_pulled[key] = now
                else:
                    t.copy_(pulled[key])
        if self.rules.buffers == "average":
            self._replace_buffers(pulled)
        self._new_version()

    # ---- checkpoints (hetpipe train --resume) ----------------------------------------------------------
    @torch.no_grad()
    def state_dict(self) -> tuple[dict[str, Any], dict[str, Tensor]]:
        """Everything this stage's arithmetic carries from one action to the next, as plain metadata and named
        tensors: weights, buffers, ledgers, optimizer state, update baselines and own per-wave sums, pending
        gradients, and each forward in flight (its input and the weight version it ran on; the outputs are
        recomputed on load)."""
        tensors: dict[str, Tensor] = {}
        meta: dict[str, Any] = {
            "in_flight": [],
            "pending": list(self.pending),
            "stash": None,
            "open_wave": self._open_wave,
        }  # its updates are in the weights, not yet in sums
        for key, t in {**self.params, **self.ledgers}.items():
            tensors[f"w/{key}"] = t.detach()
        for key, b in self.buffers().items():
            tensors[f"b/{key}"] = b.detach()
        for key, t in self.baseline.items():
            tensors[f"base/{key}"] = t
        for key, t in self.acc.items():
            tensors[f"acc/{key}"] = t
        for name, table in (("sums", self.sums), ("gsums", self.gsums)):
            meta[name] = sorted(table)
            for wave, parts in table.items():
                tensors.update({f"{name}/{wave}/{key}": t for key, t in parts.items()})
        if self.optimizer is not None:
            state = self.optimizer.state_dict()["state"]
            meta["optimizer"] = {str(i): sorted(entry) for i, entry in state.items()}
            for i, entry in state.items():
                tensors.update({f"opt/{i}/{name}": t for name, t in entry.items()})
        stashes: dict[int, dict[str, Tensor]] = {}
        for weights in [f.weights for f in self.in_flight.values()] + [self._stash]:
            if weights is not None:
                stashes.setdefault(id(weights), weights)
        order = list(stashes)
        for n, weights in enumerate(stashes.values()):
            tensors.update({f"stash/{n}/{key}": w.detach() for key, w in weights.items()})
        meta["stashes"] = len(order)
        meta["stash"] = None if self._stash is None else order.index(id(self._stash))
        for p, flight in sorted(self.in_flight.items()):
            tensors[f"x/{p}"] = flight.inputs.detach()
            meta["in_flight"].append(
                {
                    "p": p,
                    "weights": None if flight.weights is None else order.index(id(flight.weights)),
                    "output": flight.output is not None,
                    "loss": flight.loss is not None,
                    "input_grad": flight.inputs.requires_grad,
                }
            )
        return meta, tensors

    @torch.no_grad()
    def load_state_dict(
        self,
        meta: Mapping[str, Any],
        tensors: Mapping[str, Tensor],
        targets: Mapping[int, Tensor] | None = None,
        loss_fn=None,
        resend: frozenset[int] = frozenset(),
    ) -> dict[int, Tensor]:
        """Restore what state_dict saved (tensors on any device); each forward in flight whose backward needs
        its graph runs again on its input and weights (running statistics untouched), the loss too on the last
        stage (`targets`, `loss_fn`). Returns the outputs of the minibatches in `resend`: what this stage had
        sent on before the checkpoint and its neighbour had not received yet."""
        device = next(iter(self.params.values())).device if self.params else torch.device("cpu")
        for key, t in {**self.params, **self.ledgers}.items():
            t.copy_(tensors[f"w/{key}"])
        for key, old in self.buffers().items():
            self._set_buffer(key, tensors[f"b/{key}"].to(old.device, old.dtype, copy=True))
        self.baseline = {k: tensors[f"base/{k}"].to(device, copy=True) for k in self.tracked}
        self.acc = {
            k[len("acc/") :]: t.to(device, copy=True) for k, t in tensors.items() if k.startswith("acc/")
        }
        self.pending = list(meta["pending"])
        self._open_wave = meta.get("open_wave")
        self.sums = {
            int(w): {k: tensors[f"sums/{w}/{k}"].to(device, copy=True) for k in self.tracked}
            for w in meta["sums"]
        }
        self.gsums = {
            int(w): {
                k[len(f"gsums/{w}/") :]: t.to(device, copy=True)
                for k, t in tensors.items()
                if k.startswith(f"gsums/{w}/")
            }
            for w in meta["gsums"]
        }
        if self.optimizer is not None:
            state = {
                int(i): {name: tensors[f"opt/{i}/{name}"] for name in names}
                for i, names in meta.get("optimizer", {}).items()
            }
            self.optimizer.load_state_dict({**self.optimizer.state_dict(), "state": state})
        stashes = [
            {
                k: tensors[f"stash/{n}/{k}"].to(device, copy=True).requires_grad_(w.requires_grad)
                for k, w in self.params.items()
            }
            for n in range(meta["stashes"])
        ]
        self._stash = None if meta["stash"] is None else stashes[meta["stash"]]
        self.in_flight, outputs = {}, {}
        for entry in meta["in_flight"]:
            p = entry["p"]
            inputs = tensors[f"x/{p}"].to(device, copy=True)
            if entry["input_grad"]:
                inputs.requires_grad_(True)
            weights = None if entry["weights"] is None else stashes[entry["weights"]]
            flight = InFlight(inputs, None, weights)
            if entry["output"] or p in resend:
                with torch.set_grad_enabled(entry["output"]), self._buffers_kept():
                    output = self._run(weights, inputs)
                    if entry["output"]:
                        flight.output = output
                        if entry["loss"]:
                            assert targets is not None and loss_fn is not None
                            flight.loss = loss_fn(output, targets[p])
                if p in resend:
                    outputs[p] = output.detach()
            self.in_flight[p] = flight
        return outputs
