"""The planner's baselines, what a user would run instead of hetpipe: all-reduce data parallelism over the
GPUs that hold the whole model (Horovod / DDP) and one synchronous pipeline over all GPUs (GPipe-like, flushed
every minibatch), each predicted by the simulator. Pure."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

from hetpipe.core.errors import HetpipeError
from hetpipe.core.planning.candidates import (
    ALLREDUCE,
    SYNC_PIPELINE,
    Candidate,
    GpuUse,
    first_line,
    gpu_uses,
    slowest_stage_text,
)
from hetpipe.core.planning.capacity import CAPACITY_TARGET, left_out_bound
from hetpipe.core.planning.groupings import GroupingSearch
from hetpipe.core.planning.memory import PLAIN, format_bytes, stage_memory_terms
from hetpipe.core.planning.partition import Gpu
from hetpipe.core.planning.plan import VwPlan
from hetpipe.core.planning.simulate import simulate_allreduce, simulate_sync_pipeline

__all__ = ["allreduce", "baseline_bounds", "sync_pipeline", "whole_model"]


def whole_model(search: GroupingSearch, gpu: Gpu) -> tuple[int, str]:
    """Bytes the whole model needs on one GPU of data parallelism (nm = 1, no stashing), and the terms."""
    profile = search.profiles[gpu[1]]
    terms = stage_memory_terms(profile.layers, 0, 1, PLAIN, input_bytes=profile.input_bytes)
    return terms.total, terms.describe()


def allreduce(search: GroupingSearch) -> Candidate:
    """ALLREDUCE over the GPUs whose memory holds the whole model, as a ring paced by its slowest replica."""
    gpus = [search.gpu(ref) for ref in search.config.all_gpus()]
    fit, notes = [], []
    for gpu in gpus:
        need, terms = whole_model(search, gpu)
        if need <= gpu[2] - search.reserve:
            fit.append((gpu, need))
        else:
            notes.append(
                f"{gpu[0]} ({gpu[1]}, {format_bytes(gpu[2])}{_reserve_text(search)}) cannot hold "
                f"{search.any_profile.model} at batch {search.batch}: needs {format_bytes(need)} ({terms})"
            )
    notes = _merge_same_type(notes)
    if not fit:
        return Candidate(
            ALLREDUCE,
            None,
            None,
            0.0,
            reason="no GPU holds the whole model:\n    " + "\n    ".join(notes),
        )
    ring = [g for g, _ in fit]
    gbps = min(
        (search.link(a[0], b[0]) for a, b in zip(ring, ring[1:] + ring[:1], strict=True) if a is not b),
        default=math.inf,
    )
    steps = [search.profiles[g[1]].step_s for g in ring]
    param_bytes = sum(layer.param_bytes for layer in search.any_profile.layers)
    result = simulate_allreduce(steps, param_bytes, gbps if math.isfinite(gbps) else 1e12, search.batch)
    slowest = max(range(len(ring)), key=lambda i: steps[i])
    bottleneck = (
        f"{ring[slowest][0]} ({ring[slowest][1]}): {steps[slowest]:.3g} s/minibatch + all-reduce "
        f"{result.comm_s:.3g} s"
    )
    memory = tuple(GpuUse(g[0], g[1], need, g[2] - search.reserve) for g, need in fit)
    return Candidate(
        ALLREDUCE,
        None,
        None,
        result.samples_per_s,
        memory,
        bottleneck,
        notes=tuple(notes),
        comm_share=result.comm_s / result.step_s,
    )


def sync_pipeline(search: GroupingSearch) -> Candidate:
    """SYNC_PIPELINE over all GPUs (at most one per layer, fastest first), microbatched and flushed each
    step."""
    gpus = [search.gpu(ref) for ref in search.config.all_gpus()]
    n = search.any_profile.num_layers
    notes: list[str] = []
    speed = {name: t.speed for name, t in search.config.gpu_types.items()}
    if len(gpus) > n:
        kept = sorted(gpus, key=lambda g: (-speed[g[1]], -g[2], g[0]))[:n]
        notes.append(
            f"{search.any_profile.model} has {n} layers: the pipeline uses the {n} fastest GPUs, "
            f"{len(gpus) - n} idle"
        )
        gpus = [g for g in gpus if g in kept]
    orders = {
        tuple(gpus),
        tuple(sorted(gpus, key=lambda g: -g[2])),
        tuple(sorted(gpus, key=lambda g: -speed[g[1]])),
    }
    found: list[VwPlan] = []
    error: HetpipeError | None = None
    for order in sorted(orders):
        try:
            found.append(search.split(order, 1, PLAIN))
        except HetpipeError as exc:
            error = error or exc
    if not found:
        assert error is not None
        return Candidate(SYNC_PIPELINE, None, None, 0.0, reason=first_line(error), notes=tuple(notes))
    vw = min(found, key=lambda v: v.bottleneck_s)
    micro = min(search.batch, 4 * len(gpus))
    result = simulate_sync_pipeline(vw, micro, search.batch)
    notes.append(
        f"{micro} microbatches of {search.batch / micro:g} samples, times scaled linearly (optimistic "
        "for small microbatches); memory as one full minibatch in flight"
    )
    return Candidate(
        SYNC_PIPELINE,
        None,
        None,
        result.samples_per_s,
        gpu_uses(vw),
        slowest_stage_text(vw, 0, ""),
        notes=tuple(notes),
        nm=micro,
    )


def baseline_bounds(c: Candidate, rates: Mapping[str, float]) -> Candidate:
    """A baseline with what bounds it below CAPACITY_TARGET of the capacity (the sum of `rates`): its idle
    GPUs and its synchronisation."""
    capacity = sum(rates.values())
    if not c.feasible or not capacity or c.samples_per_s >= CAPACITY_TARGET * capacity:
        return c
    used = {u.gpu for u in c.memory}
    bounds = []
    left = left_out_bound([g for g in rates if g not in used], rates, c.notes)
    if left:
        bounds.append(left[1])
    if c.policy == ALLREDUCE:
        bounds.append(
            f"synchronous steps: every step waits for the slowest replica ({c.bottleneck}); synchronising "
            f"takes {c.comm_share:.0%} of the step"
        )
    else:
        bounds.append(
            f"one pipeline flushed every minibatch: its fill and drain, slowest stage {c.bottleneck}"
        )
    return dataclasses.replace(c, bounds=tuple(bounds))


def _reserve_text(search: GroupingSearch) -> str:
    return f" minus a reserve of {format_bytes(search.reserve)}" if search.reserve else ""


def _merge_same_type(notes: list[str]) -> list[str]:
    """`n2:0 (rtx-2060 ...) cannot hold ...` x 4 -> one line naming the four GPUs."""
    merged: dict[str, list[str]] = {}
    for note in notes:
        gpu, rest = note.split(" ", 1)
        merged.setdefault(rest, []).append(gpu)
    return [f"{', '.join(gpus)} {rest}" for rest, gpus in merged.items()]
