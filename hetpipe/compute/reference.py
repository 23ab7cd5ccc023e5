"""A single-process reference of docs/schedules.md and docs/wsp.md: every stage of every VW, run in one
valid global order by the schedule's dependency rules, with `exact` pulls.

Plain and separate on purpose: it is the oracle the multi-process runtime is tested against bit for bit,
so its stage arithmetic is written here again, the textbook way (`loss.backward()` into `.grad`, a copy of
the weights per stashed forward), not shared with hetpipe.compute.stage_compute. What it shares is the
schedule (hetpipe.core.pipeline.schedule); its PS (hetpipe.compute.reference_ps) folds by its own arithmetic
too. Its order of operations:
  backward of p:   .grad accumulates (stashed forwards: live .grad = first stashed grad, then +=)
  U p:             .grad /= n (n > 1 backwards); optimizer step; the wave's updates are folded in together:
                   Δ = t - baseline; sums[wave] += Δ; baseline = t when a U of another wave comes and before
                   PUSH and WAIT (after each U under pipemare T2 and spectrain with SGD, which use each Δ)
                   (aggregation server: gsum[wave] += .grad, no step)
  PS:              W_{t+1} = fold(W_t, ((P_vw0 + P_vw1) + ...)), buffers averaged; under per-VW work (VW v's
                   wave: nm_v minibatches of b_v samples) buffers and a mean or server fold weigh each VW's
                   push by its samples per wave (hetpipe.compute.reference_ps)
  WAIT c:          t = W_{c-D-1} + own sums of waves > c-D-2 (in wave order); buffers replaced
  ps.wire_dtype:   bfloat16 rounds the weights (not buffers) of every push as it leaves a stage and of every
                   pull as it leaves the PS; the PS and the stages' own sums stay float32; under node
                   aggregation the relay rounds its group's sum of those pushes again as it leaves the node
A single VW skips WAIT when its own updates are applied locally (hetpipe.core.wsp.aggregation.needs_pulls).
The schedule's modes and the aggregation rule's traits come from their registries; "aggregation server" below
stands for any rule whose optimizer runs at the PS.
Mitigations (train.mitigation, hetpipe.core.pipeline.mitigation), each written here again:
  warmup/pipemare: lr of U p = lr * (warm-up factor * PipeMare T1 factor), set before the step
  lr_schedule:     lr above = the schedule's lr of U p's wave (hetpipe.core.pipeline.lr_schedule)
  clip_grad_norm:  after .grad /= n, before the step: .grad *= min(1, max / (||(||g_k||)_k|| + 1e-6)), the
                   norms over the stage's own parameters (the VW's other stages are not part of it)
  train.loss:      the last stage's loss (hetpipe.compute.losses)
  train.freeze:    a minibatch of a wave with the model's first n layers frozen runs them layer by layer, each
                   in eval mode under no_grad (no .grad, so the optimizer skips them); a stage all frozen
                   waits for no output gradient and its successor stores none
  pipemare T2:     an unstashed backward recomputes on w - dc * s; dc = dc * gamma + Δ * (1 - gamma) after
                   each U
  spectrain:       a stashed forward runs on w + predicted step * s, s the lag of its version's first forward;
                   aggregation server: WAIT sets w = W + (W - last pulled W) * (D + 1)
  average:         WAIT adds own sums / VWs
Planned spans (VWs that train waves [start, end) only): a VW's actions are those of a run of `end` waves
from `start` on; wave t's minibatches come from the shards of the VWs training t; the PS sums wave t over
those VWs; a VW starting at s > 0 where n VWs end runs nothing until the (i mod n)-th of them (i: its place
among the VWs starting at s) has run all its actions, then takes that VW's optimizer state by parameter name.
"""

from __future__ import annotations

import contextlib
import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor
from torch.func import functional_call

from hetpipe.compute import data as datalib
from hetpipe.compute.build import dataset_of, model_of
from hetpipe.compute.losses import loss_function
from hetpipe.compute.optim import make_optimizer, predicted_step, set_lr
from hetpipe.compute.reference_autofreeze import ReferenceAutoFreeze
from hetpipe.compute.reference_ps import ReferencePS
from hetpipe.compute.stage_buffers import set_buffer, stage_buffers
from hetpipe.compute.stage_freezing import auto_freeze_state
from hetpipe.core.config.schema import ClusterConfig, TrainConfig
from hetpipe.core.pipeline.lr_schedule import lr_at
from hetpipe.core.pipeline.mitigation import Lag, dc_gamma, pipemare_lr_factor, stage_lags, warmup_lr_factor
from hetpipe.core.pipeline.schedule import (
    BACKWARD,
    FORWARD,
    PUSH,
    UPDATE,
    WAIT,
    Action,
    gate_of,
    get_schedule,
    needs,
)
from hetpipe.core.protocol.wire import from_bfloat16_bits, to_bfloat16_bits
from hetpipe.core.wsp.aggregation import get_aggregation, make_aggregation, needs_pulls
from hetpipe.core.wsp.freezing import FreezeSchedule
from hetpipe.models import build_stage

__all__ = ["ReferenceResult", "run_reference"]

StageId = tuple[int, int]  # (vw, stage)


@dataclass
class RefStage:
    module: torch.nn.Module
    optimizer: torch.optim.Optimizer | None
    actions: list
    baseline: dict[str, Tensor]
    sums: dict[int, dict[str, Tensor]] = field(default_factory=dict)
    gsums: dict[int, dict[str, Tensor]] = field(default_factory=dict)
    saved: dict[int, tuple] = field(
        default_factory=dict
    )  # p -> (inputs, output/loss or None, stashed weights)
    covered: int = 0  # backwards since the last update
    pos: int = 0
    lags: dict[int, Lag] = field(default_factory=dict)
    version_lag: int | None = None  # spectrain: the lag of the current weight version's first forward
    dc: dict[str, Tensor] | None = None  # PipeMare T2's moving average of updates
    last_step: dict[str, Tensor] | None = None  # spectrain with plain SGD: the last update
    last_pulled: dict[str, Tensor] = field(default_factory=dict)  # spectrain with aggregation server
    open_wave: int | None = None  # the wave whose updates since the baseline are not in sums yet
    start: int = 0  # the model's layers [start, stop) are this stage's
    stop: int = 0
    takes_from: int | None = None  # a re-plan's VW: the VW whose optimizer state it starts with, until taken
    kept: _Kept | None = None  # train.freeze_cache_mib: the frozen layers' outputs by sample


@dataclass
class _Kept:
    """A stage's frozen layers' outputs by sample (train.freeze_cache_mib), kept for one frozen count and
    the frozen layers' tensors they were computed with."""

    limit: int
    rows: dict[int, Tensor] = field(default_factory=dict)
    size: int = 0
    frozen: int = 0
    made_with: list[Tensor] = field(default_factory=list)


@dataclass
class ReferenceResult:
    stage_weights: dict[StageId, dict[str, Tensor]]  # live parameters and buffers of every stage at the end
    ps_weights: dict[str, np.ndarray]  # W_{waves}, buffers averaged
    freeze: tuple[tuple[int, int], ...] = ()  # the freeze points (wave, layers): train.freeze's, or decided


@dataclass(frozen=True)
class _Flags:
    """What the config asks of every stage, derived once from the schedule's modes, the aggregation rule's
    traits and the mitigations."""

    stashing: bool
    recompute: bool
    local: bool  # the stages run the optimizer (else the PS does, on the VWs' mean gradients)
    pulls: bool  # WAITs pull (else a lone VW skips them)
    waits: bool  # WAITs gate: they pull, or (autofreeze) a lone VW's take W_{c-D-1}'s movement (measure) only
    scale_lr: bool  # warmup, pipemare or an lr_schedule set the learning rate of every update
    predict: bool  # spectrain: stashed versions predicted ahead
    predict_pulls: bool  # spectrain with the PS's optimizer: pulls predicted ahead
    correct: bool  # pipemare T2: unstashed recomputed backwards corrected

    @classmethod
    def of(cls, config: ClusterConfig, num_vws: int) -> _Flags:
        t = config.train
        modes = get_schedule(t.schedule).modes(t.weight_stashing, t.recompute)
        rule = get_aggregation(config.ps.aggregation)
        local, mit = rule.local_optimizer, t.mitigations
        return cls(
            stashing=modes.stashing,
            recompute=modes.recompute,
            local=local,
            pulls=needs_pulls(num_vws, rule),
            waits=needs_pulls(num_vws, rule) or bool(t.autofreeze_every),
            scale_lr=local and ("warmup" in mit or "pipemare" in mit or t.lr_schedule != "constant"),
            predict="spectrain" in mit and local and modes.stashing,
            predict_pulls="spectrain" in mit and not local,
            correct="pipemare" in mit and local and not modes.stashing and modes.recompute,
        )


def _state_of(st: RefStage) -> dict[str, Tensor]:
    """A stage's synced tensors: its parameters and its buffers as float32."""
    return {
        **dict(st.module.named_parameters()),
        **{k: b.float() for k, b in stage_buffers(st.module).items()},
    }


def _node_groups(config: ClusterConfig) -> list[list[int]]:
    """Node-local aggregation's groups, worked out here from the listed VWs' GPUs: on each node the VWs that
    sit wholly on it (a group when two or more), every other VW alone; ordered by their first VW."""
    on_node: dict[str, list[int]] = {}
    groups = []
    for v, vw in enumerate(config.virtual_workers):
        nodes = sorted({str(g).split(":")[0] for g in vw.gpus})
        if len(nodes) == 1:
            on_node.setdefault(nodes[0], []).append(v)
        else:
            groups.append([v])
    return sorted(groups + list(on_node.values()))


def _planned_spans(config: ClusterConfig, num_vws: int) -> list[tuple[int, int]]:
    """Each VW's waves [start, end): the listed VWs' `waves`, else the whole run."""
    listed = config.virtual_workers if len(config.virtual_workers) == num_vws else ()
    return [
        (vw.waves or (0, config.train.waves)) if listed else (0, config.train.waves)
        for vw in (listed or range(num_vws))
    ]


class _Reference:
    """Every stage of every VW in one process; `step` runs one stage's next action (a dispatch table by
    kind)."""

    def __init__(
        self,
        config: ClusterConfig,
        splits: list[tuple[int, ...]],
        on_version: Callable[[int, dict[str, np.ndarray]], None] | None,
        work: list[tuple[int, int]] | None = None,
    ) -> None:
        self.config, self.splits = config, splits
        self.spec = model_of(config)
        self.loss_fn = loss_function(config.train.loss)
        self.t, self.D = config.train, config.wsp.staleness
        self.lr_schedule = self.t.schedule_of_lr
        self.freeze = self.t.freeze_schedule
        self.auto = ReferenceAutoFreeze(auto_freeze_state(config))  # train.autofreeze: decides `freeze`
        self.num_vws = len(splits)
        work = work or [(config.wsp.nm, config.train.batch_size)] * self.num_vws
        self.nms, self.batches = [nm for nm, _ in work], [b for _, b in work]
        samples = [nm * b for nm, b in work]
        unit = math.gcd(*samples)
        self.weights = [n // unit for n in samples]  # each VW's samples per wave over the common divisor
        self.flags = _Flags.of(config, self.num_vws)
        self.autocast = (
            (lambda: torch.autocast("cpu", dtype=torch.bfloat16))
            if self.t.precision == "bf16"
            else contextlib.nullcontext
        )
        self.packed = config.ps.wire_dtype == "bfloat16"
        dataset = dataset_of(config)
        self.x, self.y = dataset.train.x, dataset.train.y
        self.spans = _planned_spans(config, self.num_vws)
        self.shards: dict[tuple[int, ...], list[np.ndarray]] = {}  # VWs training a wave -> their shards
        self.stages = _build_stages(self)
        t = self.t
        rule = make_aggregation(config.ps.aggregation, t.optimizer, t.lr, t.momentum, t.weight_decay)
        kinds = {
            k: ("param" if k in dict(st.module.named_parameters()) else "buffer")
            for st in self.stages.values()
            for k in _state_of(st)
        }
        initial = {
            k: w.detach().numpy().copy() for st in self.stages.values() for k, w in _state_of(st).items()
        }
        groups = _node_groups(config) if config.ps.node_aggregation else None
        wire = self.on_wire if self.packed else None
        self.ps = ReferencePS(
            initial, kinds, splits, rule, on_version, self.weights, groups, wire, self.spans
        )
        self.acts: dict[tuple[int, int, int], Tensor] = {}  # (vw, stage, p) -> input activation waiting there
        self.grads: dict[tuple[int, int, int], Tensor] = {}  # (vw, stage, p) -> output gradient waiting there
        self.dispatch: dict[str, Callable[[int, int, RefStage, Action], None]] = {
            FORWARD: self.forward,
            BACKWARD: self.backward,
            UPDATE: self.update,
            PUSH: self.push,
            WAIT: self.wait,
        }

    # ---- order -----------------------------------------------------------------------------------
    def batch(self, vw: int, p: int):
        """Minibatch p of VW vw: the VWs training p's wave split the data, in VW order, by their weights."""
        return datalib.minibatch(self.x, self.y, self.shard(vw, p), self.batches[vw], self.config.seed, p)

    def shard(self, vw: int, p: int) -> np.ndarray:
        """VW vw's share of the training set in minibatch p's wave (each set of VWs' shares made once)."""
        wave = p // self.nms[vw]
        live = tuple(u for u, (start, end) in enumerate(self.spans) if start <= wave < end)
        if live not in self.shards:
            share = [self.weights[u] for u in live]
            self.shards[live] = [
                datalib.shard_indices(len(self.y), len(live), i, self.config.seed, share)
                for i in range(len(live))
            ]
        return self.shards[live][live.index(vw)]

    def on_wire(self, a: np.ndarray) -> np.ndarray:
        return from_bfloat16_bits(to_bfloat16_bits(a)) if self.packed else a

    def ready(self, sid: StageId) -> bool:
        v, j = sid
        source = self.stages[sid].takes_from
        if source is not None and any(
            self.stages[(source, k)].pos < len(self.stages[(source, k)].actions)
            for k in range(len(self.splits[source]))
        ):
            return False  # a re-plan's VW starts once the VW whose optimizer state it takes is done
        a = self.stages[sid].actions[self.stages[sid].pos]
        for _, other in needs(a, j, len(self.splits[v])):
            if other.kind == FORWARD and (v, j, a.index) not in self.acts:
                return False
            trains = _trains(self.freeze, self.stages[sid], a.index // self.nms[v])
            if other.kind == BACKWARD and (v, j, a.index) not in self.grads and trains:
                return False
        gate = gate_of(a, self.D)
        return gate is None or not self.flags.waits or self.ps.c_global() >= gate

    def step(self, sid: StageId) -> None:
        st = self.stages[sid]
        if st.takes_from is not None:
            _take_optimizer_state(st, [s for (u, _), s in self.stages.items() if u == st.takes_from])
        a = st.actions[st.pos]
        st.pos += 1
        self.dispatch[a.kind](*sid, st, a)

    def run_forward(
        self, st: RefStage, inputs: Tensor, weights: dict[str, Tensor] | None, frozen: int, v: int, p: int
    ) -> Tensor:
        ids = self.sample_ids(v, p) if frozen and st.kept is not None else None
        with self.autocast():
            return _run_stage(st.module, inputs, weights, frozen, st.kept, ids)

    def sample_ids(self, vw: int, p: int) -> list[int]:
        """The training-set indices of minibatch p of VW vw (as batch() picks them)."""
        picked = datalib.minibatch_indices(self.shard(vw, p), self.batches[vw], self.config.seed, p)
        return [int(i) for i in picked]

    def input_gradient(self, v: int, j: int, p: int) -> bool:
        """Whether stage (v, j) hands its input's gradient back for minibatch p (stage j - 1 trains)."""
        return j > 0 and _trains(self.freeze, self.stages[(v, j - 1)], p // self.nms[v])

    def last(self, v: int, j: int) -> bool:
        return j == len(self.splits[v]) - 1

    # ---- F and B ---------------------------------------------------------------------------------
    def forward(self, v: int, j: int, st: RefStage, a: Action) -> None:
        inputs = self.batch(v, a.index)[0] if j == 0 else self.acts.pop((v, j, a.index))
        if self.input_gradient(v, j, a.index) and inputs.is_floating_point():
            inputs = inputs.detach().requires_grad_(True)
        weights = self.stashed_version(st, a.index) if self.flags.stashing else None
        last = self.last(v, j)
        frozen = _frozen_layers(self.freeze, st, a.index // self.nms[v])
        if self.flags.recompute:
            with torch.no_grad():
                out = self.run_forward(st, inputs, weights, frozen, v, a.index)
            st.saved[a.index] = (inputs, None, weights)
        else:
            out = self.run_forward(st, inputs, weights, frozen, v, a.index)
            st.saved[a.index] = (
                inputs,
                self.loss_fn(out, self.batch(v, a.index)[1]) if last else out,
                weights,
            )
        if not last:
            self.acts[(v, j + 1, a.index)] = out.detach()

    def stashed_version(self, st: RefStage, p: int) -> dict[str, Tensor]:
        """A copy of the weights for the forward of p (spectrain: predicted its version's lag ahead)."""
        if st.version_lag is None:
            st.version_lag = st.lags[p].update if self.flags.predict else 0
        weights = {}
        for i, (k, w) in enumerate(st.module.named_parameters()):
            ahead = None
            if st.version_lag:
                ahead = (
                    st.last_step.get(k) if st.last_step is not None else predicted_step(st.optimizer, i, w)
                )
            copy = w.detach().clone() if ahead is None else w.detach() + ahead * float(st.version_lag)
            weights[k] = copy.requires_grad_(True)
        return weights

    def backward(self, v: int, j: int, st: RefStage, a: Action) -> None:
        params = dict(st.module.named_parameters())
        last = self.last(v, j)
        inputs, root, weights = st.saved.pop(a.index)
        if root is None:  # recompute, leaving the running statistics as the first forward left them
            lag = st.lags[a.index].backward
            if weights is None and st.dc is not None and lag > 0:  # PipeMare T2
                weights = {
                    k: (w.detach() - st.dc[k] * float(lag)).requires_grad_(True) for k, w in params.items()
                }
            kept = {k: b.detach().clone() for k, b in stage_buffers(st.module).items()}
            out = self.run_forward(
                st, inputs, weights, _frozen_layers(self.freeze, st, a.index // self.nms[v]), v, a.index
            )
            for key, value in kept.items():
                set_buffer(st.module, key, value)
            root = self.loss_fn(out, self.batch(v, a.index)[1]) if last else out
        if root.requires_grad:  # a first stage without weights has nothing to differentiate
            root.backward(None if last else self.grads.pop((v, j, a.index)))
        else:
            self.grads.pop((v, j, a.index), None)
        if weights is not None:
            with torch.no_grad():
                for k, w in params.items():
                    g = weights[k].grad
                    if g is not None:
                        w.grad = g if w.grad is None else w.grad + g
        st.covered += 1
        if self.input_gradient(v, j, a.index):
            self.grads[(v, j - 1, a.index)] = inputs.grad

    # ---- U, PUSH, WAIT ---------------------------------------------------------------------------
    @torch.no_grad()
    def update(self, v: int, j: int, st: RefStage, a: Action) -> None:
        params = dict(st.module.named_parameters())
        wave = a.index // self.nms[v]
        if self.flags.local:
            if st.covered > 1:
                for w in params.values():
                    if w.grad is not None:
                        w.grad = w.grad / st.covered
            if st.optimizer is not None:
                if self.flags.scale_lr:
                    set_lr(
                        st.optimizer,
                        lr_at(self.lr_schedule, wave) * _lr_factor(self.t, self.num_vws, st, a.index, wave),
                    )
                if self.t.clip_grad_norm:
                    clip(params, self.t.clip_grad_norm)
                st.optimizer.step()
                st.optimizer.zero_grad(set_to_none=True)
            if st.open_wave is not None and st.open_wave != wave:
                self.fold(st, params)
            st.open_wave = wave
            if st.dc is not None or st.last_step is not None:
                self.fold(st, params)
        else:
            gsum = st.gsums.setdefault(wave, {})
            for k, w in params.items():
                if w.grad is not None:
                    gsum[k] = gsum[k] + w.grad if k in gsum else w.grad.clone()
                w.grad = None
        st.covered = 0
        st.version_lag = None

    @torch.no_grad()
    def fold(self, st: RefStage, params: dict[str, Tensor]) -> None:
        """The updates since the baseline into their wave's sum: Δ = t - baseline; sums[wave] += Δ;
        baseline = t."""
        if st.open_wave is None:
            return
        sums = st.sums.setdefault(st.open_wave, {})
        gamma = dc_gamma(max(lag.backward for lag in st.lags.values())) if st.dc is not None else 0.0
        for k, w in params.items():
            delta = w - st.baseline[k]
            if st.dc is not None:
                st.dc[k].mul_(gamma).add_(delta, alpha=1 - gamma)
            if st.last_step is not None:
                st.last_step[k] = delta.clone()
            sums[k] = sums[k] + delta if k in sums else delta
            st.baseline[k].copy_(w)
        st.open_wave = None

    def push(self, v: int, j: int, st: RefStage, a: Action) -> None:
        params = dict(st.module.named_parameters())
        out: dict[str, np.ndarray] = {}
        if self.flags.local:
            self.fold(st, params)
            sums = st.sums.setdefault(a.index, {k: torch.zeros_like(w) for k, w in params.items()})
            out.update({k: d.detach().numpy().copy() for k, d in sums.items()})
        else:
            gsum = st.gsums.pop(a.index, {})
            out.update(
                {
                    k: (gsum[k] / self.nms[v] if k in gsum else torch.zeros_like(w)).detach().numpy().copy()
                    for k, w in params.items()
                }
            )
        out = {k: self.on_wire(arr) for k, arr in out.items()}
        out.update({k: b.detach().float().numpy().copy() for k, b in stage_buffers(st.module).items()})
        self.ps.push((v, j), a.index, out)

    def wait(self, v: int, j: int, st: RefStage, a: Action) -> None:
        version = gate_of(a, self.D)
        self.freeze = self.auto.measure(self.ps.history, self.ps.kinds, version) or self.freeze  # before c
        if not self.flags.pulls:
            return
        params = dict(st.module.named_parameters())
        pulled = {k: self.on_wire(arr) if k in params else arr for k, arr in self.ps.history[version].items()}
        with torch.no_grad():
            if self.flags.local:
                self.fold(st, params)
            for w in [w for w in st.sums if w <= version - 1]:
                del st.sums[w]
            for k, w in params.items():
                w.copy_(torch.from_numpy(pulled[k]))
                self.rebase(st, k, w, pulled[k])
            st.version_lag = None
            if self.config.ps.buffers == "average":
                for k, b in stage_buffers(st.module).items():
                    value = torch.from_numpy(pulled[k].copy())
                    set_buffer(
                        st.module, k, value.round().to(b.dtype) if not b.is_floating_point() else value
                    )

    def rebase(self, st: RefStage, k: str, w: Tensor, pulled: np.ndarray) -> None:
        """After w = pulled: the own sums the pull does not hold yet (average: their share), or spectrain's
        prediction of the PS's weights D + 1 versions ahead."""
        average = "average" in self.t.mitigations and self.num_vws > 1
        if self.flags.local:
            for wave in sorted(st.sums):
                w += st.sums[wave][k] / self.num_vws if average else st.sums[wave][k]
            st.baseline[k].copy_(w)
        elif self.flags.predict_pulls:  # SpecTrain with the PS's optimizer: D + 1 versions ahead of the pull
            now = torch.from_numpy(pulled).clone()
            w.copy_(now + (now - st.last_pulled[k]) * float(self.D + 1))
            st.last_pulled[k] = now


def _build_stages(ref: _Reference) -> dict[StageId, RefStage]:
    """Every stage of every VW: its layers, a fresh optimizer, its actions (a VW with a planned span: those of
    its waves, from a schedule that ends at its end)."""
    t, f = ref.t, ref.flags
    kind = get_schedule(t.schedule)
    stages: dict[StageId, RefStage] = {}
    sources = {}  # a VW starting at s > 0 takes the optimizer state of the (i mod n)-th of the n ending there
    for s in sorted({start for start, _ in ref.spans if start > 0}):
        ending = [u for u, (_, end) in enumerate(ref.spans) if end == s]
        starting = [v for v, (start, _) in enumerate(ref.spans) if start == s]
        sources.update({v: ending[i % len(ending)] for i, v in enumerate(starting)} if ending else {})
    path = ref.config.model.init  # [model] init, read once
    init = torch.load(path, map_location="cpu", weights_only=True) if path else None
    for v, split in enumerate(ref.splits):
        start_wave, end_wave = ref.spans[v]
        schedule = kind(len(split), ref.nms[v], end_wave, ref.D)
        for j in range(len(split)):
            start = sum(split[:j])
            module = build_stage(ref.spec, start, start + split[j])
            if init is not None:  # [model] init: the stage's weights and buffers from the file
                module.load_state_dict({k: init[k] for k in module.state_dict()})
            opt = (
                make_optimizer(list(module.parameters()), t.optimizer, t.lr, t.momentum, t.weight_decay)
                if f.local
                else None
            )
            actions = [  # PUSH c and WAIT c name their wave, F, B and U a minibatch
                a
                for a in schedule.stages[j]
                if (a.index if a.kind in (PUSH, WAIT) else a.index // ref.nms[v]) >= start_wave
            ]
            st = stages[(v, j)] = RefStage(module, opt, actions, {})
            if t.freezes and t.freeze_cache_mib:
                st.kept = _Kept(t.freeze_cache_mib * 2**20)
            st.takes_from = sources.get(v) if opt is not None else None
            st.start, st.stop = start, start + split[j]
            named = dict(module.named_parameters())
            st.baseline = {k: w.detach().clone() for k, w in named.items()} if f.local else {}
            st.lags = stage_lags(schedule.stages[j])
            if f.correct and opt is not None:
                st.dc = {k: torch.zeros_like(w) for k, w in named.items()}
            if f.predict and t.optimizer == "sgd":
                st.last_step = {}
            if f.predict_pulls:
                st.last_pulled = {k: w.detach().clone() for k, w in named.items()}
    return stages


def _take_optimizer_state(st: RefStage, sources: list[RefStage]) -> None:
    """Set the stage's optimizer state, parameter by parameter (by name), to what the source VW's stage
    holding that parameter has at its end; once."""
    held = {  # parameter name -> its state in the source stage that holds it
        key: src.optimizer.state[i]
        for src in sources
        if src.optimizer is not None
        for i, (key, _) in enumerate(src.module.named_parameters())
        if i in src.optimizer.state
    }
    for i, (key, _) in enumerate(st.module.named_parameters()):
        if key in held:
            st.optimizer.state[i] = {n: t.detach().clone() for n, t in held[key].items()}
    st.takes_from = None


def _run_stage(
    module: torch.nn.Module,
    inputs: Tensor,
    weights: dict[str, Tensor] | None,
    frozen: int,
    kept: _Kept | None = None,
    ids: list[int] | None = None,
) -> Tensor:
    """The stage on `inputs` (on the stashed `weights` when given); with `frozen` > 0 layer by layer, its
    first `frozen` layers each in eval mode without autograd, their output for samples `ids` the rows `kept`
    where it holds them (computed for the others, whose rows it keeps while they fit)."""
    if not frozen:
        return (
            module(inputs) if weights is None else functional_call(module, weights, (inputs,), strict=False)
        )
    children = list(module.named_children())

    def own(name: str) -> dict[str, Tensor] | None:
        if weights is None:
            return None
        return {k[len(name) + 1 :]: w for k, w in weights.items() if k.startswith(f"{name}.")}

    def call(name: str, layer: torch.nn.Module, x: Tensor) -> Tensor:
        mine = own(name)
        return layer(x) if mine is None else functional_call(layer, mine, (x,), strict=False)

    def frozen_part(x: Tensor) -> Tensor:
        for name, layer in children[:frozen]:
            layer.eval()
            with torch.no_grad():
                x = call(name, layer, x)
            layer.train()
        return x

    if kept is None or ids is None:
        x = frozen_part(inputs)
    else:
        used = []  # what the frozen layers compute with: the weights they run on and their buffers
        for name, layer in children[:frozen]:
            mine = own(name) or {}
            used += [mine.get(k, w).detach() for k, w in layer.named_parameters()]
            used += [b.detach() for b in layer.buffers()]
        same = len(used) == len(kept.made_with) and all(
            a.shape == b.shape and torch.equal(a, b) for a, b in zip(used, kept.made_with, strict=True)
        )
        if frozen != kept.frozen or not same:
            kept.rows, kept.size, kept.frozen = {}, 0, frozen
            kept.made_with = [t.clone() for t in used]
        new = [j for j, i in enumerate(ids) if i not in kept.rows]  # run the frozen layers on these only
        fresh = iter(frozen_part(inputs[new]) if new else ())  # their rows, in the minibatch's order
        out = []
        for i in ids:
            if i in kept.rows:
                out.append(kept.rows[i])
                continue
            row = next(fresh)
            out.append(row)
            if kept.size + row.numel() * row.element_size() <= kept.limit:
                kept.rows[i] = row.clone()
                kept.size += row.numel() * row.element_size()
        x = torch.stack(out)
    for name, layer in children[frozen:]:
        x = call(name, layer, x)
    return x


def _frozen_layers(freeze: FreezeSchedule, st: RefStage, wave: int) -> int:
    """How many of the stage's layers run frozen in `wave` (train.freeze)."""
    return min(max(freeze.frozen(wave) - st.start, 0), st.stop - st.start)


def _trains(freeze: FreezeSchedule, st: RefStage, wave: int) -> bool:
    """Whether some layer of the stage trains in `wave` (else its B has nothing to do)."""
    return _frozen_layers(freeze, st, wave) < st.stop - st.start


def _lr_factor(t: TrainConfig, num_vws: int, st: RefStage, p: int, wave: int) -> float:
    """warmup x PipeMare T1 for the update of minibatch p."""
    mit = t.mitigations
    factor = 1.0
    if "warmup" in mit:
        factor *= warmup_lr_factor(wave, num_vws, t.warmup_waves)
    if "pipemare" in mit:
        factor *= pipemare_lr_factor(st.lags[p].update, wave, t.warmup_waves)
    return factor


def clip(params: dict[str, Tensor], max_norm: float) -> None:
    """The stage's gradients scaled by min(1, max_norm / (norm + 1e-6)), norm the 2-norm of the norms of its
    parameters' gradients (torch.nn.utils.clip_grad_norm_'s arithmetic)."""
    grads = {k: w.grad for k, w in params.items() if w.grad is not None}
    if not grads:
        return
    norm = torch.linalg.vector_norm(
        torch.stack([torch.linalg.vector_norm(g, 2.0) for g in grads.values()]), 2.0
    )
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for k, g in grads.items():
        params[k].grad = g * coef


def run_reference(
    config: ClusterConfig,
    splits: list[tuple[int, ...]],
    order_seed: int = 0,
    on_version: Callable[[int, dict[str, np.ndarray]], None] | None = None,
    work: list[tuple[int, int]] | None = None,
) -> ReferenceResult:
    """Train every VW of `splits` (layers per stage) by the config, each stage's next action at a time in a
    random valid order (`order_seed`); `on_version(t, W_t)` sees each global version as the PS builds it (e.g.
    to score the weights wave by wave); `work`: each VW's (Nm, minibatch size), by default the config's."""
    torch.set_num_threads(1)
    ref = _Reference(config, splits, on_version, work)
    rng = random.Random(order_seed)
    stages = ref.stages
    while any(s.pos < len(s.actions) for s in stages.values()):
        runnable = [sid for sid, s in stages.items() if s.pos < len(s.actions) and ref.ready(sid)]
        if not runnable:
            raise RuntimeError("reference deadlocked: the schedules are invalid")
        ref.step(rng.choice(runnable))
    return ReferenceResult(
        stage_weights={
            sid: {k: w.detach().clone() for k, w in _state_of(s).items()} for sid, s in stages.items()
        },
        ps_weights=ref.ps.history[-1],
        freeze=tuple((p.wave, p.layers) for p in ref.freeze.points),
    )
