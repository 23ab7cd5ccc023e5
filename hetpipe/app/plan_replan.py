"""`hetpipe plan` at [train] freeze's points: the best plan for the model with those layers frozen (the freed
GPUs as more VWs, the trainable layers on fewer), what it gains over keeping the VWs, and the plan file whose
VWs train planned spans, so `hetpipe train --plan` runs the re-plans (docs/planning.md#re-planning)."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from hetpipe.core.config.schema import ClusterConfig
from hetpipe.core.planning.candidates import Candidate, best
from hetpipe.core.planning.plan import Plan

if TYPE_CHECKING:
    from hetpipe.compute.build import VwLayout

__all__ = ["Replan", "plan_file", "plan_phases", "replan_lines", "replans", "replans_json", "spanned_layouts"]


@dataclass(frozen=True)
class Replan:
    """At wave `wave` the model's first `layers` layers freeze: the chosen plan's rate with its VWs kept
    (`kept`, samples/s) and the best plan found for the frozen model (`chosen`)."""

    wave: int
    layers: int
    kept: float
    chosen: Candidate

    @property
    def gain(self) -> float:
        """The re-plan's predicted samples/s over keeping the VWs."""
        return self.chosen.samples_per_s / self.kept if self.kept > 0 else 0.0


def replans(
    ruled: ClusterConfig, chosen: Candidate, search: Callable[[ClusterConfig, int], list[Candidate]]
) -> list[Replan]:
    """The re-plan at each of `ruled`'s freeze points: `search(config, frozen layers)` plans the config
    (its freeze left out) at the chosen plan's D, schedule, batch and training rule, which a run keeps
    throughout; empty without freeze points or a chosen plan."""
    if not ruled.train.freeze or chosen.plan is None:
        return []
    plain = dataclasses.replace(ruled, train=dataclasses.replace(ruled.train, freeze=()))
    kept = {(wave, layers): rate for wave, layers, rate in chosen.after_freeze}
    return [
        Replan(wave, layers, kept.get((wave, layers), 0.0), best(search(plain, layers)))
        for wave, layers in ruled.train.freeze
    ]


def replan_lines(found: Sequence[Replan]) -> list[str]:
    """A line per freeze point: the re-plan, its prediction and its gain over keeping the VWs."""
    lines = []
    for r in found:
        c = r.chosen
        head = f"re-plan at wave {r.wave} (layers 0-{r.layers - 1} frozen): "
        if c.plan is None:
            lines.append(head + f"none found ({c.reason or 'no feasible plan'}); the VWs are kept")
            continue
        vws = "; ".join(",".join(vw.gpus) for vw in c.plan.vws)
        lines.append(
            head + f"{len(c.plan.vws)} VW{'s' if len(c.plan.vws) > 1 else ''} ({vws}), "
            f"{c.samples_per_s:,.0f} samples/s predicted, "
            f"{r.gain:.2f}x keeping the VWs ({r.kept:,.0f})"
        )
    return lines


def replans_json(found: Sequence[Replan]) -> list[dict[str, Any]]:
    return [
        {
            "wave": r.wave,
            "layers": r.layers,
            "kept_samples_per_s": r.kept,
            "samples_per_s": r.chosen.samples_per_s,
            "gain": r.gain,
            "plan": dataclasses.asdict(r.chosen.plan) if r.chosen.plan is not None else None,
        }
        for r in found
    ]


def plan_file(plan: Plan, found: Sequence[Replan]) -> str:
    """`hetpipe plan --out`'s file: the plan, and (when there are any) under "replans" each freeze point's
    plan that pays (more samples/s than keeping the VWs) with the wave it starts at."""
    doc = dataclasses.asdict(plan)
    paying = [
        {"wave": r.wave, "plan": dataclasses.asdict(r.chosen.plan)}
        for r in found
        if r.chosen.plan is not None and r.gain > 1.0
    ]
    if paying:
        doc["replans"] = paying
    return json.dumps(doc, indent=1)


def plan_phases(text: str) -> list[tuple[int, Plan]]:
    """A plan file's plans with the wave each starts at: [(0, the plan), (wave, its re-plan), ...]."""
    doc = json.loads(text)
    later = doc.pop("replans", [])
    phases = [(0, Plan.from_json(json.dumps(doc)))]
    for entry in later:
        phases.append((int(entry["wave"]), Plan.from_json(json.dumps(entry["plan"]))))
    return phases


def spanned_layouts(phases: Sequence[tuple[int, Plan]], batch: int, waves: int) -> tuple[VwLayout, ...]:
    """Every phase's VWs in order, each training its phase's waves (none of them when the plan has one
    phase: every VW trains every wave)."""
    from hetpipe.compute.build import VwLayout  # (torch: not at `hetpipe plan`'s start)

    ends = [start for start, _ in phases[1:]] + [waves]
    spanned = len(phases) > 1
    return tuple(
        VwLayout(vw.gpus, vw.split, vw.nm, vw.batch(batch), (start, end) if spanned else None)
        for (start, plan), end in zip(phases, ends, strict=True)
        for vw in plan.vws
    )
