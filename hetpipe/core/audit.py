"""Audit of what each forward saw: a tagged-update ledger checked against guarantees L and G (docs/schedules.md#guarantee-l, docs/wsp.md#guarantee-g).

With auditing on, every layer gets an extra synced tensor of shape (num_vws, num_minibatches); the
backward of minibatch p of VW i adds exactly 1.0 at [i, p], and that update travels like any other
(wave sums, pushes, pulls, rebase). Before each forward the stage checks its ledger. Pure: no I/O.
"""

from __future__ import annotations

import numpy as np

from hetpipe.core.errors import HetpipeError

__all__ = ["AuditError", "audit_key", "ledger_violations"]


class AuditError(HetpipeError):
    """A forward saw weights that break a WSP guarantee."""


def audit_key(layer: int) -> str:
    return f"audit/{layer}"


def ledger_violations(ledger: np.ndarray, vw: int, p: int, nm: int, staleness: int, own_through: int | None = None
                      ) -> list[str]:
    """What is wrong with the ledger the forward of minibatch p of VW `vw` sees (empty: nothing).

    L: the VW's own updates of every minibatch <= own_through are in (the schedule's guarantee; default
    p - Nm, the wsp schedule's); none of minibatch >= p is.
    G: every VW's updates of every wave <= c - D - 2 are in (c = the wave of p).
    Every slot is 0 or 1: no update counted twice or partly.
    """
    problems = []
    bad = ~np.isin(ledger, (0.0, 1.0))
    if bad.any():
        v, q = np.argwhere(bad)[0]
        problems.append(f"slot [vw {v}, minibatch {q}] holds {ledger[v, q]}, not 0 or 1 (counted twice?)")
    through = p - nm if own_through is None else own_through
    if through >= 0 and not (ledger[vw, : through + 1] == 1.0).all():
        q = int(np.argmin(ledger[vw, : through + 1] == 1.0))
        problems.append(f"L: own update of minibatch {q} <= {through} is missing")
    if (ledger[vw, p:] != 0.0).any():
        q = p + int(np.argmax(ledger[vw, p:] != 0.0))
        problems.append(f"own update of minibatch {q} >= p is already in")
    wave = p // nm
    through = (wave - staleness - 1) * nm  # minibatches of waves <= c - D - 2
    if through > 0:
        missing = np.argwhere(ledger[:, :through] != 1.0)
        if len(missing):
            v, q = missing[0]
            problems.append(
                f"G: vw {v}'s update of minibatch {q} (wave {q // nm} <= c - D - 2 = {wave - staleness - 2}) is missing"
            )
    return problems
