"""The planner's last tie-break: of the candidates tied with the best (same D, local staleness and predicted
samples/s), the one that keeps more of its rate when the PS's links run at HEADROOM x their measured speed.
Plans the model cannot tell apart (compute-bound, their PS traffic hidden) differ in how close that traffic
runs to the gate: a wave of one minibatch leaves a push and pull a minibatch to arrive, a longer wave more,
and a real link, or a CPU busy with the emulation, is slower than a probe measures. Pure."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence

from hetpipe.core.planning.candidates import Candidate, own_lag, ranked, same_rate

__all__ = ["HEADROOM", "headroom_text", "tied_with_best", "with_headroom"]

HEADROOM = 0.5  # the PS links' speed, as a share of the measured, at which tied candidates are compared


def tied_with_best(candidates: Sequence[Candidate]) -> list[Candidate]:
    """The runnable candidates `ranked` cannot tell from its best by D, own_lag and samples/s (the best among
    them); [] when the best has none to tie with, or is ranked by time to target."""
    order = ranked(candidates)
    top = order[0] if order else None
    if top is None or not top.runnable or top.time_to_target_s is not None:
        return []

    def key(c: Candidate) -> tuple:
        return (c.staleness or 0, own_lag(c.plan), same_rate(c))

    tied = [c for c in order if c.runnable and c.time_to_target_s is None and key(c) == key(top)]
    return tied if len(tied) > 1 else []


def with_headroom(
    candidates: Sequence[Candidate],
    rate_at_headroom: Callable[[Candidate], float],
    max_stages: float = math.inf,
) -> list[Candidate]:
    """`candidates` with headroom_samples_per_s set on those tied with the best (`rate_at_headroom(c)`: its
    samples/s with every PS link at HEADROOM x its speed), so that `ranked` breaks their tie by it; unchanged
    when a tied plan has more than `max_stages` stages in all (the fast search simulates none that large)."""
    tied_ones = tied_with_best(candidates)
    if any(sum(len(vw.stages) for vw in c.plan.vws) > max_stages for c in tied_ones if c.plan is not None):
        return list(candidates)
    tied = {id(c): rate_at_headroom(c) for c in tied_ones}
    return [
        dataclasses.replace(c, headroom_samples_per_s=tied[id(c)]) if id(c) in tied else c for c in candidates
    ]


def headroom_text(c: Candidate, top: Candidate) -> str:
    """Why `top` won its tie with `c` by headroom ("keeps more of its rate ..."), or "" when it did not."""
    if not top.headroom_samples_per_s > c.headroom_samples_per_s > 0:
        return ""
    return (
        "keeps more of its rate with the PS's links at half speed "
        f"({top.headroom_samples_per_s:.4g} vs {c.headroom_samples_per_s:.4g} samples/s)"
    )
