"""How the parameter server folds a wave's pushes into the global weights (docs/wsp.md#aggregation). Each rule
is a class registered by name (AGGREGATIONS) that says what a VW pushes and where the optimizer runs
(`local_optimizer`), how much of each VW's push reaches the weights (`share`), and how the PS folds a wave's
sum (`fold_param`): `sum` and `mean` of the VWs' updates, or `server`, where VWs push mean gradients and the
PS runs the optimizer (SGD, momentum, Adam) once per wave. Every consumer (config, memory model, simulator,
convergence model, reference, runtime) reads these traits, never a rule's name. Pure numpy, float32, fixed
operation order.

Kinds of keys: "param" (trainable weights: folded by the rule), "ledger" (audit counters: always summed)
and "buffer" (BatchNorm statistics and counters: values, averaged over the VWs, never summed as deltas).

Weights by samples (docs/wsp.md#per-vw-work): VW v's push of a key the rule `weighs` enters the wave's sum
as k_v times itself (k_v: its samples per wave over the run's common divisor, hetpipe.core.wsp.work), and a
fold's `total` is the summed k_v of the wave's contributors; with equal work every k_v is 1 and `total` is
the number of VWs.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

import numpy as np

from hetpipe.core.registry import Registry

__all__ = [
    "AGGREGATIONS",
    "DEFAULT_AGGREGATION",
    "KEY_KINDS",
    "Aggregation",
    "KeyKind",
    "OptimizerSettings",
    "ServerOptimizer",
    "get_aggregation",
    "make_aggregation",
    "needs_pulls",
    "register_aggregation",
]

KeyKind = Literal["param", "ledger", "buffer"]
KEY_KINDS: tuple[KeyKind, ...] = ("param", "ledger", "buffer")
Share = Literal["whole", "mean"]
DEFAULT_AGGREGATION = "sum"  # [ps] aggregation when the config names none
_F32 = np.float32


@dataclass(frozen=True)
class OptimizerSettings:
    """The run's optimizer ([train]), for a rule whose optimizer runs at the PS (`local_optimizer` false)."""

    name: str = "sgd"
    lr: float = 0.01
    momentum: float = 0.9
    weight_decay: float = 0.0


@dataclass
class ServerOptimizer:
    """The PS-side optimizer of `aggregation = "server"`, one state per key, with torch.optim's update rules:
    sgd (w -= lr (g + wd w)), momentum (b = m b + g', first b = g'; w -= lr b) and adam (bias-corrected)."""

    name: str
    lr: float
    momentum: float = 0.9
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    state: dict[str, dict[str, Any]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.name not in ("sgd", "momentum", "adam"):
            raise ValueError(f"unknown optimizer {self.name!r}: use sgd, momentum or adam")

    def step(self, key: str, w: np.ndarray, g: np.ndarray) -> np.ndarray:
        """New weights for `key` after one step on gradient g (w and g are not changed)."""
        if self.weight_decay:
            g = g + _F32(self.weight_decay) * w
        st = self.state.setdefault(key, {"step": 0})
        st["step"] += 1
        if self.name == "sgd":
            return w - _F32(self.lr) * g
        if self.name == "momentum":
            buf = st.get("buf")
            buf = g.copy() if buf is None else _F32(self.momentum) * buf + g
            st["buf"] = buf
            return w - _F32(self.lr) * buf
        b1, b2 = self.betas
        m = st.get("m", np.zeros_like(w))
        v = st.get("v", np.zeros_like(w))
        m = _F32(b1) * m + _F32(1 - b1) * g
        v = _F32(b2) * v + _F32(1 - b2) * (g * g)
        st["m"], st["v"] = m, v
        t = st["step"]
        m_hat = m / _F32(1 - b1**t)
        v_hat = v / _F32(1 - b2**t)
        return w - _F32(self.lr) * m_hat / (np.sqrt(v_hat) + _F32(self.eps))

    def to_state(self) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
        meta = {
            key: {"step": st["step"], "arrays": [k for k in st if k != "step"]}
            for key, st in self.state.items()
        }
        arrays = {f"{key}/{k}": st[k] for key, st in self.state.items() for k in st if k != "step"}
        return meta, arrays

    def load_state(self, meta: Mapping[str, Any], arrays: Mapping[str, np.ndarray]) -> None:
        self.state = {
            key: {"step": m["step"], **{k: np.array(arrays[f"{key}/{k}"], dtype=_F32) for k in m["arrays"]}}
            for key, m in meta.items()
        }


class Aggregation:
    """One aggregation rule; a subclass sets the traits and `fold_param`, and registers itself
    (register_aggregation). An instance is one shard's (or the reference's) rule, with any state it keeps.

    Ledgers are always summed and buffers averaged over the VWs, whatever the rule (`fold`, `add_now`)."""

    name: ClassVar[str]
    summary: ClassVar[str] = ""
    # Where the optimizer runs, and so what a VW pushes: True, on every stage, which pushes its wave's summed
    # update (the change its own optimizer steps made); False, at the PS, which steps on the VWs' mean
    # gradients (each stage pushes its wave's mean gradient and its weights move only at pulls).
    local_optimizer: ClassVar[bool] = True
    # How much of each VW's push reaches the weights: "whole" (n VWs apply n steps' worth) or "mean" (its
    # weight by samples over the contributors' total: 1 / VWs when every VW does the same work).
    share: ClassVar[Share] = "whole"
    # fold_param is exactly W + S, so a shard may add a received push into W straight from its frames.
    plain_sum: ClassVar[bool] = False

    def __init__(self, optimizer: OptimizerSettings | None = None) -> None:
        self.optimizer_settings = optimizer or OptimizerSettings()

    def fold_param(self, key: str, w: np.ndarray, s: np.ndarray, total: int) -> np.ndarray:
        """W_{t+1}[key] of a parameter from W_t[key] and S_t[key], the VW-ordered sum of the wave's pushes
        (each times its VW's weight where the rule `weighs` params); `total`: the contributors' summed
        weight."""
        raise NotImplementedError(f"aggregation {self.name!r} must define fold_param")

    def add_param_now(self, key: str, w: np.ndarray, src: np.ndarray, total: int) -> np.ndarray | None:
        """Latest pulls: one VW's push (times its weight where the rule `weighs` params) folded into the
        running weights as it arrives; new weights, or None after adding into `w` in place. By default the
        fold of that one push."""
        return self.fold_param(key, w, src, total)

    def to_state(self) -> tuple[Any, dict[str, np.ndarray]]:
        """What the rule keeps between waves (a PS-side optimizer's state), for checkpoints: (meta,
        arrays)."""
        return None, {}

    def load_state(self, meta: Any, arrays: Mapping[str, np.ndarray]) -> None:
        """Restore what to_state wrote."""

    # ---- every rule alike -------------------------------------------------------------------------
    def weighs(self, kind: KeyKind) -> bool:
        """Whether a VW's push of `kind` enters the wave's sum times its weight by samples: buffers (a
        weighted mean of values) and, under a rule that shares each VW's push as a mean, params."""
        return kind == "buffer" or (kind == "param" and self.share == "mean")

    def adds(self, kind: KeyKind) -> bool:
        """Whether fold is W + S for keys of `kind` (ledgers under every rule, params under a plain sum)."""
        return kind == "ledger" or (kind == "param" and self.plain_sum)

    def fold(self, key: str, kind: KeyKind, w: np.ndarray, s: np.ndarray, total: int) -> np.ndarray:
        """W_{t+1}[key] from W_t[key] and S_t[key] (exact pulls: once per complete wave); `total`: the
        contributors' summed weight."""
        if kind == "buffer":
            out = s / _F32(total)
        elif kind == "ledger":
            out = w + s
        else:
            out = self.fold_param(key, w, s, total)
        return np.asarray(out, dtype=_F32)  # 0-d stays an array

    def add_now(
        self, key: str, kind: KeyKind, w: np.ndarray, src: np.ndarray, total: int
    ) -> np.ndarray | None:
        """Latest pulls: fold one VW's push into the running weights as it arrives; returns new weights when
        the rule cannot add in place, None after adding `src` (scaled) into `w` in place."""
        if kind == "ledger":
            np.add(w, src, out=w)
            return None
        new = self.add_param_now(key, w, src, total)
        return None if new is None else np.asarray(new, dtype=_F32)


AGGREGATIONS: Registry[type[Aggregation]] = Registry(
    "aggregation rule",
    "aggregation rules",
    lambda item: isinstance(item, type) and issubclass(item, Aggregation) and hasattr(item, "name"),
    "mylab.rules:HalfSum",
)


def register_aggregation(rule: type[Aggregation]) -> type[Aggregation]:
    """Make a rule known by its `name` (usable as a class decorator)."""
    return AGGREGATIONS.register(rule.name, rule)


def get_aggregation(name: str) -> type[Aggregation]:
    """The rule registered as `name`, or named "package.module:Class"; UsageError listing the known ones."""
    return AGGREGATIONS.get(name)


def needs_pulls(num_vws: int, rule: type[Aggregation]) -> bool:
    """Whether a run's WAITs pull: with several VWs, or when the PS runs the optimizer. One VW that applies
    its own updates needs none: its global weights hold only what its live weights hold."""
    return num_vws > 1 or not rule.local_optimizer


@register_aggregation
class SumAggregation(Aggregation):
    name = "sum"
    summary = "W + S: every VW's summed update applied whole (n VWs apply n steps' worth, as Downpour SGD)"
    plain_sum = True

    def fold_param(self, key: str, w: np.ndarray, s: np.ndarray, total: int) -> np.ndarray:
        return w + s

    def add_param_now(self, key: str, w: np.ndarray, src: np.ndarray, total: int) -> np.ndarray | None:
        np.add(w, src, out=w)
        return None


@register_aggregation
class MeanAggregation(Aggregation):
    name = "mean"
    summary = "W + S / VWs: the mean of the VWs' updates, each weighted by the samples behind it"
    share = "mean"

    def fold_param(self, key: str, w: np.ndarray, s: np.ndarray, total: int) -> np.ndarray:
        return w + s / _F32(total)

    def add_param_now(self, key: str, w: np.ndarray, src: np.ndarray, total: int) -> np.ndarray | None:
        np.add(w, src / _F32(total), out=w)
        return None


@register_aggregation
class ServerAggregation(Aggregation):
    name = "server"
    summary = "the PS runs the optimizer once per wave on the VWs' gradients, averaged by samples"
    local_optimizer = False
    share = "mean"

    def __init__(self, optimizer: OptimizerSettings | None = None) -> None:
        super().__init__(optimizer)
        o = self.optimizer_settings
        self.optimizer = ServerOptimizer(o.name, o.lr, o.momentum, o.weight_decay)

    def fold_param(self, key: str, w: np.ndarray, s: np.ndarray, total: int) -> np.ndarray:
        return self.optimizer.step(key, w, s / _F32(total))

    def to_state(self) -> tuple[Any, dict[str, np.ndarray]]:
        return self.optimizer.to_state()

    def load_state(self, meta: Any, arrays: Mapping[str, np.ndarray]) -> None:
        self.optimizer.load_state(meta, arrays)


def make_aggregation(
    name: str, optimizer: str = "sgd", lr: float = 0.01, momentum: float = 0.9, weight_decay: float = 0.0
) -> Aggregation:
    """The rule `name`, built with the training optimizer's settings (used where the PS runs the
    optimizer)."""
    return get_aggregation(name)(OptimizerSettings(optimizer, lr, momentum, weight_decay))
