"""Audit of what each forward saw: a tagged-update ledger checked against guarantees L and G
(docs/schedules.md#guarantee-l, docs/wsp.md#guarantee-g).

With auditing on, every layer gets an extra synced tensor of shape (num_vws, num_minibatches of the VW with
the most); the backward of minibatch p of VW i adds exactly 1.0 at [i, p], and that update travels like any
other (wave sums, pushes, pulls, rebase). Before each forward the stage checks its ledger. Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from hetpipe.core.errors import HetpipeError

__all__ = ["AuditError", "audit_key", "expected_ledger", "gap_mask", "ledger_violations", "planned_gaps"]


class AuditError(HetpipeError):
    """A forward saw weights that break a WSP guarantee."""


def audit_key(layer: int) -> str:
    return f"audit/{layer}"


# Nm of every VW alike, or each VW's own (row v's minibatches come in waves of nm_v)
Nms = int | Sequence[int]


def _nm_of(nm: Nms, vw: int) -> int:
    return nm if isinstance(nm, int) else nm[vw]


def gap_mask(shape: tuple[int, int], nm: Nms, gaps: Sequence[Sequence[int]]) -> np.ndarray:
    """True at the slots of waves a VW contributed nothing to: [vw, from, to) wave ranges (to = -1: on), the
    spans it was evicted for (docs/recovery.md)."""
    mask = np.zeros(shape, dtype=bool)
    for v, start, end in gaps:
        nm_v = _nm_of(nm, v)
        mask[v, start * nm_v : shape[1] if end < 0 else end * nm_v] = True
    return mask


def planned_gaps(spans: Sequence[Sequence[int]], num_waves: int) -> list[list[int]]:
    """The gaps of planned spans (docs/wsp.md#planned-spans): [vw, 0, start) before a VW's first wave and
    [vw, end, -1) after its last, for each VW that does not train every one of the run's `num_waves`."""
    out = []
    for v, (start, end) in enumerate(spans):
        if start > 0:
            out.append([v, 0, start])
        if end < num_waves:
            out.append([v, end, -1])
    return out


def expected_ledger(
    shape: tuple[int, int], nm: Nms, gaps: Sequence[Sequence[int]], through_wave: int
) -> np.ndarray:
    """The final ledger of a run whose waves < through_wave are folded: 1 at every slot outside the gaps."""
    want = np.zeros(shape, dtype=np.float32)
    for v in range(shape[0]):
        want[v, : through_wave * _nm_of(nm, v)] = 1.0
    want[gap_mask(shape, nm, gaps)] = 0.0
    return want


def ledger_violations(
    ledger: np.ndarray,
    vw: int,
    p: int,
    nm: Nms,
    staleness: int,
    own_through: int | None = None,
    gaps: Sequence[Sequence[int]] = (),
    own_from: int = 0,
) -> list[str]:
    """What is wrong with the ledger the forward of minibatch p of VW `vw` sees (empty: nothing).

    L: the VW's own updates of every minibatch <= own_through are in (the schedule's guarantee; default
    p - Nm, the wsp schedule's); none of minibatch >= p is.
    G: every VW's updates of every wave <= c - D - 2 are in (c = the wave of p).
    Every slot is 0 or 1: no update counted twice or partly. Slots in `gaps` (waves an evicted VW never
    contributed) must hold 0 and are no part of L or G. `own_from`: the first minibatch of this incarnation of
    the VW (it rejoined): its earlier updates are global ones, under G.
    """
    problems = []
    bad = ~np.isin(ledger, (0.0, 1.0))
    if bad.any():
        v, q = np.argwhere(bad)[0]
        problems.append(f"slot [vw {v}, minibatch {q}] holds {ledger[v, q]}, not 0 or 1 (counted twice?)")
    skip = gap_mask(ledger.shape, nm, gaps)
    if (ledger[skip] != 0.0).any():
        v, q = np.argwhere(skip & (ledger != 0.0))[0]
        problems.append(
            f"slot [vw {v}, minibatch {q}] is in a wave vw {v} was evicted for, yet holds {ledger[v, q]}"
        )
    present = (ledger == 1.0) | skip
    own_nm = _nm_of(nm, vw)
    through = p - own_nm if own_through is None else own_through
    if through >= own_from and not present[vw, own_from : through + 1].all():
        q = own_from + int(np.argmin(present[vw, own_from : through + 1]))
        problems.append(f"L: own update of minibatch {q} <= {through} is missing")
    if (ledger[vw, p:] != 0.0).any():
        q = p + int(np.argmax(ledger[vw, p:] != 0.0))
        problems.append(f"own update of minibatch {q} >= p is already in")
    wave = p // own_nm
    for v in range(ledger.shape[0]):
        nm_v = _nm_of(nm, v)
        through = (wave - staleness - 1) * nm_v  # VW v's minibatches of waves <= c - D - 2
        missing = np.argwhere(~present[v, : max(through, 0)])
        if len(missing):
            q = int(missing[0][0])
            problems.append(
                f"G: vw {v}'s update of minibatch {q} (wave {q // nm_v} <= c - D - 2 = "
                f"{wave - staleness - 2}) is missing"
            )
            break
    return problems
