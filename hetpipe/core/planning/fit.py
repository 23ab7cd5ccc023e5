"""Does a run fit its GPUs: every stage's memory by the memory model (docs/memory.md,
hetpipe.core.planning.memory) against its GPU type's memory_gib, checked before `hetpipe train` starts
anything. Pure: sizes in, findings out.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace

from hetpipe.core.pipeline.schedule import flushing_schedule, get_schedule
from hetpipe.core.planning.memory import MemoryRule, StageMemory, format_bytes, stage_memory_terms
from hetpipe.core.planning.profile import ModelProfile

__all__ = ["StageNeed", "changes_that_fit", "common_changes", "largest", "memory_error", "stage_needs"]


@dataclass(frozen=True)
class StageNeed:
    """One stage of one VW: its layers, what the memory model says it needs and what its GPU has."""

    vw: int
    stage: int
    gpu: str  # "node:index"
    gpu_type: str
    first_layer: int
    last_layer: int  # inclusive
    need: StageMemory
    available: int  # bytes

    @property
    def fits(self) -> bool:
        return self.need.total <= self.available

    @property
    def overcommit(self) -> float:
        return self.need.total / max(self.available, 1)


def stage_needs(
    sizes: ModelProfile,
    layouts: Sequence[tuple[Sequence[str], Sequence[int]]],
    memory: Mapping[str, tuple[str, int]],
    rule: MemoryRule,
) -> list[StageNeed]:
    """Every stage of every VW; `layouts` are (GPUs in stage order, layers per stage), `memory` maps each GPU
    to (type name, bytes). Stage j holds max(1, nm - j) minibatches in flight (the wsp schedule)."""
    needs = []
    for v, (gpus, split) in enumerate(layouts):
        start = 0
        for j, (gpu, count) in enumerate(zip(gpus, split, strict=True)):
            layers = sizes.layers[start : start + count]
            input_bytes = sizes.input_bytes if start == 0 else sizes.layers[start - 1].output_bytes
            terms = stage_memory_terms(layers, j, len(split), rule, input_bytes=input_bytes)
            gpu_type, available = memory[gpu]
            needs.append(StageNeed(v, j, gpu, gpu_type, start, start + count - 1, terms, available))
            start += count
    return needs


def changes_that_fit(
    sizes: ModelProfile,
    layout: tuple[Sequence[str], Sequence[int]],
    memory: Mapping[str, tuple[str, int]],
    rule: MemoryRule,
) -> dict[str, int | bool | str]:
    """One-setting changes under which every stage of one VW (its GPUs, layers per stage) fits, each alone
    and each one the config accepts with the rule's schedule: the largest batch below `sizes`' ("batch_size"),
    the largest Nm below the rule's ("nm"), recomputing activations ("recompute": True, where the schedule
    allows it), no weight stashing ("weight_stashing": False, where stashing is optional), the flushing
    schedule ("schedule": "1f1b-flush"). Empty when none fits or all already fit. Each is the memory model's
    own answer; a batch between two measured ones is by proportion (ModelProfile.at_batch)."""

    def fits(at: ModelProfile, r: MemoryRule) -> bool:
        return all(n.fits for n in stage_needs(at, [layout], memory, r))

    if fits(sizes, rule):
        return {}
    found: dict[str, int | bool | str] = {}
    batch = largest(sizes.batch_size - 1, lambda b: fits(sizes.at_batch(b), rule))
    if batch:
        found["batch_size"] = batch
    nm = largest(rule.nm - 1, lambda k: fits(sizes, replace(rule, nm=k)))
    if nm:
        found["nm"] = nm
    kind, flush = get_schedule(rule.schedule), flushing_schedule()
    if kind.recompute and not rule.recompute and fits(sizes, replace(rule, recompute=True)):
        found["recompute"] = True
    optional = kind.stashing == "optional" and rule.weight_stashing and rule.nm > 1
    if optional and fits(sizes, replace(rule, weight_stashing=False)):
        found["weight_stashing"] = False
    if kind.name != flush.name and fits(sizes, replace(rule, schedule=flush.name)):
        found["schedule"] = flush.name
    return found


def common_changes(found: Sequence[Mapping[str, int | bool | str]]) -> dict[str, int | bool | str]:
    """The changes_that_fit answers of several VWs that share their settings, as one answer every one of them
    fits with: a key all of them have, at the smallest batch or Nm (smaller fits too), a switch all agree
    on."""
    if not found:
        return {}
    keys = [k for k in found[0] if all(k in f for f in found[1:])]
    out: dict[str, int | bool | str] = {}
    for key in keys:
        values = [f[key] for f in found]
        if all(isinstance(x, int) and not isinstance(x, bool) for x in values):
            out[key] = min(values)
        elif len(set(values)) == 1:
            out[key] = values[0]
    return out


def largest(top: int, ok: Callable[[int], bool]) -> int:
    """The largest k in [1, top] with ok(k), ok falling as k grows (binary search); 0 when not even 1."""
    low, high = 0, top
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if ok(mid) else (low, mid - 1)
    return low


def memory_error(
    needs: Sequence[StageNeed],
    *,
    model: str,
    batch_size: int,
    rule: MemoryRule,
    fitting: Mapping[str, int | bool | str] | None = None,
    where: str = "",
) -> str | None:
    """What to tell the user when a stage does not fit (the fullest GPU first), or None when all fit;
    `fitting`: changes_that_fit's answer, its batch_size and nm named as settings of `where` (e.g.
    "virtual_workers[2] ", for a VW with work of its own) or of [train] and [wsp]."""
    over = sorted((n for n in needs if not n.fits), key=lambda n: -n.overcommit)
    if not over:
        return None
    n = over[0]
    layers = (
        f"layer {n.first_layer}"
        if n.first_layer == n.last_layer
        else f"layers {n.first_layer}-{n.last_layer}"
    )
    more = f" ({len(over) - 1} more stage{'s' * (len(over) > 2)} do not fit either)" if len(over) > 1 else ""
    nm = rule.nm
    fixes = ["lower train.batch_size"] + (["wsp.nm"] if nm > 1 else [])
    stash = (
        f' (or set train.weight_stashing = false, or train.schedule = "{flushing_schedule().name}")'
        if rule.weight_stashing and nm > 1 and n.need.stashed
        else ""
    )
    head = (
        f"stage {n.stage} of virtual worker {n.vw} on GPU {n.gpu} ({n.gpu_type}) needs "
        f"{n.need.total:,} bytes ({format_bytes(n.need.total)}) for {layers} of {model} at batch "
        f"{batch_size} with nm={nm}, but the GPU has {n.available:,} bytes ({format_bytes(n.available)})"
        f"{more}: {n.need.describe()}\n"
    )
    plan = "or let `hetpipe plan CONFIG --out PLAN` choose VWs and splits that fit and train with --plan PLAN"
    if fitting:
        changes = "; ".join(_setting(k, v, where) for k, v in fitting.items())
        return (
            f"{head}  it fits with any one of: {changes}; or give it more GPUs or another split "
            f"([[virtual_workers]] layers), {plan}"
        )
    if fitting is not None:  # worked out: no one change is enough
        return (
            f"{head}  no one change of batch_size, nm, recompute, weight_stashing or schedule makes it fit "
            f"alone: combine them, give the VW more GPUs or another split ([[virtual_workers]] layers), "
            f"{plan}"
        )
    return (
        f"{head}  {' or '.join(fixes)}{stash}, give the VW more GPUs or another split ([[virtual_workers]] "
        f"layers), {plan}"
    )


_SECTION = {"nm": "[wsp] "}  # the rest are [train]'s


def _setting(key: str, value: int | bool | str, where: str) -> str:
    """A changes_that_fit entry as the TOML line that makes it, under its section (batch_size and nm: under
    `where` when given)."""
    shown = (
        str(value).lower()
        if isinstance(value, bool)
        else f'"{value}"'
        if isinstance(value, str)
        else str(value)
    )
    return (
        f"{where if where and key in ('batch_size', 'nm') else _SECTION.get(key, '[train] ')}{key} = {shown}"
    )
