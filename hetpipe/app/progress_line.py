"""A progress line for long work (a search, a profile) on stderr: silent for a short job, then about once a
second."""

from __future__ import annotations

import time
from collections.abc import Callable

__all__ = ["ProgressLine"]


class ProgressLine:
    """Passes progress lines on to `emit`: none in the first `quiet_s` seconds (a short search or profile
    prints nothing), then at most one every `every_s` seconds."""

    def __init__(
        self,
        emit: Callable[[str], None],
        *,
        quiet_s: float = 2.0,
        every_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.emit, self.quiet_s, self.every_s, self.clock = emit, quiet_s, every_s, clock
        self.started = clock()
        self.last: float | None = None

    def __call__(self, line: str) -> None:
        now = self.clock()
        if now - self.started < self.quiet_s or (self.last is not None and now - self.last < self.every_s):
            return
        self.last = now
        self.emit(line)
