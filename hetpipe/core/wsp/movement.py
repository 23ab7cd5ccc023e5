"""One shard's part of the layers' movement that [train] autofreeze decides by (hetpipe.core.wsp.autofreeze,
docs/wsp.md#adaptive-freezing): per layer, the squared global wave updates of its parameters summed over each
interval, and their squared norm at its end. Pure; float64 sums over each key's float32 values."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from hetpipe.core.wsp.freezing import layer_of

__all__ = ["MovementLog", "WireMovement", "combined"]

# what a pull reply carries: [[boundary, [[layer, Q, N], ...]], ...], boundaries in order
WireMovement = list[list[Any]]


@dataclass
class MovementLog:
    """Every `interval` versions, a record by layer of the shard's parameters: (Q, N), kept for the run (a
    restarted stage asks for all of them again)."""

    interval: int
    acc: dict[int, float] = field(default_factory=dict)  # Q since the last boundary, through the newest W_t
    # boundary -> layer -> (Q, N)
    records: dict[int, dict[int, tuple[float, float]]] = field(default_factory=dict)

    def built(
        self,
        version: int,
        before: Mapping[str, np.ndarray],
        after: Mapping[str, np.ndarray],
        params: Iterable[str],
    ) -> None:
        """W_version (`after`) was built from W_{version-1} (`before`); `params`: the shard's parameter keys,
        in a fixed order (the sums' order)."""
        keys = [(layer_of(k), k) for k in params]
        keys = [(layer, k) for layer, k in keys if layer is not None]
        for layer, key in keys:
            step = after[key].astype(np.float64) - before[key].astype(np.float64)
            self.acc[layer] = self.acc.get(layer, 0.0) + float(np.dot(step.ravel(), step.ravel()))
        if version > 0 and version % self.interval == 0:
            norms: dict[int, float] = {}
            for layer, key in keys:
                w = after[key].astype(np.float64).ravel()
                norms[layer] = norms.get(layer, 0.0) + float(np.dot(w, w))
            self.records[version] = {layer: (self.acc.get(layer, 0.0), norms[layer]) for layer in norms}
            self.acc = {}

    def record(
        self, versions: Mapping[int, Mapping[str, np.ndarray]], since: int, kinds: Mapping[str, str]
    ) -> None:
        """Every version after W_since in `versions`, built just now (the parameters among `kinds`, in key
        order)."""
        params = sorted(k for k, kind in kinds.items() if kind == "param")
        for t in range(since, max(versions)):
            self.built(t + 1, versions[t], versions[t + 1], params)

    def since(self, known: int, through: int) -> WireMovement:
        """The records of boundaries in (known, through], for a pull of W_through by a stage that has those
        up to `known` (-1: none)."""
        return [
            [b, [[layer, q, n] for layer, (q, n) in sorted(rec.items())]]
            for b, rec in sorted(self.records.items())
            if known < b <= through
        ]

    def to_meta(self) -> dict[str, Any]:
        acc = [[layer, q] for layer, q in sorted(self.acc.items())]
        return {"interval": self.interval, "acc": acc, "records": self.since(-1, 1 << 62)}

    @classmethod
    def from_meta(cls, meta: Mapping[str, Any]) -> MovementLog:
        log = cls(meta["interval"], {int(layer): q for layer, q in meta["acc"]})
        log.records = {b: {int(layer): (q, n) for layer, q, n in rec} for b, rec in meta["records"]}
        return log


def combined(replies: Iterable[WireMovement]) -> WireMovement:
    """The shards' records added up, boundary by boundary and layer by layer, in the order of `replies`
    (shard order), so that every stage gets the same sums; in the wire's form."""
    out: dict[int, dict[int, tuple[float, float]]] = {}
    for reply in replies:
        for boundary, rows in reply:
            record = out.setdefault(boundary, {})
            for layer, q, n in rows:
                q0, n0 = record.get(layer, (0.0, 0.0))
                record[layer] = (q0 + q, n0 + n)
    return [[b, [[layer, q, n] for layer, (q, n) in sorted(rec.items())]] for b, rec in sorted(out.items())]
