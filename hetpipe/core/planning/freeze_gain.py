"""A plan as it runs once [train] freeze has frozen the model's first layers (docs/wsp.md#freezing): the same
VWs, splits and Nm, each stage's backward less the frozen layers' share of it, and their weights neither
pushed nor pulled; and the profiles a re-plan at a freeze point searches with (docs/planning.md#re-planning).
Pure: the planner predicts either as it predicts any plan."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from hetpipe.core.planning.plan import Plan, StagePlan, VwPlan
from hetpipe.core.planning.profile import ModelProfile
from hetpipe.core.planning.simulate import stage_param_bytes

__all__ = ["frozen_plan", "frozen_profiles"]


def frozen_profiles(profiles: Mapping[str, ModelProfile], layers: int) -> dict[str, ModelProfile]:
    """Each GPU type's profile with the model's first `layers` layers frozen: their backward (and optimizer
    step) takes no time and their optimizer state is gone (the stages forget it at the freeze point). Weights
    and activations stay as measured (autograd keeps none for a frozen layer: a stage's memory errs high);
    what a wave pushes is cut by frozen_plan."""
    return {
        gpu_type: dataclasses.replace(
            profile,
            layers=tuple(
                dataclasses.replace(layer, backward_s=0.0, optimizer_bytes=0) if i < layers else layer
                for i, layer in enumerate(profile.layers)
            ),
        )
        for gpu_type, profile in profiles.items()
    }


def frozen_plan(plan: Plan, profiles: Mapping[str, ModelProfile], layers: int, cached: bool = False) -> Plan:
    """`plan` with the model's first `layers` layers frozen. Each stage's backward time shrinks by the frozen
    layers' share of its layers' backward (from its GPU type's profile, so any minibatch size scales alike),
    and its bytes per push and pull by their share of its weights. Left as they were: the forward (a frozen
    layer still runs; `cached`: its outputs come from the frozen layers' cache, [train] freeze_cache_mib, so
    its forward goes too), the boundary transfers (a stage all frozen no longer takes an output gradient:
    not counted, so the figure errs low) and the memory (the runtime keeps the optimizer state it had; the
    cache's rows are not counted)."""
    return dataclasses.replace(plan, vws=tuple(_frozen_vw(vw, profiles, layers, cached) for vw in plan.vws))


def _frozen_vw(vw: VwPlan, profiles: Mapping[str, ModelProfile], layers: int, cached: bool) -> VwPlan:
    sizes = stage_param_bytes(vw)
    stages = tuple(
        _frozen_stage(stage, profiles[stage.gpu_type], layers, nbytes, cached)
        for stage, nbytes in zip(vw.stages, sizes, strict=True)
    )
    return dataclasses.replace(vw, stages=stages, param_bytes=int(sum(s.param_bytes for s in stages)))


def _frozen_stage(
    stage: StagePlan, profile: ModelProfile, layers: int, nbytes: float, cached: bool
) -> StagePlan:
    own = profile.layers[stage.start : stage.stop]
    frozen = profile.layers[stage.start : max(stage.start, min(stage.stop, layers))]
    backward = _share(sum(layer.backward_s for layer in frozen), sum(layer.backward_s for layer in own))
    weights = _share(sum(layer.param_bytes for layer in frozen), sum(layer.param_bytes for layer in own))
    forward = _share(sum(layer.forward_s for layer in frozen), sum(layer.forward_s for layer in own))
    return dataclasses.replace(
        stage,
        forward_s=stage.forward_s * (1.0 - forward) if cached else stage.forward_s,
        backward_s=stage.backward_s * (1.0 - backward),
        param_bytes=round(nbytes * (1.0 - weights)),
    )


def _share(part: float, whole: float) -> float:
    """part / whole; 0 for a whole of 0 (a stage of layers without weights or backward time)."""
    return part / whole if whole > 0 else 0.0
