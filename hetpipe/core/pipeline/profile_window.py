"""Which actions of a stage `hetpipe train --profile FIRST:COUNT` profiles: pure, parsed before torch is
imported."""

from __future__ import annotations

from dataclasses import dataclass

from hetpipe.core.errors import UsageError
from hetpipe.core.pipeline.schedule import FORWARD, UPDATE

__all__ = ["ProfileWindow"]


@dataclass(frozen=True)
class ProfileWindow:
    """Minibatches first ... first + count - 1: a stage profiles from its forward of the first through the
    update that covers the last (every action between, of other minibatches too: PUSH, WAIT, the forwards run
    ahead)."""

    first: int
    count: int

    def __post_init__(self) -> None:
        if self.first < 0 or self.count < 1:
            raise UsageError(
                f"--profile {self.first}:{self.count}: FIRST is a minibatch number (0 or more) and COUNT "
                "at least 1, e.g. --profile 40:40"
            )

    @classmethod
    def parse(cls, text: str) -> ProfileWindow:
        """`FIRST:COUNT`, e.g. "40:40" (minibatches 40 ... 79)."""
        first, sep, count = text.partition(":")
        try:
            if not sep:
                raise ValueError(text)
            return cls(int(first), int(count))
        except ValueError:
            raise UsageError(
                f"--profile {text!r}: write FIRST:COUNT, the first minibatch to profile and how many, "
                "e.g. --profile 40:40 (past the first waves' warm-up)"
            ) from None

    @property
    def last(self) -> int:
        return self.first + self.count - 1

    def opens_at(self, kind: str, index: int) -> bool:
        """The profiler starts before this action: the stage's first forward of a minibatch >= first."""
        return kind == FORWARD and index >= self.first

    def closes_after(self, kind: str, index: int) -> bool:
        """It stops after this action: the first update covering a minibatch >= last (a flush schedule updates
        once a wave, after its last minibatch)."""
        return kind == UPDATE and index >= self.last

    def fits(self, minibatches: int) -> bool:
        """Whether a run of that many minibatches a VW reaches the window's end."""
        return self.last < minibatches

    def check_fits(self, waves: int, nm: int) -> None:
        """Refuse a window past the end of a run of `waves` waves of `nm` minibatches (before anything
        starts)."""
        minibatches = waves * nm
        if not self.fits(minibatches):
            raise UsageError(
                f"--profile {self.first}:{self.count} ends at minibatch {self.last}, but each VW runs "
                f"{minibatches} ({waves} waves x nm {nm}): choose FIRST + COUNT <= {minibatches}, or "
                "more waves (--set train.waves=N)"
            )
