"""The planner's output: the candidate table, one plan stage by stage, why each candidate lost to the best
(--explain), and the machine-readable form (--json). Pure: candidates in, text and dicts out."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from hetpipe.core.errors import HetpipeError
from hetpipe.core.pipeline.schedule import get_schedule
from hetpipe.core.planning.candidates import ALLREDUCE, D_TOLERANCE, SYNC_PIPELINE, Candidate, best, own_lag
from hetpipe.core.planning.headroom import headroom_text
from hetpipe.core.planning.memory import format_bytes
from hetpipe.core.planning.partition import minibatch_time_s
from hetpipe.core.planning.plan import Plan, VwPlan
from hetpipe.core.planning.relays import relay_text
from hetpipe.core.wsp.groups import group_node

__all__ = [
    "D_COLUMN",
    "MEMORY_COLUMN",
    "TableRow",
    "candidates_json",
    "explain",
    "format_plan",
    "format_table",
    "gpu_set",
    "memory_text",
    "render_table",
    "table_header",
    "table_row",
]


def _splits(plan: Plan) -> str:
    splits = ["/".join(map(str, vw.split)) for vw in plan.vws]
    return f"{splits[0]} x{len(splits)}" if len(set(splits)) == 1 and len(splits) > 1 else ", ".join(splits)


def format_table(candidates: Sequence[Candidate]) -> str:
    """One row per candidate: policy, D, Nm, VWs x GPUs, splits, samples/s, fullest GPU, bottleneck;
    * = best."""
    try:
        top = best(candidates)
    except HetpipeError:
        top = None
    converge = any(c.samples_source for c in candidates)
    return render_table(table_header(converge), [table_row(c, c is top, converge) for c in candidates])


TableRow = tuple[str, ...]
D_COLUMN = 3  # the column of D in table_header's row
MEMORY_COLUMN = -2  # peak memory (fullest GPU)


def table_header(converge: bool) -> TableRow:
    """The table's column names; with `converge` (a calibration priced the candidates) both factors of the
    time to target after the capacity."""
    header = (
        "",
        "policy",
        "schedule",
        "D",
        "Nm",
        "VWs",
        "GPUs",
        "layers per stage",
        "samples/s",
        "capacity",
        "peak memory (fullest GPU)",
        "bottleneck",
    )
    return (*header[:10], "samples to target", "s to target", *header[10:]) if converge else header


def table_row(c: Candidate, is_best: bool, converge: bool) -> TableRow:
    """One candidate's cells under table_header(converge); the first is `*` for the best."""
    if c.plan is not None:
        vws, splits = str(len(c.plan.vws)), _splits(c.plan)
    elif c.policy == ALLREDUCE and c.feasible:
        vws, splits = f"{c.gpus_used} replicas", "whole model"
    elif c.policy == SYNC_PIPELINE and c.feasible:
        vws, splits = "1 pipeline", "-"
    else:
        vws, splits = "-", "-"
    row = (
        "*" if is_best else "",
        c.policy,
        c.schedule or "-",
        "-" if c.staleness is None else str(c.staleness),
        _nm_text(c),
        vws,
        str(c.gpus_used) if c.feasible else "-",
        splits,
        f"{c.samples_per_s:.4g}" if c.feasible else "infeasible",
        _capacity_text(c),
        memory_text(c),
        c.bottleneck if c.feasible else c.reason.split("\n")[0],
    )
    if converge:
        ttt = "-" if c.time_to_target_s is None else f"{c.time_to_target_s:.4g}"
        row = (*row[:10], _samples_text(c), ttt, *row[10:])
    return row


def memory_text(c: Candidate) -> str:
    """The fullest GPU: `7.81 GiB/8.00 GiB n3:0 p4000`, or `-`."""
    peak = c.peak
    if peak is None:
        return "-"
    return f"{format_bytes(peak.memory_bytes)}/{format_bytes(peak.limit_bytes)} {peak.gpu} {peak.gpu_type}"


def render_table(header: TableRow, rows: Sequence[TableRow]) -> str:
    """The rows under the header, each column as wide as its widest cell but the last."""
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header) - 1)]
    lines = [
        "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=False)) + "  " + row[-1]
        for row in [header, *rows]
    ]
    return "\n".join(line.rstrip() for line in lines)


def format_plan(candidate: Candidate, *, fold_alike: bool = False) -> str:
    """The VWs of one candidate, stage by stage: GPU, layers, time, memory. `fold_alike`: VWs next to each
    other with the same work, GPU types, layers, times and memory share one block (`vw0-3`), each stage
    naming all their GPUs (`n1:0-3`)."""
    assert candidate.plan is not None
    plan = candidate.plan
    lines = [
        f"{candidate.label}, {_work_label(candidate)}: {candidate.samples_per_s:.4g} samples/s predicted"
        f"{_of_capacity(candidate)} (gate waits {candidate.gate_wait_share:.0%} of stage time, PS link "
        f"{candidate.ps_utilisation:.0%} busy)"
    ]
    for first, vws in _alike_runs(plan, fold_alike):
        vw = vws[0]
        per_minibatch = minibatch_time_s(vw, plan.schedule, plan.recompute)
        name = f"vw{first}" if len(vws) == 1 else f"vw{first}-{first + len(vws) - 1}"
        lines.append(
            f"  {name}: nm {vw.nm} x batch {vw.batch(plan.batch_size)}, {per_minibatch:.3g} s/minibatch, "
            f"a wave {vw.nm * per_minibatch:.3g} s"
        )
        for j, s in enumerate(vw.stages):
            gpus = gpu_set([other.stages[j].gpu for other in vws])
            lines.append(
                f"    stage {j}  {gpus:<8} {s.gpu_type:<12} layers {s.start:>3}-{s.stop - 1:<3} "
                f"{s.time_s:8.3g} s  {format_bytes(s.memory_bytes):>10} of "
                f"{format_bytes(s.memory_limit_bytes)}"
            )
    lines += [f"  note: {note}" for note in candidate.notes]
    lines += [f"  bound: {bound}" for bound in candidate.bounds]
    lines += [f"  {line}" for line in _relay_lines(candidate)]
    lines += [f"  {line}" for line in _freeze_lines(candidate)]
    return "\n".join(lines)


def _freeze_lines(c: Candidate) -> list[str]:
    """One line per [train] freeze point: the same plan's prediction once those layers are frozen."""
    return [
        f"after freezing layers 0-{layers - 1} at wave {wave}: {rate:,.0f} samples/s predicted "
        f"({rate / c.samples_per_s:.2f}x; the same VWs: no backward or PS traffic for them)"
        for wave, layers, rate in c.after_freeze
        if c.samples_per_s > 0
    ]


def _relay_lines(c: Candidate) -> list[str]:
    """The line "node aggregation: ..." when the candidate's prediction assumes [ps] node_aggregation."""
    if not c.node_aggregation or c.plan is None:
        return []
    return [f"node aggregation: {relay_text(c.relayed, [vw.gpus for vw in c.plan.vws])}"]


def _alike_runs(plan: Plan, fold: bool) -> list[tuple[int, list[VwPlan]]]:
    """The plan's VWs as (index of the first, the VWs) runs: each VW alone, or with `fold` the VWs next to
    each other that print the same but for their GPUs."""

    def look(vw: VwPlan) -> tuple:
        stages = tuple((s.gpu_type, s.start, s.stop, f"{s.time_s:.3g}", s.memory_bytes) for s in vw.stages)
        return (vw.nm, vw.batch(plan.batch_size), stages)

    runs: list[tuple[int, list[VwPlan]]] = []
    for v, vw in enumerate(plan.vws):
        if fold and runs and look(runs[-1][1][0]) == look(vw):
            runs[-1][1].append(vw)
        else:
            runs.append((v, [vw]))
    return runs


def gpu_set(gpus: Sequence[str]) -> str:
    """GPUs in few characters: `n1:0-3` for n1:0, n1:1, n1:2, n1:3; `n0:1,n2:0-1` across nodes."""
    parts: list[tuple[str, list[int]]] = []
    for gpu in gpus:
        node, _, index = gpu.rpartition(":")
        if not node or not index.isdigit():
            parts.append((gpu, []))
        elif parts and parts[-1][0] == node and parts[-1][1] and parts[-1][1][-1] == int(index) - 1:
            parts[-1][1].append(int(index))
        else:
            parts.append((node, [int(index)]))
    return ",".join(
        node if not run else f"{node}:{run[0]}" + (f"-{run[-1]}" if len(run) > 1 else "")
        for node, run in parts
    )


def _nm_text(c: Candidate) -> str:
    """The Nm column: "4", or with per-VW work each VW's Nm x batch ("4x72 x2, 4x48 x3")."""
    if c.plan is None or c.nm is None:
        return "-" if c.nm is None else str(c.nm)
    work = [(vw.nm, vw.batch(c.plan.batch_size)) for vw in c.plan.vws]
    if all(w == (c.nm, c.plan.batch_size) for w in work):
        return str(c.nm)
    runs: list[list] = []
    for w in work:
        if runs and runs[-1][0] == w:
            runs[-1][1] += 1
        else:
            runs.append([w, 1])
    return ", ".join(f"{nm}x{b}" + (f" x{n}" if n > 1 else "") for (nm, b), n in runs)


def _work_label(c: Candidate) -> str:
    """`nm=4`, or `per-VW work` when the VWs' Nm or batch differ."""
    text = _nm_text(c)
    return f"nm={text}" if text.isdigit() or text == "-" else "per-VW work (nm x batch)"


def _capacity_text(c: Candidate) -> str:
    share = c.capacity_share
    return "-" if share is None or not c.feasible else f"{share:.0%}"


def _of_capacity(c: Candidate) -> str:
    """`, 99% of the cluster's capacity (1937 samples/s)`, or "" when it is not known."""
    share = c.capacity_share
    return "" if share is None else f", {share:.0%} of the cluster's capacity ({c.capacity:.4g} samples/s)"


def _samples_text(c: Candidate) -> str:
    """ "41,000 (fitted)" / "- (not reached)" / "-"."""
    if not c.samples_source:
        return "-"
    value = "-" if c.samples_to_target is None else f"{c.samples_to_target:,.0f}"
    return f"{value} ({c.samples_source})"


def _target_text(c: Candidate, top: Candidate | None = None) -> str:
    """Both factors of the predicted time to target, for explain: samples to target and the time they take."""
    if not c.samples_source:
        return ""
    if c.time_to_target_s is None:
        return f"; samples to target {_samples_text(c)}: no time to target"
    share = (
        f", {c.time_to_target_s / top.time_to_target_s:.2f}x the best's"
        if top is not None and top.time_to_target_s
        else ""
    )
    return f"; {_samples_text(c)} samples to target -> {c.time_to_target_s:.4g} s predicted{share}"


def explain(candidates: Sequence[Candidate]) -> str:
    """Why each candidate lost to the best: infeasible, slower VWs, gate waits, the PS, transfers, fewer GPUs;
    with a convergence calibration, both factors of every candidate's predicted time to target."""
    top = best(candidates)
    lines = [
        f"best: {top.label}, {_work_label(top)}, {top.samples_per_s:.4g} samples/s on {top.gpus_used} GPUs"
        f"{_of_capacity(top)}{_target_text(top)}; bottleneck {top.bottleneck}",
        f"    memory per GPU: {_memory_per_gpu(top)}",
        *(f"    bound: {bound}" for bound in top.bounds),
        *(f"    {line}" for line in _relay_lines(top)),
    ]
    for c in candidates:
        if c is top:
            continue
        if not c.feasible:
            lines.append(f"{c.label}: cannot run: {c.reason}")
            continue
        share = c.samples_per_s / top.samples_per_s if top.samples_per_s else 0.0
        head = (
            f"{c.label}: {c.samples_per_s:.4g} samples/s ({share:.0%} of the best{_capacity_part(c)})"
            f"{_target_text(c, top)}"
        )
        lines.append(f"{head}: {'; '.join(_why(c, top)) or 'the same prediction; the best is listed first'}")
        lines.append(f"    memory per GPU: {_memory_per_gpu(c)}")
        lines += [f"    note: {note}" for note in c.notes]
        lines += [f"    bound: {bound}" for bound in c.bounds]
        lines += [f"    {line}" for line in _relay_lines(c)]
    return "\n".join(lines)


def _capacity_part(c: Candidate) -> str:
    share = c.capacity_share
    return "" if share is None else f", {share:.0%} of capacity"


def _memory_per_gpu(c: Candidate) -> str:
    """`n0:0 1.20 GiB/12.00 GiB, n0:1 ...`: each GPU's peak by the memory model and what it may use."""
    return (
        ", ".join(f"{u.gpu} {format_bytes(u.memory_bytes)}/{format_bytes(u.limit_bytes)}" for u in c.memory)
        or "-"
    )


def _why(c: Candidate, top: Candidate) -> list[str]:
    """Why `c` lost to `top`, reason by reason: what the two share in GPUs and time to target, then what kind
    of candidate `c` is (a baseline, the same plan at another D, or another plan), then its waits."""
    why = _why_overall(c, top)
    if c.policy == ALLREDUCE:
        why.append(
            f"every step waits for the slowest replica ({c.bottleneck}); "
            f"synchronising takes {c.comm_share:.0%} of the step"
        )
        return why
    if c.policy == SYNC_PIPELINE:
        why.append(f"one pipeline flushed every minibatch (bubble) with its slowest stage {c.bottleneck}")
        return why
    assert c.plan is not None
    if c.schedule != top.schedule:
        why.append(
            f"schedule {c.schedule} (best: {top.schedule})"
            + (
                "; flushing every wave costs the pipeline's fill and drain"
                if get_schedule(c.schedule).drains
                else ""
            )
        )
    if top.plan is not None and (c.policy, c.schedule, c.plan.vws) == (
        top.policy,
        top.schedule,
        top.plan.vws,
    ):
        return why + _why_only_d(c, top)
    return why + _why_other_plan(c, top) + _why_waits(c, top)


def _why_overall(c: Candidate, top: Candidate) -> list[str]:
    """Fewer GPUs; more samples/s but more samples to target; a baseline that predicts more."""
    why = []
    if c.gpus_used < top.gpus_used:
        why.append(f"uses {c.gpus_used} GPUs, not {top.gpus_used}")
    if (
        c.time_to_target_s is not None
        and top.time_to_target_s is not None
        and top.samples_to_target
        and c.samples_per_s >= top.samples_per_s
    ):
        why.append(
            f"more samples/s than the best, but {c.samples_to_target / top.samples_to_target:.2f}x its "
            "samples to target"
        )
    if c.plan is None and (
        c.samples_per_s > top.samples_per_s
        or (
            c.time_to_target_s is not None
            and top.time_to_target_s is not None
            and c.time_to_target_s < top.time_to_target_s
        )
    ):
        why.append("predicts more than the best, but hetpipe does not run it: it is shown for comparison")
    return why


def _why_only_d(c: Candidate, top: Candidate) -> list[str]:
    """The best's VWs, splits and nm at another D."""
    why = [f"the same VWs, splits and nm as the best; only D differs (D={c.staleness} vs {top.staleness})"]
    if c.samples_per_s > top.samples_per_s:
        why.append(f"its gain is under {D_TOLERANCE:.0%}, not worth the staler weights of a larger D")
    elif c.gate_wait_share > top.gate_wait_share + 0.005:
        why.append(_gate_text(c, top))
    return why


def _gate_text(c: Candidate, top: Candidate) -> str:
    return (
        f"stages wait at the WSP gate {c.gate_wait_share:.0%} of the time (best: {top.gate_wait_share:.0%})"
    )


def _why_other_plan(c: Candidate, top: Candidate) -> list[str]:
    """Another plan: within 1% of the best, VWs of unequal speed, a gain not worth its staleness, or
    slower."""
    assert c.plan is not None
    # each VW's wave alone (its Nm x its time per minibatch): WSP paces every VW's waves by the slowest's
    rates = [vw.nm * minibatch_time_s(vw, c.plan.schedule, c.plan.recompute) for vw in c.plan.vws]
    if abs(c.samples_per_s - top.samples_per_s) <= 0.01 * top.samples_per_s and c.gpus_used == top.gpus_used:
        lags = (own_lag(c.plan), own_lag(top.plan))
        if lags[0] > lags[1] and c.staleness == top.staleness:
            which = f"lags fewer own updates ({lags[1]} vs {lags[0]})"
        else:
            which = headroom_text(c, top) or "has the smaller D or comes first (np, ed, hd, dp, explicit)"
        return [f"within 1% of the best, which {which}"]
    if max(rates) > 1.1 * min(rates):
        slow, fast = rates.index(max(rates)), rates.index(min(rates))
        return [
            f"its VWs differ in speed (a wave of vw{slow} takes {max(rates):.3g} s, of vw{fast} "
            f"{min(rates):.3g}); "
            f"WSP holds the fast ones to the slowest ({c.bottleneck})"
        ]
    if c.samples_per_s > top.samples_per_s and c.staleness == top.staleness:
        return [
            f"its gain is under {D_TOLERANCE:.0%}, not worth lagging {own_lag(c.plan)} own updates "
            f"(best: {own_lag(top.plan)})"
        ]
    if c.samples_per_s > top.samples_per_s:
        return [
            f"its gain is under {D_TOLERANCE:.0%}, not worth the staler weights of D={c.staleness} "
            f"(best: D={top.staleness})"
        ]
    return [f"slowest stage {c.bottleneck}"]


def _why_waits(c: Candidate, top: Candidate) -> list[str]:
    """Gate waits, a busy PS link, a pipe Nm cannot fill."""
    assert c.plan is not None
    why = []
    if c.gate_wait_share > top.gate_wait_share + 0.02:
        why.append(_gate_text(c, top))
    if c.ps_utilisation > 0.8:
        why.append(f"the PS link is {c.ps_utilisation:.0%} busy")
    if c.nm is not None and top.nm is not None and c.plan.vws and c.nm < len(c.plan.vws[0].stages):
        why.append(f"nm={c.nm} cannot fill a {len(c.plan.vws[0].stages)}-stage pipe")
    return why


def candidates_json(
    candidates: Sequence[Candidate], inputs: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """Machine-readable candidates: every field, plans as Plan.to_json's dicts, `best` as an index (or
    None)."""
    try:
        top: int | None = list(candidates).index(best(candidates))
    except HetpipeError:
        top = None
    rows = []
    for c in candidates:
        rows.append(
            {
                "policy": c.policy,
                "staleness": c.staleness,
                "nm": c.nm,
                "feasible": c.feasible,
                "runnable": c.runnable,
                "samples_per_s": c.samples_per_s,
                "gpus_used": c.gpus_used,
                "bottleneck": c.bottleneck,
                "reason": c.reason,
                "notes": list(c.notes),
                "gate_wait_share": c.gate_wait_share,
                "ps_utilisation": c.ps_utilisation,
                "comm_share": c.comm_share,
                "run_samples_per_s": c.run_samples_per_s,
                "schedule": c.schedule,
                "samples_to_target": c.samples_to_target,
                "samples_source": c.samples_source,
                "time_to_target_s": c.time_to_target_s,
                "capacity_samples_per_s": c.capacity,
                "capacity_share": c.capacity_share,
                "bounds": list(c.bounds),
                "node_aggregation": c.node_aggregation,
                "relayed": _relayed_json(c),
                "after_freeze": [
                    {"wave": wave, "layers": layers, "samples_per_s": rate}
                    for wave, layers, rate in c.after_freeze
                ],
                "memory": [dataclasses.asdict(u) for u in c.memory],
                "plan": dataclasses.asdict(c.plan) if c.plan is not None else None,
            }
        )
    return {"best": top, "inputs": dict(inputs or {}), "candidates": rows}


def _relayed_json(c: Candidate) -> list[dict[str, Any]]:
    """Each relayed group of the candidate: its node and its VWs."""
    if c.plan is None:
        return []
    gpus = [vw.gpus for vw in c.plan.vws]
    return [{"node": group_node(gpus, group), "vws": list(group)} for group in c.relayed]
