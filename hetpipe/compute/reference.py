"""A single-process reference of hetpipe.md §2-3: every stage of every VW, run in one valid global order.

Small and plain on purpose: it is the oracle the multi-process runtime is tested against bit for bit
(with `exact` pulls). Its arithmetic follows the same fixed order the runtime documents:
  stage, after each optimizer step:  Δ = t - baseline; sums[wave] += Δ; baseline = t
  PS:                                W_{t+1} = W_t + ((Δ_vw0 + Δ_vw1) + ...)
  stage, at WAIT c:                  t = W_{c-D-1} + own sums of waves > c-D-2 (in wave order)
A single VW skips WAIT (its global weights hold only its own updates, already in its live weights).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor
from torch.func import functional_call

from hetpipe.compute import data as datalib
from hetpipe.compute.build import dataset_of, model_of
from hetpipe.compute.stage_compute import make_optimizer, synced_tensors
from hetpipe.core.config import ClusterConfig
from hetpipe.core.schedule import get_schedule
from hetpipe.models import build_stage

__all__ = ["ReferenceResult", "run_reference"]


@dataclass
class RefStage:
    module: torch.nn.Module
    optimizer: torch.optim.Optimizer | None
    actions: list
    baseline: dict[str, Tensor]
    sums: dict[int, dict[str, Tensor]] = field(default_factory=dict)
    saved: dict[int, tuple] = field(default_factory=dict)  # p -> (inputs, output or loss, stashed weights)
    pos: int = 0


@dataclass
class ReferenceResult:
    stage_weights: dict[tuple[int, int], dict[str, Tensor]]  # live weights of every stage at the end
    ps_weights: dict[str, np.ndarray]  # W_{waves}


def run_reference(config: ClusterConfig, splits: list[tuple[int, ...]], order_seed: int = 0,
                  on_version: Callable[[int, dict[str, np.ndarray]], None] | None = None) -> ReferenceResult:
    """Train every VW of `splits` (layers per stage) by the config; `on_version(t, W_t)` sees each global
    version as the PS would fold it (e.g. to score the weights wave by wave)."""
    torch.set_num_threads(1)
    spec = model_of(config)
    dataset = dataset_of(config)
    t, nm, D = config.train, config.wsp.nm, config.wsp.staleness
    num_vws = len(splits)
    x, y = dataset.train.x, dataset.train.y
    shards = [datalib.shard_indices(len(y), num_vws, v, config.seed) for v in range(num_vws)]

    def batch(vw: int, p: int):
        return datalib.minibatch(x, y, shards[vw], t.batch_size, config.seed, p)

    stages: dict[tuple[int, int], RefStage] = {}
    for v, split in enumerate(splits):
        schedule = get_schedule(t.schedule)(len(split), nm, t.waves, D)
        for j in range(len(split)):
            start = sum(split[:j])
            module = build_stage(spec, start, start + split[j])
            opt = make_optimizer(list(module.parameters()), t.optimizer, t.lr, t.momentum, t.weight_decay)
            base = {k: w.detach().clone() for k, w in synced_tensors(module).items()}
            stages[(v, j)] = RefStage(module, opt, list(schedule.stages[j]), base)
    history = [{k: w.detach().numpy().copy() for s in stages.values() for k, w in s.baseline.items()}]  # W_0
    pushes: dict[int, dict[int, dict[str, np.ndarray]]] = {}  # wave -> vw -> key -> Δ
    pushed = {sid: 0 for sid in stages}
    acts: dict[tuple[int, int, int], Tensor] = {}  # (vw, stage, p) -> input activation waiting there
    grads: dict[tuple[int, int, int], Tensor] = {}  # (vw, stage, p) -> output gradient waiting there

    def c_global() -> int:
        return min(min(pushed[(v, j)] for j in range(len(splits[v]))) for v in range(num_vws))

    def fold() -> None:  # W_{t+1} = W_t + S_t once wave t is complete
        while len(history) - 1 < c_global():
            w = len(history) - 1
            new = {}
            for key, old in history[-1].items():
                parts = [pushes[w][v][key] for v in range(num_vws) if key in pushes[w][v]]
                s = parts[0].copy()
                for part in parts[1:]:
                    s += part
                new[key] = old + s
            history.append(new)
            if on_version is not None:
                on_version(len(history) - 1, new)

    def ready(sid: tuple[int, int]) -> bool:
        v, j = sid
        a = stages[sid].actions[stages[sid].pos]
        if a.kind == "F":
            return j == 0 or (v, j, a.index) in acts
        if a.kind == "B":
            return j == len(splits[v]) - 1 or (v, j, a.index) in grads
        if a.kind == "WAIT":
            return num_vws == 1 or c_global() >= a.index - D - 1
        return True

    def step(sid: tuple[int, int]) -> None:
        v, j = sid
        st = stages[sid]
        a = st.actions[st.pos]
        st.pos += 1
        last = j == len(splits[v]) - 1
        params = dict(st.module.named_parameters())
        if a.kind == "F":
            inputs = batch(v, a.index)[0] if j == 0 else acts.pop((v, j, a.index))
            if j > 0:
                inputs = inputs.detach().requires_grad_(True)
            weights = {k: w.detach().clone().requires_grad_(True) for k, w in params.items()}
            out = functional_call(st.module, weights, (inputs,), strict=False)
            if last:
                out = spec.loss(out, batch(v, a.index)[1])
            else:
                acts[(v, j + 1, a.index)] = out.detach()
            st.saved[a.index] = (inputs, out, weights)
        elif a.kind == "B":
            inputs, out, weights = st.saved.pop(a.index)
            grad = None if last else grads.pop((v, j, a.index))
            if out.requires_grad:  # a first stage without weights has nothing to differentiate
                out.backward(grad)
            for k, w in params.items():
                w.grad = weights[k].grad
            if st.optimizer is not None:
                st.optimizer.step()
                st.optimizer.zero_grad(set_to_none=True)
            with torch.no_grad():
                sums = st.sums.setdefault(a.index // nm, {})
                for k, w in synced_tensors(st.module).items():
                    delta = w - st.baseline[k]
                    sums[k] = sums[k] + delta if k in sums else delta
                    st.baseline[k].copy_(w)
            if j > 0:
                grads[(v, j - 1, a.index)] = inputs.grad
        elif a.kind == "PUSH":
            sums = st.sums.get(a.index) or {k: torch.zeros_like(w) for k, w in st.baseline.items()}
            st.sums[a.index] = sums
            pushes.setdefault(a.index, {}).setdefault(v, {}).update({k: d.numpy().copy() for k, d in sums.items()})
            pushed[sid] += 1
            fold()
        elif a.kind == "WAIT" and num_vws > 1:
            version = a.index - D - 1
            with torch.no_grad():
                for w in [w for w in st.sums if w <= version - 1]:
                    del st.sums[w]
                for k, w in synced_tensors(st.module).items():
                    w.copy_(torch.from_numpy(history[version][k]))
                    for wave in sorted(st.sums):
                        w += st.sums[wave][k]
                    st.baseline[k].copy_(w)

    rng = random.Random(order_seed)
    while any(s.pos < len(s.actions) for s in stages.values()):
        runnable = [sid for sid, s in stages.items() if s.pos < len(s.actions) and ready(sid)]
        if not runnable:
            raise RuntimeError("reference deadlocked: the schedules are invalid")
        step(rng.choice(runnable))
    return ReferenceResult(
        stage_weights={sid: {k: w.detach().clone() for k, w in synced_tensors(s.module).items()} for sid, s in stages.items()},
        ps_weights=history[-1],
    )
