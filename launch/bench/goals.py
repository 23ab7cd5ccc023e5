"""What a training run must reach, shared by the convergence benchmarks (time_to_accuracy.py, staleness.py):
test accuracy for a classifier, validation loss for a language model, and the first score that meets it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import click

__all__ = ["Goal", "first_reaching", "goal_for"]


@dataclass(frozen=True)
class Goal:
    """What every system must reach: `metric` of the scored weights at or above (accuracy) or at or below
    (loss) `target`."""

    metric: str
    target: float

    @property
    def higher_is_better(self) -> bool:
        return self.metric.endswith("accuracy")

    def met(self, score: dict[str, Any]) -> bool:
        value = score[self.metric]
        return value >= self.target if self.higher_is_better else value <= self.target

    def best(self, scores: list[dict[str, Any]]) -> float:
        values = [s[self.metric] for s in scores]
        return (max if self.higher_is_better else min)(values, default=float("nan"))

    @property
    def label(self) -> str:
        return f"{self.target:.0%}" if self.higher_is_better else f"loss {self.target:g}"


def goal_for(task: str, target: float | None) -> Goal:
    """Test accuracy for a classifier (0.9 unless given), validation loss in nats for a language model."""
    if task == "classification":
        return Goal("test_accuracy", 0.9 if target is None else target)
    if target is None:
        raise click.UsageError(
            "this model is a language model: give --target, the validation loss to reach in nats "
            "per token (e.g. --target 2.0; a unigram guess scores ~3.3 on Shakespeare)"
        )
    return Goal("val_loss", target)


def first_reaching(scores: list[dict[str, Any]], start: float, goal: Goal, key: str = "t") -> float | None:
    """scores[i][key] - start of the first score that meets the goal; None if none did."""
    return next((s[key] - start for s in scores if goal.met(s)), None)
