"""Learning-rate schedules (`[train] lr_schedule`): each local update's learning rate, a pure function of its
wave. No torch; the runtime (hetpipe.compute.stage_compute) and the reference (hetpipe.compute.reference)
both read it from here, as they read the mitigations' factors from hetpipe.core.pipeline.mitigation.

A step is a wave. Every update of wave c (each of its minibatches' under wsp, the one at its end under a
flush schedule), on every stage of every virtual worker, runs at lr_at(schedule, c), c = 0, 1, ... The wave
is the one counter every VW and every stage derives alone from the minibatch index (c = p // Nm, Nm the VW's
own) and the one the PS's versions count, so VWs with different work per wave follow the same curve.

  constant  lr (today's arithmetic, bit for bit)
  cosine    c < warmup_steps:  lr * (c + 1) / warmup_steps                 (linear warm-up, never 0)
            else:              min_lr + (lr - min_lr) * (1 + cos(pi * q)) / 2,
                               q = min(1, (c - warmup_steps) / (total - warmup_steps))
            total = total_steps, or train.waves when total_steps is 0
  step      lr * gamma ** (c // lr_step_every)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

__all__ = ["LR_SCHEDULES", "LrSchedule", "LrScheduleName", "lr_at"]

LrScheduleName = Literal["constant", "cosine", "step"]
LR_SCHEDULES: tuple[str, ...] = ("constant", "cosine", "step")


@dataclass(frozen=True)
class LrSchedule:
    """A schedule's settings, total resolved (train.total_steps, or the run's waves)."""

    name: LrScheduleName
    lr: float
    warmup_steps: int = 0
    total: int = 1
    min_lr: float = 0.0
    every: int = 1
    gamma: float = 0.1


def lr_at(schedule: LrSchedule, wave: int) -> float:
    """The learning rate of the updates of `wave` (0-based)."""
    if schedule.name == "cosine":
        return _cosine(schedule, wave)
    if schedule.name == "step":
        return schedule.lr * schedule.gamma ** (wave // schedule.every)
    return schedule.lr


def _cosine(s: LrSchedule, wave: int) -> float:
    if wave < s.warmup_steps:
        return s.lr * (wave + 1) / s.warmup_steps
    q = min(1.0, (wave - s.warmup_steps) / max(1, s.total - s.warmup_steps))
    return s.min_lr + (s.lr - s.min_lr) * (1.0 + math.cos(math.pi * q)) / 2.0
