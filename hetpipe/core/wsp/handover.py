"""Whose optimizer state a VW planned to start mid-run takes (docs/wsp.md#planned-spans): at each wave s where
VWs retire and others start, the i-th starting VW takes the state of the (i mod n)-th of the n retiring ones,
for each of its layers' parameters. Pure."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["optimizer_sources"]


def optimizer_sources(spans: Sequence[tuple[int, int]]) -> dict[int, int]:
    """VW -> the VW whose optimizer state it starts with, for every VW that starts at a wave s > 0 where some
    VW's waves end (in VW order on both sides); a VW that starts where none ends starts fresh (not listed)."""
    out = {}
    for s in sorted({start for start, _ in spans if start > 0}):
        ending = [u for u, (_, end) in enumerate(spans) if end == s]
        starting = [v for v, (start, _) in enumerate(spans) if start == s]
        if ending:
            out.update({v: ending[i % len(ending)] for i, v in enumerate(starting)})
    return out
