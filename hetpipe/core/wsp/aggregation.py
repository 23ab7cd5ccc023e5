"""How the parameter server folds a wave's pushes into the global weights (docs/wsp.md#aggregation):
`sum` and `mean` of the VWs' updates, or `server`, where VWs push mean gradients and the PS runs the
optimizer (SGD, momentum, Adam) once per wave. Pure numpy, float32, fixed operation order.

Kinds of keys: "param" (trainable weights: folded by the rule), "ledger" (audit counters: always summed)
and "buffer" (BatchNorm statistics and counters: values, averaged over the VWs, never summed as deltas).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

__all__ = ["AGGREGATIONS", "KEY_KINDS", "Aggregation", "KeyKind", "ServerOptimizer", "make_aggregation"]

KeyKind = Literal["param", "ledger", "buffer"]
KEY_KINDS: tuple[KeyKind, ...] = ("param", "ledger", "buffer")
AGGREGATIONS = ("sum", "mean", "server")
_F32 = np.float32


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


@dataclass
class Aggregation:
    """One rule for folding S_t (the VW-ordered sum of the wave's pushes for a key) into W_t."""

    name: str
    optimizer: ServerOptimizer | None = None

    def __post_init__(self) -> None:
        if self.name not in AGGREGATIONS:
            raise ValueError(f"unknown aggregation {self.name!r}: use {', '.join(AGGREGATIONS)}")
        if (self.name == "server") != (self.optimizer is not None):
            raise ValueError('aggregation "server" needs a ServerOptimizer, and only it has one')

    def adds(self, kind: KeyKind) -> bool:
        """Whether fold is W + S for keys of `kind` (sum, and ledgers under every rule)."""
        return kind == "ledger" or (kind != "buffer" and self.name == "sum")

    def fold(self, key: str, kind: KeyKind, w: np.ndarray, s: np.ndarray, num_vws: int) -> np.ndarray:
        """W_{t+1}[key] from W_t[key] and S_t[key] (exact pulls: once per complete wave)."""
        return np.asarray(self._fold(key, kind, w, s, num_vws), dtype=_F32)  # 0-d stays an array

    def _fold(self, key: str, kind: KeyKind, w: np.ndarray, s: np.ndarray, num_vws: int) -> np.ndarray:
        if kind == "buffer":
            return s / _F32(num_vws)
        if kind == "ledger" or self.name == "sum":
            return w + s
        if self.name == "mean":
            return w + s / _F32(num_vws)
        assert self.optimizer is not None
        return self.optimizer.step(key, w, s / _F32(num_vws))

    def add_now(
        self, key: str, kind: KeyKind, w: np.ndarray, src: np.ndarray, num_vws: int
    ) -> np.ndarray | None:
        """Latest pulls: fold one VW's push into the running weights as it arrives; returns new weights when
        the rule cannot add in place (server), None after adding `src` (scaled) into `w` in place."""
        if kind == "ledger" or self.name == "sum":
            np.add(w, src, out=w)
            return None
        if self.name == "mean":
            np.add(w, src / _F32(num_vws), out=w)
            return None
        assert self.optimizer is not None
        return np.asarray(self.optimizer.step(key, w, src / _F32(num_vws)), dtype=_F32)


def make_aggregation(
    name: str, optimizer: str = "sgd", lr: float = 0.01, momentum: float = 0.9, weight_decay: float = 0.0
) -> Aggregation:
    """The rule `name`; for "server", with the PS-side optimizer built from the training settings."""
    server = ServerOptimizer(optimizer, lr, momentum, weight_decay) if name == "server" else None
    return Aggregation(name, server)
