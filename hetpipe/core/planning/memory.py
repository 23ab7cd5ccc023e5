"""The memory model of a pipeline stage and of a PS shard (docs/memory.md): what one GPU holds for its layers
under a schedule, and what a shard holds for its keys. Pure, no torch.

A stage holds its weights and, besides them, whole copies of them: the accumulated gradient, the update
baseline and the own update sums (aggregation sum/mean), and one stashed copy per weight version in flight
(weight stashing). Per minibatch in flight it keeps the received input, and the activations autograd saved
(only one minibatch's at a time when the backward recomputes the forward). How many of each the schedule
keeps is read off its action lists (hetpipe.core.pipeline.schedule.stage_profile).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, replace

from hetpipe.core.config.schema import ClusterConfig
from hetpipe.core.errors import UsageError
from hetpipe.core.pipeline.schedule import DEFAULT_SCHEDULE, flushing_schedule, get_schedule, stage_profile
from hetpipe.core.planning.profile import LayerProfile
from hetpipe.core.wsp.aggregation import get_aggregation, needs_pulls

__all__ = [
    "PLAIN",
    "WSP",
    "Keeping",
    "MemoryRule",
    "StageMemory",
    "format_bytes",
    "ps_shard_bytes",
    "stage_memory",
    "stage_memory_terms",
]


@dataclass(frozen=True)
class Keeping:
    """What stage j keeps at its peak, as counts (multiplied by per-minibatch or per-copy bytes)."""

    in_flight: int  # minibatches whose received input (and, but on the last stage, output) the stage keeps
    saved: int  # minibatches whose saved activations the stage keeps
    stashed: int  # stashed copies of its weights (one per weight version in flight, with stashing on)
    update_sums: int  # own update (or gradient) sums kept until a pull contains them
    baseline: bool  # a copy of the weights as of the last recorded update (aggregation sum/mean)
    optimizer: bool  # the optimizer state lives on the stage (not with aggregation "server")
    push_staging: bool = False  # a push's flat device copy, read by its device-to-host copy (CUDA stages)


@dataclass(frozen=True)
class MemoryRule:
    """How every stage of a VW runs, as far as its memory goes (from [train], [wsp] and [ps])."""

    nm: int = 1
    schedule: str = DEFAULT_SCHEDULE
    weight_stashing: bool = True
    recompute: bool = False
    staleness: int = 0
    pulls: bool = True  # WAITs pull (hetpipe.core.wsp.aggregation.needs_pulls)
    local_updates: bool = True  # the aggregation rule's local_optimizer: updates are applied on the stage
    ps: bool = True  # the stage pushes to a PS (False: a plain replica, e.g. a baseline's)
    staged_push: bool = False  # stages on CUDA: a push goes to the host through one flat device copy of it
    host_sums: bool = False  # the sums of pushed waves wait for their pull in host memory (not the GPU's)

    @classmethod
    def of(cls, config: ClusterConfig, num_vws: int) -> MemoryRule:
        """The rule a run of `config` with `num_vws` virtual workers follows."""
        t, rule = config.train, get_aggregation(config.ps.aggregation)
        on_cpu = config.emulation.enabled and config.emulation.device == "cpu"  # else CUDA where there is one
        return cls(
            nm=config.wsp.nm,
            schedule=t.schedule,
            weight_stashing=t.weight_stashing,
            recompute=t.recompute,
            staleness=config.wsp.staleness,
            pulls=needs_pulls(num_vws, rule),
            local_updates=rule.local_optimizer,
            staged_push=not on_cpu,
            host_sums=True,  # CUDA stages move them to the host; an emulated GPU's host is the machine's
        )

    def with_nm(self, nm: int) -> MemoryRule:
        return replace(self, nm=nm)

    def keeping(self, stage: int, num_stages: int) -> Keeping:
        """What stage `stage` of `num_stages` keeps at most (docs/memory.md#what-a-stage-keeps)."""
        if stage < 0 or num_stages < 1 or stage >= num_stages or self.nm < 1:
            raise UsageError(
                f"keeping needs 0 <= stage < num_stages and nm >= 1, got stage={stage}, "
                f"num_stages={num_stages}, nm={self.nm}"
            )
        return _keeping(self, stage, num_stages)


@functools.lru_cache(maxsize=4096)
def _keeping(rule: MemoryRule, stage: int, num_stages: int) -> Keeping:
    kind = get_schedule(rule.schedule)
    waves = rule.staleness + 4  # enough waves for the steady state of every gate
    seen = stage_profile(kind(num_stages, rule.nm, waves, rule.staleness), stage)
    modes = kind.modes(rule.weight_stashing, rule.recompute)
    # own sums: a WAIT of wave c keeps the waves after c - D - 2 (up to D + 1 of them) and the one in
    # progress; without pulls a push lets its wave go, leaving the pushed one (until sent) and the one in
    # progress. With host_sums the pushed ones wait on the host: the GPU holds the one in progress and, at a
    # rebase, one pushed wave's sums on their way back
    sums = (rule.staleness + 2 if rule.pulls and not rule.host_sums else 2) if rule.ps else 0
    return Keeping(
        in_flight=seen.in_flight,
        saved=1 if modes.recompute else seen.in_flight,
        stashed=seen.versions if modes.stashing else 0,
        update_sums=sums,
        baseline=rule.local_updates and rule.ps,
        optimizer=rule.local_updates,
        push_staging=rule.ps and rule.staged_push,
    )


WSP = MemoryRule()  # the default: wsp with weight stashing, pulls, updates on the stage
# one plain replica: one minibatch at a time, updated after each (any flushing schedule at Nm 1)
PLAIN = MemoryRule(nm=1, schedule=flushing_schedule().name, weight_stashing=False, pulls=False, ps=False)


@dataclass(frozen=True)
class StageMemory:
    """The terms of one stage's peak memory, in bytes (each documented where it is computed)."""

    weights: int
    gradients: int
    optimizer: int
    stashed: int
    baseline: int
    update_sums: int
    activations: int
    inputs: int
    outputs: int
    in_transit: int
    working: int
    push_staging: int = 0

    @property
    def total(self) -> int:
        return (
            self.weights
            + self.gradients
            + self.optimizer
            + self.stashed
            + self.baseline
            + self.update_sums
            + self.activations
            + self.inputs
            + self.outputs
            + self.in_transit
            + self.working
            + self.push_staging
        )

    def describe(self) -> str:
        """`weights 1.20 GiB + gradients ... = 7.10 GiB`, for error messages."""
        parts = [
            f"{name} {format_bytes(value)}"
            for name, value in (
                ("weights", self.weights),
                ("gradients", self.gradients),
                ("optimizer", self.optimizer),
                ("stashed weights", self.stashed),
                ("update baseline", self.baseline),
                ("update sums", self.update_sums),
                ("saved activations", self.activations),
                ("input buffers", self.inputs),
                ("outputs", self.outputs),
                ("gradients in transit", self.in_transit),
                ("working", self.working),
                ("push staging", self.push_staging),
            )
            if value
        ]
        return " + ".join(parts) + f" = {format_bytes(self.total)}"


def stage_memory_terms(
    layers: Sequence[LayerProfile], stage_index: int, num_stages: int, rule: MemoryRule, *, input_bytes: int
) -> StageMemory:
    """Peak memory of a stage running `layers` at position `stage_index` of a VW of `num_stages` under `rule`
    (docs/memory.md#a-stage).

    `input_bytes` is the activation entering the stage for one minibatch: the model input for stage 0,
    otherwise the previous layer's output_bytes.
    """
    if not layers:
        raise UsageError("a stage needs at least one layer; give stage_memory a non-empty layer list")
    if input_bytes < 0:
        raise UsageError(f"input_bytes must be >= 0, got {input_bytes}")
    keep = rule.keeping(stage_index, num_stages)
    weights = sum(layer.param_bytes for layer in layers)
    first, last = stage_index == 0, stage_index == num_stages - 1
    output_bytes = 0 if last else layers[-1].output_bytes
    return StageMemory(
        # the stage's own parameters (and buffers such as BatchNorm statistics)
        weights=weights,
        # the gradient of the backwards since the last update, kept until it
        gradients=weights,
        # momentum buffers / Adam moments (0 for plain SGD, and with aggregation "server" the PS keeps them)
        optimizer=sum(layer.optimizer_bytes for layer in layers) if keep.optimizer else 0,
        # weight stashing: one copy per weight version that minibatches in flight ran on
        stashed=keep.stashed * weights,
        # the weights as of the last recorded update, to take the next update as a difference
        baseline=weights if keep.baseline else 0,
        # own update sums of the waves a pull does not contain yet (gradient sums with aggregation "server")
        update_sums=keep.update_sums * weights,
        # what autograd keeps between a minibatch's forward and its backward
        activations=keep.saved * sum(layer.saved_bytes for layer in layers),
        # the received input activation of each in-flight minibatch (kept to return its gradient)
        inputs=keep.in_flight * input_bytes,
        # the output each in-flight minibatch sent on, kept as the root of its backward
        outputs=keep.in_flight * output_bytes,
        # the received output gradient of the backward running, and the input gradients sent back that the
        # P2P window keeps until their sends are waited for (Nm + 1 of them, hetpipe.worker.p2p)
        in_transit=output_bytes + (0 if first else (rule.nm + 1) * input_bytes),
        # transient peak of one layer at a time (activation gradients, temporaries)
        working=max(layer.working_bytes for layer in layers),
        # on CUDA, the wave's push as one flat float32 copy on the device, until its device-to-host copy has
        # read it (worker/transfer.py PushStaging); made at the wave's end, beside the forwards already ahead
        push_staging=weights if keep.push_staging else 0,
    )


def stage_memory(
    layers: Sequence[LayerProfile], stage_index: int, num_stages: int, rule: MemoryRule, *, input_bytes: int
) -> int:
    """Total bytes of `stage_memory_terms`."""
    return stage_memory_terms(layers, stage_index, num_stages, rule, input_bytes=input_bytes).total


def ps_shard_bytes(model_bytes: int, shards: int, staleness: int, pull_mode: str) -> int:
    """What one PS shard holds at most for its share of a model (host memory): W_0, and with exact pulls up
    to D + 2 versions and D + 2 wave sums (hetpipe.core.wsp.clock.pending_bound); with latest pulls the
    running weights (each VW's newest buffers besides, small)."""
    share = -(-model_bytes // max(shards, 1))
    if pull_mode == "exact":
        return share * (1 + 2 * (staleness + 2))
    return share * 2


def format_bytes(count: float) -> str:
    """Bytes for people: `512 B`, `3.0 KiB`, `7.10 GiB`."""
    if count < 1024:
        return f"{int(count)} B"
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if count >= scale:
            return f"{count / scale:.2f} {unit}"
    raise AssertionError("unreachable")
