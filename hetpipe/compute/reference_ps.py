"""The parameter server of the single-process reference (hetpipe.compute.reference): every VW's pushes by
wave, and W_t built in VW order once every stage of every VW has pushed wave t - 1, folded by the oracle's own
arithmetic, written here again in torch rather than taken from the PS (hetpipe.core.wsp.aggregation), so that
a wrong fold at the PS shows as a difference: buffers averaged over the VWs, and for the rules hetpipe ships
(a rule's subclasses included) the sum, the mean, or the PS-side optimizer on the VWs' mean gradient. Where
VWs do unequal work, the averages weigh each VW by its weight (its samples per wave over their common
divisor): S = k_0 P_0 + k_1 P_1 + ..., divided by k_0 + k_1 + ...; the sum stays unweighted. Under node-local
aggregation the sum adds each node group's own sum in turn, S = (k_0 P_0 + k_1 P_1) + (k_2 P_2 + ...), as
the relays do. A rule defined outside hetpipe is folded by its own `fold_param`, on what its `weighs` says:
that is its definition."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from torch import Tensor

from hetpipe.core.wsp.aggregation import (
    Aggregation,
    MeanAggregation,
    OptimizerSettings,
    ServerAggregation,
    SumAggregation,
)

__all__ = ["ReferencePS"]

StageId = tuple[int, int]  # (vw, stage)
_NO_END = 2**62  # the end of a VW's span that lasts the whole run


def _f32(x: float) -> Tensor:
    """A float32 scalar: the value rounded to float32 first, as the PS's numpy scalars are."""
    return torch.tensor(x, dtype=torch.float32)


def _div(a: Tensor, x: float) -> Tensor:
    """a / x, each element correctly rounded: torch divides by a scalar as a product with its reciprocal (an
    ulp off where 1 / x is not exact), so the divisor is a full tensor."""
    return a / torch.full_like(a, float(np.float32(x)))


def _added(parts: list[np.ndarray]) -> np.ndarray:
    """((a + b) + c) + ..., in a new array."""
    s = parts[0].copy()
    for part in parts[1:]:
        s += part
    return s


class _PsOptimizer:
    """The oracle's PS-side optimizer, per key, with torch.optim's update rules, op by op in float32: sgd
    (w - lr (g + wd w)), momentum (b = m b + g', the first b = g'; w - lr b) and Adam (bias-corrected)."""

    def __init__(self, settings: OptimizerSettings) -> None:
        self.s = settings
        self.state: dict[str, dict[str, Tensor | int]] = {}

    def step(self, key: str, w: Tensor, g: Tensor) -> Tensor:
        s = self.s
        if s.weight_decay:
            g = g + _f32(s.weight_decay) * w
        st = self.state.setdefault(key, {"t": 0})
        st["t"] = int(st["t"]) + 1
        if s.name == "sgd":
            return w - _f32(s.lr) * g
        if s.name == "momentum":
            buf = g.clone() if "buf" not in st else _f32(s.momentum) * st["buf"] + g
            st["buf"] = buf
            return w - _f32(s.lr) * buf
        beta1, beta2, eps = 0.9, 0.999, 1e-8
        m = _f32(beta1) * st.get("m", torch.zeros_like(w)) + _f32(1 - beta1) * g
        v = _f32(beta2) * st.get("v", torch.zeros_like(w)) + _f32(1 - beta2) * (g * g)
        st["m"], st["v"] = m, v
        m_hat = _div(m, 1 - beta1 ** st["t"])
        v_hat = _div(v, 1 - beta2 ** st["t"])
        # sqrt correctly rounded: in float64, then to float32 (torch's float32 sqrt may be an ulp off)
        return w - _f32(s.lr) * m_hat / (torch.sqrt(v_hat.double()).float() + _f32(eps))


class ReferencePS:
    """W_0 .. W_t of the reference: pushes kept by wave, versions built when every stage has pushed."""

    def __init__(
        self,
        initial: dict[str, np.ndarray],
        kinds: dict[str, str],
        splits: list[tuple[int, ...]],
        rule: Aggregation,
        on_version: Callable[[int, dict[str, np.ndarray]], None] | None,
        weights: list[int] | None = None,
        groups: list[list[int]] | None = None,
        wire: Callable[[np.ndarray], np.ndarray] | None = None,
        spans: list[tuple[int, int]] | None = None,
    ) -> None:
        """`wire`: the rounding of [ps] wire_dtype, which a group of two or more VWs (their relay) applies
        again to the sum of its (rounded) pushes of weights as it leaves the node. `spans`: each VW's waves
        [start, end) (default: all); wave t sums the VWs whose span holds t, and a VW past its end no longer
        holds the clock back."""
        self.splits, self.kinds, self.rule, self.on_version = splits, kinds, rule, on_version
        self.weights = weights or [1] * len(splits)  # each VW's weight by samples
        # node-local aggregation: the VWs whose sum is made first and added as one (default: each VW alone)
        self.groups = groups or [[v] for v in range(len(splits))]
        self.wire = wire
        self.history = [initial]  # W_0, W_1, ...
        self.pushes: dict[int, dict[int, dict[str, np.ndarray]]] = {}  # wave -> vw -> key -> what was pushed
        self.spans = spans or [(0, _NO_END)] * len(splits)
        self.pushed = {(v, j): self.spans[v][0] for v, split in enumerate(splits) for j in range(len(split))}
        self.optimizer = (
            _PsOptimizer(rule.optimizer_settings) if isinstance(rule, ServerAggregation) else None
        )

    def c_global(self) -> int:
        """The fewest waves a VW still training has pushed (every VW done: the last end)."""
        done = [min(self.pushed[(v, j)] for j in range(len(split))) for v, split in enumerate(self.splits)]
        training = [n for n, (_, end) in zip(done, self.spans, strict=True) if n < end]
        return min(training) if training else max(end for _, end in self.spans)

    def push(self, sid: StageId, wave: int, values: dict[str, np.ndarray]) -> None:
        """Stage `sid`'s push of `wave`; builds every version that it completes."""
        self.pushes.setdefault(wave, {}).setdefault(sid[0], {}).update(values)
        self.pushed[sid] += 1
        while len(self.history) - 1 < self.c_global():
            w = len(self.history) - 1
            vws = [v for v, (start, end) in enumerate(self.spans) if start <= w < end]  # wave w's, in order
            n = sum(self.weights[v] for v in vws)
            new = {}
            for key, old in self.history[-1].items():
                weigh = self.weighs(key)
                parts = {
                    v: np.asarray(self.pushes[w][v][key] * np.float32(self.weights[v] if weigh else 1))
                    for v in vws
                }
                groups = [[v for v in group if v in parts] for group in self.groups]
                s = _added([self.group_sum(key, [parts[v] for v in group]) for group in groups if group])
                new[key] = self.fold(key, old, s, n).astype(np.float32, copy=False)
            self.history.append(new)
            if self.on_version is not None:
                self.on_version(len(self.history) - 1, new)

    def group_sum(self, key: str, parts: list[np.ndarray]) -> np.ndarray:
        """A group's sum in VW order; a relayed group's weights rounded as they cross the node's link."""
        total = _added(parts)
        if len(parts) > 1 and self.wire is not None and self.kinds[key] == "param":
            return self.wire(total)
        return total

    def weighs(self, key: str) -> bool:
        """Whether VWs' pushes of `key` enter the sum times their weights: buffers, and params of a mean."""
        kind, rule = self.kinds[key], self.rule
        if kind == "buffer":
            return True
        if isinstance(rule, MeanAggregation | ServerAggregation):
            return True
        if isinstance(rule, SumAggregation):
            return False
        return rule.weighs(kind)  # a rule of its own: what it says

    def fold(self, key: str, old: np.ndarray, s: np.ndarray, n: int) -> np.ndarray:
        """W_{t+1}[key] from W_t[key] and the VW-ordered sum S_t[key] of VWs weighing `n` in all."""
        w, total = torch.from_numpy(old), torch.from_numpy(s)
        rule = self.rule
        if self.kinds[key] == "buffer":  # values, averaged whatever the rule
            return _div(total, n).numpy()
        if self.optimizer is not None:  # the PS steps on the VWs' mean gradient
            return self.optimizer.step(key, w, _div(total, n)).numpy()
        if isinstance(rule, MeanAggregation):
            return (w + _div(total, n)).numpy()
        if isinstance(rule, SumAggregation):
            return (w + total).numpy()
        return np.asarray(rule.fold_param(key, old, s, n), dtype=np.float32)
