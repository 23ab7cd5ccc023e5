"""What `hetpipe plan` shows by default: the candidates in the order the planner chooses, rows that print the
same but for D folded into one, the one reason each runner-up lost, and lines wrapped to a width. Pure."""

from __future__ import annotations

import textwrap
from collections.abc import Sequence
from dataclasses import dataclass

from hetpipe.core.planning.candidates import D_TOLERANCE, Candidate, best, own_lag, ranked
from hetpipe.core.planning.headroom import headroom_text
from hetpipe.core.planning.partition import minibatch_time_s
from hetpipe.core.planning.report import (
    D_COLUMN,
    MEMORY_COLUMN,
    TableRow,
    format_plan,
    render_table,
    table_header,
    table_row,
)

__all__ = [
    "TOP_ROWS",
    "Fold",
    "d_text",
    "default_view",
    "fold",
    "folded_table",
    "loser_reason",
    "percent",
    "wrap",
]

TOP_ROWS = 5  # distinct plans the default view shows


@dataclass(frozen=True)
class Fold:
    """Candidates whose table rows are the same but for D (and the peak memory, which grows with D), best
    ranked first."""

    members: tuple[Candidate, ...]

    @property
    def lead(self) -> Candidate:
        return self.members[0]

    @property
    def ds(self) -> list[int]:
        return sorted({c.staleness for c in self.members if c.staleness is not None})


def fold(candidates: Sequence[Candidate]) -> list[Fold]:
    """The candidates in the planner's order (candidates.ranked), those whose rows print the same but for D
    and the peak memory folded into one at the place of the highest ranked; baselines and infeasible
    candidates fold too when their rows match."""
    converge = any(c.samples_source for c in candidates)
    groups: dict[TableRow, list[Candidate]] = {}
    for c in ranked(candidates):
        row = table_row(c, False, converge)
        key = (*row[:D_COLUMN], *row[D_COLUMN + 1 : len(row) + MEMORY_COLUMN], row[-1])
        groups.setdefault(key, []).append(c)
    return [Fold(tuple(members)) for members in groups.values()]


def d_text(ds: Sequence[int], searched: Sequence[int]) -> str:
    """The D values of a fold: `0-4` when they are every searched value from the first to the last, else
    `0,4`; `-` for none."""
    if not ds:
        return "-"
    if len(ds) == 1:
        return str(ds[0])
    between = sorted(d for d in set(searched) if ds[0] <= d <= ds[-1])
    return f"{ds[0]}-{ds[-1]}" if list(ds) == between else ",".join(map(str, ds))


def folded_table(folds: Sequence[Fold], top: Candidate | None, searched: Sequence[int]) -> str:
    """The table of candidates.format_table, one row per fold: its D values as d_text, the peak memory of its
    fullest member; * on the fold that holds `top`."""
    converge = any(c.samples_source for f in folds for c in f.members)
    rows = []
    for f in folds:
        fullest = max(f.members, key=lambda c: c.peak.fraction if c.peak else 0.0)
        row = list(table_row(f.lead, any(c is top for c in f.members), converge))
        row[D_COLUMN] = d_text(f.ds, searched)
        row[len(row) + MEMORY_COLUMN] = table_row(fullest, False, converge)[MEMORY_COLUMN]
        rows.append(tuple(row))
    return render_table(table_header(converge), rows)


def percent(share: float) -> str:
    """`3%`, or `0.4%` under 10% (so that a small difference does not print as 0%)."""
    return f"{share:.0%}" if round(abs(share), 4) >= 0.1 else f"{share:.1%}"


def loser_reason(c: Candidate, top: Candidate) -> str:
    """The one reason `c` lost to `top`, from what both carry: cannot run; not run by hetpipe; its time to
    target; a gain under the D tolerance; the same rate and the planner's tie-break; else how much slower and
    what holds it back."""
    if not c.feasible:
        return f"cannot run: {c.reason.splitlines()[0]}"
    if c.time_to_target_s is not None and top.time_to_target_s:
        ratio = c.time_to_target_s / top.time_to_target_s
        return f"{ratio:.2f}x the best's predicted time to target" + (
            f" ({c.samples_to_target / top.samples_to_target:.2f}x its samples to target)"
            if c.samples_to_target and top.samples_to_target and c.samples_per_s >= top.samples_per_s
            else ""
        )
    if not c.runnable:
        return f"{c.samples_per_s:.4g} samples/s, a baseline hetpipe does not run (shown for comparison)"
    share = c.samples_per_s / top.samples_per_s - 1 if top.samples_per_s else 0.0
    if abs(share) < 0.0005:
        return f"the same {c.samples_per_s:.4g} samples/s; {_tie_break(c, top)}"
    if share > 0:
        return f"{percent(share)} faster, under the {D_TOLERANCE:.0%} a plan must gain to be chosen over " + (
            f"one of D={top.staleness}"
            if (c.staleness or 0) > (top.staleness or 0)
            else f"one whose VWs lag {own_lag(top.plan)} own updates (it lags {own_lag(c.plan)})"
        )
    return f"{percent(-share)} slower: {_held_back(c, top)}"


def _tie_break(c: Candidate, top: Candidate) -> str:
    """Why the best wins a tie: smaller D, fewer own updates lagged, more headroom on the PS links, or listed
    first."""
    if (c.staleness or 0) > (top.staleness or 0):
        return f"the best has the smaller D ({top.staleness} vs {c.staleness})"
    lags = (own_lag(c.plan), own_lag(top.plan))
    if lags[0] > lags[1]:
        return f"the best's VWs lag fewer own updates ({lags[1]} vs {lags[0]})"
    if headroom := headroom_text(c, top):
        return f"the best {headroom}"
    return f"a tie, and the best is searched first ({top.policy} {top.schedule})"


def _held_back(c: Candidate, top: Candidate) -> str:
    """What makes `c` slower, the first that applies: fewer GPUs, a busy PS link, waits at the WSP gate, VWs
    of unequal speed, else its slowest stage."""
    if c.gpus_used < top.gpus_used:
        return f"uses {c.gpus_used} of the {top.gpus_used} GPUs the best uses"
    if c.ps_utilisation > 0.8:
        return f"PS link {c.ps_utilisation:.0%} busy"
    if c.gate_wait_share > top.gate_wait_share + 0.02:
        return f"stages wait at the WSP gate {c.gate_wait_share:.0%} of the time"
    if c.plan is not None and len(c.plan.vws) > 1:
        waves = [vw.nm * minibatch_time_s(vw, c.plan.schedule, c.plan.recompute) for vw in c.plan.vws]
        if max(waves) > 1.1 * min(waves):
            slow, fast = waves.index(max(waves)), waves.index(min(waves))
            return (
                f"vw{slow}'s wave takes {max(waves):.3g} s, vw{fast}'s {min(waves):.3g} s, and WSP holds the "
                f"fast VWs to the slowest"
            )
    if top.plan is not None and top.plan.vws:
        slowest = max(s.time_s for vw in top.plan.vws for s in vw.stages)
        return f"slowest stage {c.bottleneck} (the best's slowest: {slowest:.3g} s)"
    return f"slowest stage {c.bottleneck}"


def wrap(text: str, width: int) -> str:
    """Every line of `text` at most `width` characters: a longer one broken at spaces (or mid-word when a word
    is too long), its continuation lines indented 4 past the line's own indent."""
    out: list[str] = []
    for line in text.splitlines():
        if len(line) <= width:
            out.append(line)
            continue
        indent = line[: len(line) - len(line.lstrip())]
        more = indent + "    " if len(indent) + 4 < width // 2 else indent
        out += textwrap.wrap(
            line.lstrip(),
            width=width,
            initial_indent=indent,
            subsequent_indent=more,
            break_on_hyphens=False,
        )
    return "\n".join(out)


def default_view(
    candidates: Sequence[Candidate],
    searched: Sequence[int],
    considered: int,
    width: int,
    rows: int = TOP_ROWS,
) -> str:
    """`hetpipe plan` without --all: the `rows` best distinct plans (folded, best first), the baselines in one
    line, the best plan's layout (alike VWs folded), why each other plan shown lost, and how many more
    candidates `considered` counts. `searched`: the D values searched; `width`: the reasons are wrapped to
    it."""
    top = best(candidates)
    folds = fold(candidates)
    distinct = sum(f.lead.runnable for f in folds)
    shown = [f for f in folds if f.lead.runnable or not f.lead.feasible][:rows]
    baselines = [c for f in folds if f.lead.feasible and not f.lead.runnable for c in f.members]
    lines = [
        f"the {min(distinct, rows)} best of {distinct} distinct plans, best first (rows that differ only in "
        "D folded into one):",
        folded_table(shown, top, searched),
    ]
    if baselines:
        lines.append("baselines (shown for comparison, hetpipe does not run them): " + _baselines(baselines))
    lines += ["", "best: " + format_plan(top, fold_alike=True)]
    losers = [f for f in shown if f.lead is not top]
    if losers:
        lines += ["", "why the others lost:"]
        lines += [wrap(f"  {_fold_label(f, searched)}: {loser_reason(f.lead, top)}", width) for f in losers]
    listed = sum(len(f.members) for f in shown) + len(baselines)
    kept = len(candidates) - listed
    more = f"{considered - listed} more candidates considered; `--all` lists the {kept} kept"
    if considered > len(candidates):
        more += f", the other {considered - len(candidates)} were left out by the search (counted above)"
    return "\n".join([*lines, "", more])


def _fold_label(f: Fold, searched: Sequence[int]) -> str:
    """`ed pipedream D 0-4`; a baseline's policy alone."""
    c = f.lead
    if c.staleness is None:
        return f"{c.policy} {c.schedule}" if c.schedule and not c.feasible else c.policy
    return (
        f"{c.policy} {c.schedule} D {d_text(f.ds, searched)}" if c.schedule else f"{c.policy} D {c.staleness}"
    )


def _baselines(baselines: Sequence[Candidate]) -> str:
    """`allreduce 366.4 samples/s (35% of capacity), sync-pipeline 493.9 samples/s (47% of capacity)`."""
    return ", ".join(
        f"{c.policy} {c.samples_per_s:.4g} samples/s"
        + ("" if c.capacity_share is None else f" ({c.capacity_share:.0%} of capacity)")
        for c in baselines
    )
