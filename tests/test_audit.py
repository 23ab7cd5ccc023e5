"""Tests of hetpipe.core.wsp.audit: the ledger checks for guarantees L and G on literal tables."""

from __future__ import annotations

import numpy as np

from hetpipe.core.wsp.audit import ledger_violations


def ledger(rows: list[str]) -> np.ndarray:
    return np.array([[float(c) for c in row] for row in rows], dtype=np.float32)


def test_a_ledger_that_meets_l_and_g():
    # nm=2, D=0: minibatch p=6 is in wave 3; needs own <= 4 and every VW's waves <= 1 (minibatches 0-3)
    seen = ledger(["11111000", "11110000"])
    assert ledger_violations(seen, vw=0, p=6, nm=2, staleness=0) == []


def test_each_violation_is_named():
    cases = [
        (["11101000", "11110000"], "L: own update of minibatch 3"),
        (["11111010", "11110000"], "own update of minibatch 6 >= p"),
        (["11111000", "11100000"], "G: vw 1's update of minibatch 3 (wave 1"),
        (["11111000", "11120000"], "not 0 or 1"),
    ]
    for rows, text in cases:
        problems = ledger_violations(ledger(rows), vw=0, p=6, nm=2, staleness=0)
        assert any(text in p for p in problems), (rows, problems)


def test_staleness_relaxes_g_only():
    seen = ledger(["11111000", "11000000"])
    assert ledger_violations(seen, vw=0, p=6, nm=2, staleness=1) == []  # needs waves <= 0 only
    assert ledger_violations(seen, vw=0, p=6, nm=2, staleness=0) != []
