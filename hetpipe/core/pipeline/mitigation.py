"""Staleness mitigations (`[train] mitigation`, docs/convergence.md): their names, what each needs, and the
pure arithmetic both the runtime (hetpipe.compute.stage_compute) and the reference (hetpipe.compute.reference)
take from here: learning-rate factors, how many own updates a minibatch's weights lag, the
discrepancy-correction decay. No torch; the tensor arithmetic is written in the two compute modules.

  pipemare   PipeMare (Yang et al., MLSys 2021; seed notes 002, slides 13 and 18): T1, each stage's learning
             rate divided by its delay tau = 1 + (own updates a minibatch's gradient arrives late), the power
             annealed from 1 to 0 over `warmup_waves`; T2, discrepancy correction where the backward runs on
             the live weights (wsp with weight_stashing = false): it runs on w - s * delta, delta an
             exponential average of the stage's updates, s the updates between the forward and the backward.
  spectrain  SpecTrain (Chen et al., 2018) / XPipe (Guan et al., 2019) weight prediction (seed notes 002 and
             004): every weight version a forward uses is predicted s updates ahead, s = the own updates
             between the forward and the update that applies its gradient (Nm - 1 at stage 0 of wsp), from
             the optimizer's state: momentum -lr * buffer, Adam -lr * m_hat / (sqrt(v_hat) + eps), plain SGD
             the last update (linear weight prediction). With aggregation "server" the VWs hold no optimizer:
             the pulled weights are predicted D + 1 versions ahead from the last two pulls.
  average    model averaging at every pull (the wave is the period): the PS folds the mean of the VWs'
             updates (needs ps.aggregation = "mean") and a rebase adds the stage's own not yet folded updates
             at the share the fold will give them (1 / VWs), so every VW trains the average model rather than
             the average plus its own drift.
  warmup     gradual warm-up scaled by the number of VWs (Goyal et al., 2017): the local optimizers' learning
             rate starts at lr / VWs and rises linearly to lr over `warmup_waves` waves.

Several combine with "+" ("spectrain+warmup"); "none" is today's arithmetic bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from hetpipe.core.errors import UsageError, did_you_mean
from hetpipe.core.wsp.aggregation import AGGREGATIONS, Aggregation, get_aggregation

__all__ = [
    "DC_DECAY",
    "MITIGATIONS",
    "Lag",
    "dc_gamma",
    "format_mitigation",
    "mitigation_conflicts",
    "parse_mitigation",
    "pipemare_lr_factor",
    "stage_lags",
    "warmup_lr_factor",
]

MITIGATIONS = ("pipemare", "spectrain", "average", "warmup")
DC_DECAY = 0.1  # PipeMare T2: gamma = DC_DECAY ** (1 / s); the slides give gamma = D^(1/tau) without a value


def parse_mitigation(text: str) -> tuple[str, ...]:
    """ "spectrain+warmup" -> ("spectrain", "warmup") in canonical order; "none" or "" -> (). UsageError names
    the unknown or repeated part and the known names."""
    parts = [p.strip() for p in text.split("+")] if text.strip() else []
    if parts == ["none"]:
        return ()
    known = ", ".join(("none", *MITIGATIONS))
    for part in parts:
        if part not in MITIGATIONS:
            hint = ' ("none" stands alone)' if part == "none" else did_you_mean(part, MITIGATIONS)
            raise UsageError(
                f'unknown mitigation "{part}" in "{text}": known mitigations are {known}, joined '
                f'with "+" (e.g. "spectrain+warmup"){hint}'
            )
        if parts.count(part) > 1:
            raise UsageError(f'mitigation "{part}" is named twice in "{text}": name it once')
    return tuple(m for m in MITIGATIONS if m in parts)


def format_mitigation(names: Sequence[str]) -> str:
    """The inverse of parse_mitigation: () -> "none"."""
    return "+".join(names) if names else "none"


def mitigation_conflicts(
    names: Sequence[str], *, aggregation: str, schedule_stashing: str, weight_stashing: bool
) -> list[tuple[str, str]]:
    """(what is wrong, the fix) for each mitigation that cannot run with these settings; [] when all can. What
    the aggregation rule allows is read off its traits (hetpipe.core.wsp.aggregation)."""
    rule = get_aggregation(aggregation)
    out = []
    averages = rule.local_optimizer and rule.share == "mean"
    if "average" in names and not averages:
        out.append(
            (
                f'"average" averages the VWs\' models, but ps.aggregation is "{aggregation}"',
                f"set [ps] aggregation = {_rules_that(lambda r: r.local_optimizer and r.share == 'mean')}",
            )
        )
    for name in ("warmup", "pipemare"):
        if name in names and not rule.local_optimizer:
            out.append(
                (
                    f'"{name}" sets the VWs\' local learning rates, but with ps.aggregation = '
                    f'"{aggregation}" the PS runs the optimizer',
                    f"use aggregation {_rules_that(lambda r: r.local_optimizer)}, or drop it",
                )
            )
    if (
        "spectrain" in names
        and rule.local_optimizer
        and schedule_stashing == "optional"
        and not weight_stashing
    ):
        out.append(
            (
                '"spectrain" runs each forward and its backward on a predicted copy of the weights, but '
                "weight_stashing is false",
                "set weight_stashing = true",
            )
        )
    return out


def _rules_that(where: Callable[[type[Aggregation]], bool]) -> str:
    """The registered aggregation rules with the traits `where` asks for, quoted: '"sum" or "mean"'."""
    return " or ".join(f'"{name}"' for name, rule in AGGREGATIONS.items() if where(rule))


@dataclass(frozen=True)
class Lag:
    """How far minibatch p's weights at one stage lag its own VW's updates, from the stage's action list."""

    update: int  # U actions between F p and the U that applies p's gradient: the updates its gradient is late
    backward: int  # U actions between F p and B p: how far the live weights moved before p's backward


def stage_lags(actions: Sequence[object]) -> dict[int, Lag]:
    """Lag of every minibatch of one stage's list (actions with .kind "F"/"B"/"U" and .index p)."""
    updates = 0  # U actions so far
    at_forward: dict[int, int] = {}
    at_backward: dict[int, int] = {}
    out: dict[int, Lag] = {}
    waiting: list[int] = []  # backwards not yet covered by a U
    for action in actions:
        kind, p = action.kind, action.index  # type: ignore[attr-defined]
        if kind == "F":
            at_forward[p] = updates
        elif kind == "B":
            at_backward[p] = updates - at_forward[p]
            waiting.append(p)
        elif kind == "U":
            for q in waiting:
                out[q] = Lag(updates - at_forward[q], at_backward[q])
            waiting.clear()
            updates += 1
    return out


def pipemare_lr_factor(update_lag: int, wave: int, warmup_waves: int) -> float:
    """PipeMare T1: 1 / tau ** p with tau = 1 + update_lag and p = 1 - wave / warmup_waves (0 from then
    on)."""
    power = max(0.0, 1.0 - wave / warmup_waves) if warmup_waves > 0 else 0.0
    return 1.0 if update_lag == 0 or power == 0.0 else (1.0 + update_lag) ** -power


def warmup_lr_factor(wave: int, num_vws: int, warmup_waves: int) -> float:
    """Gradual warm-up: 1 / VWs at wave 0, rising linearly to 1 at wave `warmup_waves` (1 for one VW)."""
    if num_vws <= 1 or warmup_waves <= 0 or wave >= warmup_waves:
        return 1.0
    start = 1.0 / num_vws
    return start + (1.0 - start) * wave / warmup_waves


def dc_gamma(backward_lag: int) -> float:
    """PipeMare T2's averaging decay for a stage whose backwards lag `backward_lag` updates (0: unused)."""
    return DC_DECAY ** (1.0 / max(backward_lag, 1))
