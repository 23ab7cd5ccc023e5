"""The arithmetic of one stage (docs/schedules.md, docs/wsp.md, docs/buffers.md), without transport:
forward with weight stashing or recomputation, backward, the update (U) on the mean gradient, per-wave
push sums, and the rebase after a pull.

Order of floating-point operations is fixed here and in the parts StageCompute composes (the fold, PUSH sums
and rebase: hetpipe.compute.update_sums; stashed, predicted and corrected weights:
hetpipe.compute.weight_versions), and written independently in hetpipe.compute.reference, so runs are
reproducible bit for bit:
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
Trainer controls ([train], docs/clusters.md; default off, leaving all of the above untouched):
  lr_schedule:             lr above = lr_at(schedule, U p's wave) (hetpipe.core.pipeline.lr_schedule)
  clip_grad_norm:          after grad = acc / n, before the step: torch.nn.utils.clip_grad_norm_ over this
                           stage's parameters only (a VW's other stages hold the rest of its gradient)
  freeze:                  a minibatch of a wave whose first n model layers are frozen runs this stage's share
                           of them in eval mode under no_grad (no gradient, so no step: their Δ is 0); a stage
                           all frozen takes no output gradient, the stage after it sends none (docs/wsp.md)
  freeze_cache_mib:        those layers run on the minibatch's samples whose output is not kept by sample, the
                           others' output is the kept rows (hetpipe.compute.frozen_cache states the rule)
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.utils import clip_grad_norm_

from hetpipe.compute.frozen_cache import FrozenCache
from hetpipe.compute.multi_tensor import add_into, float_copies
from hetpipe.compute.optim import make_optimizer, set_lr
from hetpipe.compute.stage_buffers import BufferSlots
from hetpipe.compute.stage_checkpoint import restore_stage, saved_flights
from hetpipe.compute.stage_freezing import StageFreezing, auto_freeze_state
from hetpipe.compute.update_sums import Sums, UpdateSums, host_for
from hetpipe.compute.weight_swap import WeightSwap
from hetpipe.compute.weight_versions import Weights, WeightVersions
from hetpipe.core.config.schema import ClusterConfig
from hetpipe.core.pipeline.lr_schedule import LrSchedule, lr_at
from hetpipe.core.pipeline.mitigation import Lag, pipemare_lr_factor, stage_lags, warmup_lr_factor
from hetpipe.core.pipeline.schedule import Action, get_schedule, unstashed_forwards
from hetpipe.core.wsp.aggregation import get_aggregation
from hetpipe.core.wsp.autofreeze import AutoFreezeState
from hetpipe.core.wsp.freezing import FreezeSchedule

__all__ = ["InFlight", "StageCompute", "StageRules"]


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
    lr_schedule: LrSchedule | None = None  # the learning rate by wave (None: constant, the optimizer's own)
    clip_grad_norm: float = 0.0  # each update's gradient clipped to this norm over the stage (0: off)
    freeze: FreezeSchedule = FreezeSchedule()  # layers frozen by wave (hetpipe.core.wsp.freezing; none)
    exact_pulls: bool = True  # [wsp] pull = "exact" (its pulls leave frozen parameters out; latest ones not)
    freeze_cache_bytes: int = 0  # train.freeze_cache_mib (hetpipe.compute.frozen_cache; 0: off)
    # train.autofreeze_every: the adaptive rule's state, fed by the pulls' movement records (None: off)
    autofreeze: AutoFreezeState | None = None

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
            lr_schedule=None if t.lr_schedule == "constant" else t.schedule_of_lr,
            clip_grad_norm=t.clip_grad_norm,
            freeze=t.freeze_schedule,
            exact_pulls=config.wsp.pull == "exact",
            freeze_cache_bytes=t.freeze_cache_mib * 2**20 if t.freezes else 0,
            autofreeze=auto_freeze_state(config),
        )


@dataclass
class InFlight:
    """What a forward leaves for its backward."""

    inputs: Tensor
    output: Tensor | None  # None when the backward recomputes the forward
    weights: dict[str, Tensor] | None  # the stashed weight version (None: the live weights)
    loss: Tensor | None = None
    ids: Sequence[int] | None = None  # the minibatch's samples (their index in the training set)


class StageCompute:
    """One stage's layers, optimizer and update bookkeeping: forwards on the weight versions of
    `versions`, backwards into `acc`, updates recorded in `updates`."""

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
        self.freezing = StageFreezing(module, rules.freeze, rules.nm, rules.exact_pulls, rules.autofreeze)
        self.frozen_cache = FrozenCache(rules.freeze_cache_bytes)  # (off at 0 bytes)
        self._swap = WeightSwap(module)  # forwards on a stashed weight version
        self.buffer_slots = BufferSlots(module)  # the buffers, through slots found once
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
        mit = rules.mitigation
        self._lags = dict(rules.lags or {})
        self.versions = WeightVersions(self.params, rules, self._lags, self.optimizer, optimizer_name)
        tracked = {**(self.params if local else {}), **self.ledgers}  # what updates are recorded for
        average = rules.num_vws if "average" in mit and rules.num_vws > 1 else 0
        observe = self.versions.observe if self.versions.observes_updates else None
        self.updates = UpdateSums(tracked, self.params, average, observe, host_for(tracked, rules.staleness))
        self.in_flight: dict[int, InFlight] = {}
        self.acc: dict[str, Tensor] = {}  # gradients of the backwards since the last update
        self.pending: list[int] = []  # those backwards' minibatches
        device = _device_of(self.params)
        self._autocast = (
            torch.autocast(device.type, dtype=torch.bfloat16) if rules.precision == "bf16" else None
        )
        self.base_lr = lr
        scaled = "warmup" in mit or "pipemare" in mit or rules.lr_schedule is not None
        self._scale_lr = self.optimizer is not None and scaled
        self._predict_pulls = "spectrain" in mit and self.optimizer is None
        self._last_pulled: dict[str, Tensor] = {}  # spectrain, aggregation server: the weights last pulled

    # ---- the update bookkeeping, by the names callers use -----------------------------------------------
    @property
    def tracked(self) -> dict[str, Tensor]:
        """The tensors updates are recorded for: the parameters (with a local optimizer) and the ledgers."""
        return self.updates.tracked

    @property
    def baseline(self) -> dict[str, Tensor]:
        return self.updates.baseline

    @property
    def sums(self) -> Sums:
        """Own update sums per wave, until a pull contains them."""
        return self.updates.sums

    @property
    def gsums(self) -> Sums:
        """Aggregation server: gradient sums per wave."""
        return self.updates.gsums

    # ---- keys -------------------------------------------------------------------------------------
    def buffers(self) -> dict[str, Tensor]:
        """The stage's persistent buffers now (stage_buffers(self.module), through their slots)."""
        return self.buffer_slots.now()

    def kinds(self) -> dict[str, str]:
        """Every key this stage syncs with the PS and its kind (hetpipe.core.wsp.aggregation)."""
        return {
            **dict.fromkeys(self.params, "param"),
            **dict.fromkeys(self.ledgers, "ledger"),
            **dict.fromkeys(self.buffer_slots.names(), "buffer"),
        }

    def values(self) -> dict[str, Tensor]:
        """The current value of every synced key, buffers as float32 (what registration sends)."""
        return {**self.params, **self.ledgers, **{k: b.float() for k, b in self.buffers().items()}}

    @torch.no_grad()
    def load(self, values: Mapping[str, Tensor]) -> None:
        """Set every synced tensor (e.g. to the PS's W_0); resets the update baseline."""
        for key, t in {**self.params, **self.ledgers}.items():
            t.copy_(values[key])
        self.buffer_slots.replace(values)
        self.updates.reset_baseline()
        if self._predict_pulls:
            self._last_pulled = {k: t.detach().clone() for k, t in self.params.items()}
        self.versions.current = None

    def wave_of(self, minibatch: int) -> int:
        return minibatch // self.rules.nm

    # ---- forward / backward -----------------------------------------------------------------------
    def _compute(self) -> contextlib.AbstractContextManager:
        return self._autocast if self._autocast is not None else contextlib.nullcontext()

    def _recompute(self, p: int, flight: InFlight) -> None:
        if flight.weights is None:
            flight.weights = self.versions.corrected(p)
        with self.buffer_slots.kept():
            flight.output = self._run(flight.weights, flight.inputs, self.freezing.frozen_here(p), flight.ids)

    def _run(
        self, weights: Weights | None, inputs: Tensor, frozen: int = 0, ids: Sequence[int] | None = None
    ) -> Tensor:
        """The stage's layers on `inputs` (on the stashed `weights` when given); the first `frozen` of them
        without autograd and in eval mode, or their output kept by sample `ids` (frozen_cache)."""
        with self._compute():
            if weights is None:
                return self.frozen_cache.run(self.module, inputs, frozen, ids)
            with self._swap.using(weights):
                return self.frozen_cache.run(self.module, inputs, frozen, ids)

    def forward(
        self,
        p: int,
        inputs: Tensor,
        target: Tensor | None = None,
        loss_fn=None,
        input_grad: bool = True,
        ids: Sequence[int] | None = None,
    ) -> Tensor:
        """Forward of minibatch p (samples `ids`, for the frozen layers' cache); returns its output.
        `input_grad`: its backward gives the input's gradient (not on stage 0, nor after a frozen stage)."""
        if input_grad and inputs.is_floating_point() and not self.freezing.drops_input_gradient(p):
            inputs = inputs.detach().requires_grad_(True)
        weights = self.versions.for_forward(p)
        frozen = self.freezing.frozen_here(p)
        with torch.no_grad() if self.rules.recompute else contextlib.nullcontext():
            output = self._run(weights, inputs, frozen, ids)
        if self.rules.recompute:
            self.in_flight[p] = InFlight(inputs, None, weights, ids=ids)
            return output
        loss = loss_fn(output, target) if target is not None else None
        self.in_flight[p] = InFlight(inputs, output, weights, loss, ids)
        return output

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
            add_into(self.acc, [(key, g) for key, g in zip(names, grads, strict=False) if g is not None])
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
        self._retire(self.versions.drop_current())

    def _retire(self, weights: Weights | None) -> None:
        """Offer a stashed copy no forward may need any more for reuse (WeightVersions.retire)."""
        self.versions.retire(weights, (f.weights for f in self.in_flight.values()))

    # ---- the update -------------------------------------------------------------------------------
    @torch.no_grad()
    def update(self, p: int) -> None:
        """U p: apply the mean gradient of the pending backwards (p the last of them, all one wave)."""
        covered, count = self.pending, len(self.pending)
        wave = self.wave_of(p)
        if self.optimizer is not None:
            if self._scale_lr:
                set_lr(self.optimizer, _update_lr(self.rules, self.base_lr, self._lags.get(p), wave))
            if count > 1 and self.acc:  # the mean gradient; acc is ours, so in place
                torch._foreach_div_(list(self.acc.values()), float(count))
            for key, param in self.params.items():
                param.grad = self.acc.get(key)
            if self.rules.clip_grad_norm and self.acc:  # over this stage's gradients (docs/convergence.md)
                clip_grad_norm_(
                    [w for k, w in self.params.items() if k in self.acc], self.rules.clip_grad_norm
                )
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            self.freezing.release(p, self.optimizer, list(self.params))  # frozen layers' state goes
        elif self.params:  # aggregation server: the PS steps on the wave's mean gradient
            self.updates.add_gradients(wave, self.acc)
        self.acc, self.pending = {}, []
        if self.on_update is not None:
            self.on_update(covered)
        self.updates.record(wave)
        self._new_version()

    # ---- WSP --------------------------------------------------------------------------------------
    @torch.no_grad()
    def wave_push(self, wave: int, copy_buffers: bool = True) -> dict[str, Tensor]:
        """What PUSH `wave` sends, as tensors on this stage's device: parameter updates (or mean gradients),
        ledger updates and the buffers' current values (float32 copies; with `copy_buffers` false the buffers
        themselves, for a caller that copies them before the next forward moves them, as CUDA staging does in
        stream order)."""
        out = self.updates.push(wave)
        if self.optimizer is None:
            out.update(self.updates.mean_gradients(wave, self.params, self.rules.nm))
        out.update(float_copies(self.buffers()) if copy_buffers else self.buffers())
        return out

    def forget(self, through: int, pushed: int) -> None:
        """Drop own update sums of waves <= through; those of pushed waves <= pushed wait in host memory."""
        self.updates.forget(through, pushed)

    @torch.no_grad()
    def rebase(self, pulled: Mapping[str, Tensor], own_through: int, version: int | None = None) -> None:
        """weights = pulled global + own updates the snapshot does not contain yet (docs/wsp.md); buffers
        replaced out of place (buffers = "average"); aggregation server: weights = pulled. `version`: the
        pulled W_t, whose frozen parameters a pull leaves out (but the first, docs/wsp.md#freezing): their
        slots in `pulled` are stale and left alone."""
        pulled = self.freezing.carried(pulled, version, self.params)
        self.updates.rebase(pulled, own_through)
        if self.optimizer is None:
            self._take_pulled(pulled)
        if self.rules.buffers == "average":
            self.buffer_slots.replace(pulled)
        self._new_version()

    def _take_pulled(self, pulled: Mapping[str, Tensor]) -> None:
        """Aggregation server: weights = pulled; spectrain predicts D + 1 versions ahead,
        pulled + (pulled - last pulled) * (D + 1)."""
        ahead = float(self.rules.staleness + 1)
        for key, t in self.params.items():
            if self._predict_pulls:
                now = pulled[key].to(t.device, copy=True)
                t.copy_(now + (now - self._last_pulled[key]) * ahead)
                self._last_pulled[key] = now
            else:
                t.copy_(pulled[key])

    # ---- checkpoints (hetpipe train --resume; saving and the format: hetpipe.compute.stage_checkpoint) ----
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
        device = _device_of(self.params)
        stashes = restore_stage(self, meta, tensors, device)
        self.in_flight, outputs = {}, {}
        for saved in saved_flights(meta, tensors, stashes, device):
            p = saved.p
            flight = InFlight(saved.inputs, None, saved.weights)
            if saved.output or p in resend:
                with torch.set_grad_enabled(saved.output), self.buffer_slots.kept():
                    output = self._run(saved.weights, saved.inputs, self.freezing.frozen_here(p))
                    if saved.output:
                        flight.output = output
                        if saved.loss:
                            assert targets is not None and loss_fn is not None
                            flight.loss = loss_fn(output, targets[p])
                if p in resend:
                    outputs[p] = output.detach()
            self.in_flight[p] = flight
        return outputs


def _update_lr(rules: StageRules, base_lr: float, lag: Lag | None, wave: int) -> float:
    """The learning rate of an update of `wave`: the schedule's (hetpipe.core.pipeline.lr_schedule; base_lr
    when constant) x warmup x PipeMare T1 (hetpipe.core.pipeline.mitigation; `lag`: the minibatch's)."""
    lr = base_lr if rules.lr_schedule is None else lr_at(rules.lr_schedule, wave)
    factor = 1.0
    if "warmup" in rules.mitigation:
        factor *= warmup_lr_factor(wave, rules.num_vws, rules.warmup_waves)
    if "pipemare" in rules.mitigation:
        assert lag is not None
        factor *= pipemare_lr_factor(lag.update, wave, rules.warmup_waves)
    return lr * factor


def _device_of(params: Mapping[str, Tensor]) -> torch.device:
    """Where a stage's tensors live: its parameters' device (the CPU without parameters)."""
    return next(iter(params.values())).device if params else torch.device("cpu")
