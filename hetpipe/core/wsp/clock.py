"""The WSP clock arithmetic: which weights a wave's gate needs, the first wave that pulls, and how much an
exact shard holds (docs/wsp.md). Pure functions of a wave and the staleness bound D."""

from __future__ import annotations

__all__ = ["PULL_MODES", "first_pulled_wave", "gate_version", "pending_bound"]

PULL_MODES = ("exact", "latest")


def gate_version(wave: int, staleness: int) -> int:
    """The index t of the global weights W_t that the gate of `wave` requires: wave - D - 1."""
    return wave - staleness - 1


def first_pulled_wave(staleness: int) -> int:
    """The first wave whose gate needs a pull; earlier waves start from W_0 (docs/wsp.md)."""
    return staleness + 2


def pending_bound(staleness: int) -> tuple[int, int]:
    """The most an exact shard holds, in waves' worth of its keys (docs/wsp.md#bounded-memory):
    (weight versions, wave sums) = (D + 2, D + 2). Versions W_t are kept from the oldest a pull may still
    ask for (c_global - D - 1 at the slowest stage, also what a resume from clock c_global or a rejoin needs)
    to the newest (c_global); sums of waves c_global .. c_global + D + 1, the furthest any VW may run ahead of
    the slowest."""
    return staleness + 2, staleness + 2
