"""Does a run fit its GPUs: every stage's memory by the memory model (docs/memory.md,
hetpipe.core.planning.memory) against its GPU type's memory_gib, checked before `hetpipe train` starts
anything. Pure: sizes in, findings out.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from hetpipe.core.pipeline.schedule import flushing_schedule
from hetpipe.core.planning.memory import MemoryRule, StageMemory, format_bytes, stage_memory_terms
from hetpipe.core.planning.profile import ModelProfile

__all__ = ["StageNeed", "memory_error", "stage_needs"]


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


def memory_error(needs: Sequence[StageNeed], *, model: str, batch_size: int, rule: MemoryRule) -> str | None:
    """What to tell the user when a stage does not fit (the fullest GPU first), or None when all fit."""
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
    return (
        f"stage {n.stage} of virtual worker {n.vw} on GPU {n.gpu} ({n.gpu_type}) needs "
        f"{n.need.total:,} bytes ({format_bytes(n.need.total)}) for {layers} of {model} at batch "
        f"{batch_size} with nm={nm}, but the GPU has {n.available:,} bytes ({format_bytes(n.available)})"
        f"{more}: {n.need.describe()}\n"
        f"  {' or '.join(fixes)}{stash}, give the VW more GPUs or another split "
        "([[virtual_workers]] layers), "
        "or let `hetpipe plan CONFIG --out PLAN` choose VWs and splits that fit and train with --plan PLAN"
    )
