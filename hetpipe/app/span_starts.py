"""When `hetpipe train` starts the stages of a VW planned to train later waves (docs/wsp.md#planned-spans):
once every VW that uses one of its GPUs before it, and the VW whose optimizer state it takes, has pushed its
last wave, so a GPU serves one VW at a time (an emulated one computes for one at a time, as a real one would)
and the state it takes is written."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from hetpipe.compute.build import VwLayout

__all__ = ["LaterVw", "SpanStarts", "starts_after"]


def starts_after(
    vws: Sequence[VwLayout], num_waves: int, sources: Mapping[int, int] | None = None
) -> dict[int, tuple[int, ...]]:
    """For each VW that shares a GPU with VWs whose waves end at or before its first, or takes the optimizer
    state of a VW (`sources`: VW -> that VW, hetpipe.core.wsp.handover): those VWs, in order. VWs training
    every wave, or on GPUs of their own and starting fresh, are not listed (they start at once)."""
    spans = [lay.span(num_waves) for lay in vws]
    sources = sources or {}
    out = {}
    for v, lay in enumerate(vws):
        before = tuple(
            u
            for u, other in enumerate(vws)
            if u != v
            and spans[u][1] <= spans[v][0]
            and (set(other.gpus) & set(lay.gpus) or sources.get(v) == u)
        )
        if before:
            out[v] = before
    return out


@dataclass
class LaterVw:
    """A VW whose stages wait to start: its stage jobs, and the VWs (`after`) that hold its GPUs first."""

    vw: int
    jobs: list[Any]  # hetpipe.worker.jobs.StageJob
    after: tuple[int, ...]


@dataclass
class SpanStarts:
    """The VWs still to start, and how to start one (`start`: its stage children by (VW, stage))."""

    start: Callable[[LaterVw], dict[tuple[int, int], Any]]
    pending: list[LaterVw] = field(default_factory=list)

    def tick(self, done: Callable[[int], bool]) -> dict[tuple[int, int], Any]:
        """Start every pending VW whose GPUs' earlier VWs are `done` (pushed their last wave); returns the new
        stage children."""
        started: dict[tuple[int, int], Any] = {}
        for later in [p for p in self.pending if all(done(u) for u in p.after)]:
            self.pending.remove(later)
            started.update(self.start(later))
        return started
