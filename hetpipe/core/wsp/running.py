"""Latest pulls: the running weights of one shard, into which each VW's wave is folded the moment that VW
completes it here, each VW's newest buffer values, and copy-on-write while a zero-copy send reads an array
(docs/wsp.md#pull-modes)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import numpy as np

from hetpipe.core.wsp.aggregation import Aggregation, KeyKind
from hetpipe.core.wsp.sources import Source, add_into, as_array, copy_of

__all__ = ["RunningWeights"]


@dataclass
class RunningWeights:
    """The running weights (params and ledgers), the buffers by VW, and the pushes of waves their VW has not
    completed on this shard yet."""

    aggregation: Aggregation
    weight: Callable[[int], int] = lambda vw: 1  # each VW's weight by samples (the shard's membership's)
    weights: dict[str, np.ndarray] = field(default_factory=dict)
    held: dict[int, dict[int, dict[str, Source]]] = field(default_factory=dict)  # vw -> wave -> pushes
    buffers: dict[int, dict[str, np.ndarray]] = field(default_factory=dict)  # each VW's newest buffer values
    lent: dict[str, list[Callable[[], bool]]] = field(default_factory=dict)  # key -> sends reading it

    def hold(self, vw: int, wave: int, tensors: Mapping[str, Source]) -> None:
        """Keep a stage's push of `wave` until every stage of VW `vw` has pushed the wave."""
        self.held.setdefault(vw, {}).setdefault(wave, {}).update(tensors)

    def fold(self, vw: int, wave: int, kinds: Mapping[str, KeyKind], total: int) -> None:
        """Fold VW `vw`'s complete wave into the running weights (buffers: keep its newest values), its pushes
        times its weight by samples where the rule weighs them; `total`: the wave's contributors' weight."""
        weight = self.weight(vw)
        for key, src in self.held[vw].pop(wave, {}).items():
            kind = kinds[key]
            if kind == "buffer":
                self.buffers.setdefault(vw, {})[key] = copy_of(src)
                continue
            if self.aggregation.adds(kind):  # W += S straight from the received frames, not copied out first
                add_into(self._writable(key), src)
                continue
            part = as_array(src)
            if weight != 1 and self.aggregation.weighs(kind):
                part = np.asarray(part * np.float32(weight))  # 0-d stays an array
            new = self.aggregation.add_now(key, kind, self._writable(key), part, total)
            if new is not None:
                self.weights[key] = new.astype(np.float32, copy=False)

    def drop(self, vw: int) -> None:
        """Forget evicted VW `vw`'s pushes not folded yet and its buffer values."""
        self.held.pop(vw, None)
        self.buffers.pop(vw, None)

    def value(self, key: str, kind: KeyKind, initial: np.ndarray) -> np.ndarray:
        """The running weights of `key`; a buffer's: the mean of each VW's newest values, each times its
        weight by samples (`initial` before any)."""
        if kind != "buffer":
            return self.weights[key]
        owners = [v for v in sorted(self.buffers) if key in self.buffers[v]]
        if not owners:
            return initial
        total = None
        for v in owners:
            k = self.weight(v)
            part = self.buffers[v][key] if k == 1 else np.asarray(self.buffers[v][key] * np.float32(k))
            total = part.copy() if total is None else total + part
        count = sum(self.weight(v) for v in owners)
        return np.asarray(total / np.float32(count), dtype=np.float32)

    def lend(self, key: str, is_done: Callable[[], bool]) -> None:
        """Mark weights[key] as read by an in-flight zero-copy send until is_done() turns true (the sends
        already done are dropped here, so many reads between two pushes keep this list short)."""
        self.lent[key] = [done for done in self.lent.get(key, []) if not done()] + [is_done]

    def _writable(self, key: str) -> np.ndarray:
        """weights[key], copied first if a send still reads it (copy-on-write, never a wait)."""
        readers = self.lent.pop(key, [])
        if not all(done() for done in readers):
            self.weights[key] = self.weights[key].copy()
        return self.weights[key]
