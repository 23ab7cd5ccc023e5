"""A single-process reference of docs/schedules.md and docs/wsp.md: every stage of every VW, run in one
valid global order by the schedule's dependency rules, with `exact` pulls.

Plain and separate on purpose: it is the oracle the multi-process runtime is tested against bit for bit,
so its stage arithmetic is written here again, the textbook way (`loss.backward()` into `.grad`, a copy of
the weights per stashed forward), not shared with hetpipe.compute.stage_compute. What it shares is the
schedule (hetpipe.core.pipeline.schedule) and the PS's fold (hetpipe.core.wsp.aggregation). Its order of
operations:
  backward of p:   .grad accumulates (stashed forwards: live .grad = first stashed grad, then +=)
  U p:             .grad /= n (n > 1 backwards); optimizer step; the wave's updates are folded in together:
                   Δ = t - baseline; sums[wave] += Δ; baseline = t when a U of another wave comes and before
                   PUSH and WAIT (after each U under pipemare T2 and spectrain with SGD, which use each Δ)
                   (aggregation server: gsum[wave] += .grad, no step)
  PS:              W_{t+1} = fold(W_t, ((P_vw0 + P_vw1) + ...)), buffers averaged
  WAIT c:          t = W_{c-D-1} + own sums of waves > c-D-2 (in wave order); buffers replaced
  ps.wire_dtype:   bfloat16 rounds the weights (not buffers) of every push as it leaves a stage and of every
                   pull as it leaves the PS; the PS and the stages' own sums stay float32
A single VW skips WAIT when its own updates are applied locally (aggregation sum or mean).
Mitigations (train.mitigation, hetpipe.core.pipeline.mitigation), each written here again:
  warmup/pipemare: lr of U p = lr * (warm-up factor * PipeMare T1 factor), set before the step
  pipemare T2:     an unstashed backward recomputes on w - dc * s; dc = dc * gamma + Δ * (1 - gamma) after
                   each U
  spectrain:       a stashed forward runs on w + predicted step * s, s the lag of its version's first forward;
                   aggregation server: WAIT sets w = W + (W - last pulled W) * (D + 1)
  average:         WAIT adds own sums / VWs
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor
from torch.func import functional_call

from hetpipe.compute import data as datalib
from hetpipe.compute.build import dataset_of, model_of
from hetpipe.compute.optim import make_optimizer, predicted_step, set_lr
from hetpipe.compute.stage_compute import set_buffer, stage_buffers
from hetpipe.core.config import ClusterConfig
from hetpipe.core.pipeline.mitigation import Lag, dc_gamma, pipemare_lr_factor, stage_lags, warmup_lr_factor
from hetpipe.core.pipeline.schedule import BACKWARD, FORWARD, PUSH, UPDATE, WAIT, gate_of, get_schedule, needs
from hetpipe.core.protocol.wire import from_bfloat16_bits, to_bfloat16_bits
from hetpipe.core.wsp.aggregation import make_aggregation
from hetpipe.models import build_stage

__all__ = ["ReferenceResult", "run_reference"]


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


@dataclass
class ReferenceResult:
    stage_weights: dict[
        tuple[int, int], dict[str, Tensor]
    ]  # live parameters and buffers of every stage at the end
    ps_weights: dict[str, np.ndarray]  # W_{waves}, buffers averaged


def _tracked(st: RefStage, local: bool) -> dict[str, Tensor]:
    return dict(st.module.named_parameters()) if local else {}


def run_reference(
    config: ClusterConfig,
    splits: list[tuple[int, ...]],
    order_seed: int = 0,
    on_version: Callable[[int, dict[str, np.ndarray]], None] | None = None,
) -> ReferenceResult:
    """Train every VW of `splits` (layers per stage) by the config; `on_version(t, W_t)` sees each global
    version as the PS builds it (e.g. to score the weights wave by wave)."""
    torch.set_num_threads(1)
    spec = model_of(config)
    dataset = dataset_of(config)
    t, nm, D = config.train, config.wsp.nm, config.wsp.staleness
    kind = get_schedule(t.schedule)
    stashing = kind.stashing != "none" and t.weight_stashing
    recompute = t.recompute or (kind.stashing == "optional" and not t.weight_stashing)
    local = config.ps.aggregation != "server"
    mit = t.mitigations
    scale_lr = local and ("warmup" in mit or "pipemare" in mit)
    predict = "spectrain" in mit and local and stashing
    predict_pulls = "spectrain" in mit and not local
    correct = "pipemare" in mit and local and not stashing and recompute
    rule = make_aggregation(config.ps.aggregation, t.optimizer, t.lr, t.momentum, t.weight_decay)
    autocast = (
        (lambda: torch.autocast("cpu", dtype=torch.bfloat16))
        if t.precision == "bf16"
        else contextlib.nullcontext
    )
    num_vws = len(splits)
    packed = config.ps.wire_dtype == "bfloat16"

    def on_wire(a: np.ndarray) -> np.ndarray:
        return from_bfloat16_bits(to_bfloat16_bits(a)) if packed else a

    x, y = dataset.train.x, dataset.train.y
    shards = [datalib.shard_indices(len(y), num_vws, v, config.seed) for v in range(num_vws)]

    def batch(vw: int, p: int):
        return datalib.minibatch(x, y, shards[vw], t.batch_size, config.seed, p)

    stages: dict[tuple[int, int], RefStage] = {}
    for v, split in enumerate(splits):
        schedule = kind(len(split), nm, t.waves, D)
        for j in range(len(split)):
            start = sum(split[:j])
            module = build_stage(spec, start, start + split[j])
            opt = (
                make_optimizer(list(module.parameters()), t.optimizer, t.lr, t.momentum, t.weight_decay)
                if local
                else None
            )
            st = stages[(v, j)] = RefStage(module, opt, list(schedule.stages[j]), {})
            st.baseline = {k: w.detach().clone() for k, w in _tracked(st, local).items()}
            st.lags = stage_lags(schedule.stages[j])
            named = dict(module.named_parameters())
            if correct and opt is not None:
                st.dc = {k: torch.zeros_like(w) for k, w in named.items()}
            if predict and t.optimizer == "sgd":
                st.last_step = {}
            if predict_pulls:
                st.last_pulled = {k: w.detach().clone() for k, w in named.items()}

    @torch.no_grad()
    def fold(st: RefStage, params: dict[str, Tensor]) -> None:
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

    def state_of(st: RefStage) -> dict[str, Tensor]:
        return {
            **dict(st.module.named_parameters()),
            **{k: b.float() for k, b in stage_buffers(st.module).items()},
        }

    kinds = {
        k: ("param" if k in dict(st.module.named_parameters()) else "buffer")
        for st in stages.values()
        for k in state_of(st)
    }
    history = [
        {k: w.detach().numpy().copy() for st in stages.values() for k, w in state_of(st).items()}
    ]  # W_0
    pushes: dict[int, dict[int, dict[str, np.ndarray]]] = {}  # wave -> vw -> key -> what was pushed
    pushed = dict.fromkeys(stages, 0)
    acts: dict[tuple[int, int, int], Tensor] = {}  # (vw, stage, p) -> input activation waiting there
    grads: dict[tuple[int, int, int], Tensor] = {}  # (vw, stage, p) -> output gradient waiting there

    def c_global() -> int:
        return min(min(pushed[(v, j)] for j in range(len(splits[v]))) for v in range(num_vws))

    def build_versions() -> None:
        while len(history) - 1 < c_global():
            w = len(history) - 1
            new = {}
            for key, old in history[-1].items():
                parts = [pushes[w][v][key] for v in range(num_vws)]
                s = parts[0].copy()
                for part in parts[1:]:
                    s += part
                new[key] = rule.fold(key, kinds[key], old, s, num_vws).astype(np.float32, copy=False)
            history.append(new)
            if on_version is not None:
                on_version(len(history) - 1, new)

    def ready(sid: tuple[int, int]) -> bool:
        v, j = sid
        a = stages[sid].actions[stages[sid].pos]
        for _, other in needs(a, j, len(splits[v])):
            if other.kind == FORWARD and (v, j, a.index) not in acts:
                return False
            if other.kind == BACKWARD and (v, j, a.index) not in grads:
                return False
        gate = gate_of(a, D)
        return gate is None or (num_vws == 1 and local) or c_global() >= gate

    def forward(st: RefStage, inputs: Tensor, weights: dict[str, Tensor] | None) -> Tensor:
        with autocast():
            return (
                st.module(inputs)
                if weights is None
                else functional_call(st.module, weights, (inputs,), strict=False)
            )

    def step(sid: tuple[int, int]) -> None:
        v, j = sid
        st = stages[sid]
        a = st.actions[st.pos]
        st.pos += 1
        last = j == len(splits[v]) - 1
        params = dict(st.module.named_parameters())
        if a.kind == FORWARD:
            inputs = batch(v, a.index)[0] if j == 0 else acts.pop((v, j, a.index))
            if j > 0 and inputs.is_floating_point():
                inputs = inputs.detach().requires_grad_(True)
            weights = None
            if stashing:
                if st.version_lag is None:
                    st.version_lag = st.lags[a.index].update if predict else 0
                weights = {}
                for i, (k, w) in enumerate(params.items()):
                    ahead = None
                    if st.version_lag:
                        ahead = (
                            st.last_step.get(k)
                            if st.last_step is not None
                            else predicted_step(st.optimizer, i, w)
                        )
                    copy = w.detach().clone() if ahead is None else w.detach() + ahead * float(st.version_lag)
                    weights[k] = copy.requires_grad_(True)
            if recompute:
                with torch.no_grad():
                    out = forward(st, inputs, weights)
                st.saved[a.index] = (inputs, None, weights)
            else:
                out = forward(st, inputs, weights)
                st.saved[a.index] = (inputs, spec.loss(out, batch(v, a.index)[1]) if last else out, weights)
            if not last:
                acts[(v, j + 1, a.index)] = out.detach()
        elif a.kind == BACKWARD:
            inputs, root, weights = st.saved.pop(a.index)
            if root is None:  # recompute, leaving the running statistics as the first forward left them
                lag = st.lags[a.index].backward
                if weights is None and st.dc is not None and lag > 0:  # PipeMare T2
                    weights = {
                        k: (w.detach() - st.dc[k] * float(lag)).requires_grad_(True)
                        for k, w in params.items()
                    }
                kept = {k: b.detach().clone() for k, b in stage_buffers(st.module).items()}
                out = forward(st, inputs, weights)
                for key, value in kept.items():
                    set_buffer(st.module, key, value)
                root = spec.loss(out, batch(v, a.index)[1]) if last else out
            if root.requires_grad:  # a first stage without weights has nothing to differentiate
                root.backward(None if last else grads.pop((v, j, a.index)))
            else:
                grads.pop((v, j, a.index), None)
            if weights is not None:
                with torch.no_grad():
                    for k, w in params.items():
                        g = weights[k].grad
                        if g is not None:
                            w.grad = g if w.grad is None else w.grad + g
            st.covered += 1
            if j > 0:
                grads[(v, j - 1, a.index)] = inputs.grad
        elif a.kind == UPDATE:
            wave = a.index // nm
            with torch.no_grad():
                if local:
                    if st.covered > 1:
                        for w in params.values():
                            if w.grad is not None:
                                w.grad = w.grad / st.covered
                    if st.optimizer is not None:
                        if scale_lr:
                            factor = 1.0
                            if "warmup" in mit:
                                factor *= warmup_lr_factor(wave, num_vws, t.warmup_waves)
                            if "pipemare" in mit:
                                factor *= pipemare_lr_factor(st.lags[a.index].update, wave, t.warmup_waves)
                            set_lr(st.optimizer, t.lr * factor)
                        st.optimizer.step()
                        st.optimizer.zero_grad(set_to_none=True)
                    if st.open_wave is not None and st.open_wave != wave:
                        fold(st, params)
                    st.open_wave = wave
                    if st.dc is not None or st.last_step is not None:
                        fold(st, params)
                else:
                    gsum = st.gsums.setdefault(wave, {})
                    for k, w in params.items():
                        if w.grad is not None:
                            gsum[k] = gsum[k] + w.grad if k in gsum else w.grad.clone()
                        w.grad = None
            st.covered = 0
            st.version_lag = None
        elif a.kind == PUSH:
            out: dict[str, np.ndarray] = {}
            if local:
                fold(st, params)
                sums = st.sums.setdefault(a.index, {k: torch.zeros_like(w) for k, w in params.items()})
                out.update({k: d.detach().numpy().copy() for k, d in sums.items()})
            else:
                gsum = st.gsums.pop(a.index, {})
                out.update(
                    {
                        k: (gsum[k] / nm if k in gsum else torch.zeros_like(w)).detach().numpy().copy()
                        for k, w in params.items()
                    }
                )
            out = {k: on_wire(arr) for k, arr in out.items()}
            out.update({k: b.detach().float().numpy().copy() for k, b in stage_buffers(st.module).items()})
            pushes.setdefault(a.index, {}).setdefault(v, {}).update(out)
            pushed[sid] += 1
            build_versions()
        elif a.kind == WAIT and not (num_vws == 1 and local):
            version = gate_of(a, D)
            pulled = {k: on_wire(arr) if k in params else arr for k, arr in history[version].items()}
            with torch.no_grad():
                if local:
                    fold(st, params)
                for w in [w for w in st.sums if w <= version - 1]:
                    del st.sums[w]
                for k, w in params.items():
                    w.copy_(torch.from_numpy(pulled[k]))
                    if local:
                        for wave in sorted(st.sums):
                            w += (
                                st.sums[wave][k] / num_vws
                                if "average" in mit and num_vws > 1
                                else st.sums[wave][k]
                            )
                        st.baseline[k].copy_(w)
                    elif predict_pulls:  # SpecTrain with the PS's optimizer: D + 1 versions ahead of the pull
                        now = torch.from_numpy(pulled[k]).clone()
                        w.copy_(now + (now - st.last_pulled[k]) * float(D + 1))
                        st.last_pulled[k] = now
                st.version_lag = None
                if config.ps.buffers == "average":
                    for k, b in stage_buffers(st.module).items():
                        value = torch.from_numpy(pulled[k].copy())
                        set_buffer(
                            st.module, k, value.round().to(b.dtype) if not b.is_floating_point() else value
                        )

    rng = random.Random(order_seed)
    while any(s.pos < len(s.actions) for s in stages.values()):
        runnable = [sid for sid, s in stages.items() if s.pos < len(s.actions) and ready(sid)]
        if not runnable:
            raise RuntimeError("reference deadlocked: the schedules are invalid")
        step(rng.choice(runnable))
    return ReferenceResult(
        stage_weights={
            sid: {k: w.detach().clone() for k, w in state_of(s).items()} for sid, s in stages.items()
        },
        ps_weights=history[-1],
    )
