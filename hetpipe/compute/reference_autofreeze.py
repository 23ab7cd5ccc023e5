"""train.autofreeze in the single-process reference: the movement of its PS's versions worked out here again,
by layer, and the adaptive rule's freeze points from it (docs/wsp.md#adaptive-freezing)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from hetpipe.core.wsp.autofreeze import AutoFreezeState
from hetpipe.core.wsp.freezing import FreezeSchedule

__all__ = ["ReferenceAutoFreeze"]


@dataclass
class ReferenceAutoFreeze:
    """The rule's state (None: the rule is off) and the versions measured so far, with Q by layer since the
    last boundary."""

    state: AutoFreezeState | None
    done: int = 0
    acc: dict[int, float] = field(default_factory=dict)

    def measure(
        self, history: Sequence[Mapping[str, np.ndarray]], kinds: Mapping[str, str], through: int
    ) -> FreezeSchedule | None:
        """Measure W_1 ... W_through (those not measured yet): the squared wave updates of each layer's
        parameters summed since the last boundary, its squared norm at each boundary, where the rule may add a
        freeze point. Returns the schedule when it did (else None, as always with the rule off)."""
        if self.state is None:
            return None
        params = [(int(k.split(".")[0]), k) for k in sorted(kinds) if kinds[k] == "param"]
        changed = False
        for t in range(self.done + 1, through + 1):
            old, new = history[t - 1], history[t]
            for layer, k in params:
                step = new[k].astype(np.float64) - old[k].astype(np.float64)
                self.acc[layer] = self.acc.get(layer, 0.0) + float(np.sum(step * step))
            if t % self.state.rule.interval == 0:
                norms: dict[int, float] = {}
                for layer, k in params:
                    norms[layer] = norms.get(layer, 0.0) + float(np.sum(new[k].astype(np.float64) ** 2))
                moved = {layer: (self.acc.get(layer, 0.0), n) for layer, n in norms.items()}
                changed = self.state.observe(t, moved) is not None or changed
                self.acc = {}
        self.done = max(self.done, through)
        return self.state.schedule if changed else None
