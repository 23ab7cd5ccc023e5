"""S_w of one wave on one shard: the VWs' pushes of the wave added per key in contributor order, whatever
the order they arrive in (docs/wsp.md#the-vw-order-sum)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from hetpipe.core.wsp.sources import Source, add_into, copy_of

__all__ = ["WaveSums"]


@dataclass
class WaveSums:
    """S_w of one wave, accumulated per key in contributor order; contributions wait in `held` until their VW
    completed the wave on this shard and every contributor before them is in.

    A sum with one contribution is kept as it arrived (a view over the received frames, no copy); the
    second contribution turns it into a fresh array.
    """

    sums: dict[str, Source] = field(default_factory=dict)
    merged: dict[str, int] = field(default_factory=dict)  # contributors (in order) already in sums[key]
    held: dict[str, dict[int, Source]] = field(default_factory=dict)
    owned: set[str] = field(default_factory=set)  # keys whose sum is our own array, safe to add into

    def add(self, key: str, vw: int, src: Source) -> None:
        self.held.setdefault(key, {})[vw] = src

    def drop(self, vw: int) -> None:
        """Forget VW `vw`'s contributions not merged yet (it was evicted before completing this wave)."""
        for key in list(self.held):
            self.held[key].pop(vw, None)
            if not self.held[key]:
                del self.held[key]

    def merge(self, order: list[int], complete: Callable[[int], bool]) -> None:
        """Merge held contributions while the next contributor in `order` has one and has completed the
        wave."""
        for key in list(self.held):
            parts, i = self.held[key], self.merged.get(key, 0)
            while i < len(order) and order[i] in parts and complete(order[i]):
                self._accumulate(key, parts.pop(order[i]))
                i += 1
            self.merged[key] = i
            if not parts:
                del self.held[key]

    def _accumulate(self, key: str, src: Source) -> None:
        part = self.sums.get(key)
        if part is None:
            self.sums[key] = src
        else:
            if key not in self.owned:
                part = self.sums[key] = copy_of(part)
                self.owned.add(key)
            add_into(part, src)

    def incomplete(self, contributors: int) -> list[str]:
        """Keys that still miss a contributor's update, or hold one never merged (empty when the sum is
        complete)."""
        return sorted({k for k, n in self.merged.items() if n != contributors} | set(self.held))
