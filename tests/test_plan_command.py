"""hetpipe.app.plan_command's progress line: nothing for a short search, then about one line a second."""

from __future__ import annotations

from hetpipe.app.progress_line import ProgressLine


def test_progress_is_quiet_for_two_seconds_then_at_most_once_a_second() -> None:
    now = [0.0]
    printed: list[str] = []
    progress = ProgressLine(printed.append, clock=lambda: now[0])
    for t in (0.5, 1.0, 1.9, 2.0, 2.5, 2.99, 3.0, 3.2, 4.1):
        now[0] = t
        progress(f"at {t}")
    assert printed == ["at 2.0", "at 3.0", "at 4.1"]
