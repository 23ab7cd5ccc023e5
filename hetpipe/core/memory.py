"""The memory model of a pipeline stage (docs/memory.md): what one GPU holds for its layers. Pure, no torch."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from hetpipe.core.errors import UsageError
from hetpipe.core.profile import LayerProfile

__all__ = ["StageMemory", "format_bytes", "in_flight", "stage_memory", "stage_memory_terms"]


def in_flight(stage_index: int, nm: int) -> int:
    """Minibatches stage j holds at once in the wsp schedule: max(1, nm - j).

    The schedule's warm-up does max(1, min(nm - j, M)) forwards; with fewer minibatches in the run
    than nm - j (M small) the stage holds fewer, so this is the steady-state bound the memory model needs.
    """
    if stage_index < 0 or nm < 1:
        raise UsageError(f"in_flight needs stage_index >= 0 and nm >= 1, got stage_index={stage_index}, nm={nm}")
    return max(1, nm - stage_index)


@dataclass(frozen=True)
class StageMemory:
    """The terms of one stage's peak memory, in bytes (each documented where it is computed)."""

    weights: int
    gradients: int
    optimizer: int
    stashed: int
    activations: int
    inputs: int
    working: int

    @property
    def total(self) -> int:
        return (self.weights + self.gradients + self.optimizer + self.stashed + self.activations
                + self.inputs + self.working)

    def describe(self) -> str:
        """`weights 1.20 GiB + gradients ... = 7.10 GiB`, for error messages."""
        parts = [f"{name} {format_bytes(value)}" for name, value in (
            ("weights", self.weights), ("gradients", self.gradients), ("optimizer", self.optimizer),
            ("stashed weights", self.stashed), ("saved activations", self.activations),
            ("input buffers", self.inputs), ("working", self.working)) if value]
        return " + ".join(parts) + f" = {format_bytes(self.total)}"


def stage_memory_terms(
    layers: Sequence[LayerProfile], stage_index: int, nm: int, weight_stashing: bool, *, input_bytes: int
) -> StageMemory:
    """Peak memory of a stage running `layers` at position `stage_index` of its VW with `nm` in flight.

    `input_bytes` is the activation entering the stage for one minibatch: the model input for stage 0,
    otherwise the previous layer's output_bytes.
    """
    if not layers:
        raise UsageError("a stage needs at least one layer; give stage_memory a non-empty layer list")
    if input_bytes < 0:
        raise UsageError(f"input_bytes must be >= 0, got {input_bytes}")
    flight = in_flight(stage_index, nm)
    weights = sum(layer.param_bytes for layer in layers)
    return StageMemory(
        # the stage's own parameters (and buffers such as BatchNorm statistics)
        weights=weights,
        # .grad of every parameter: alive from the stage's backward until its optimizer step
        gradients=weights,
        # momentum buffers / Adam moments (0 for plain SGD), kept for the whole run
        optimizer=sum(layer.optimizer_bytes for layer in layers),
        # weight stashing: each in-flight minibatch keeps the version its forward used; the newest is
        # the live weights, so in_flight - 1 extra copies
        stashed=(flight - 1) * weights if weight_stashing else 0,
        # what autograd keeps between a minibatch's forward and its backward, per minibatch in flight
        activations=flight * sum(layer.saved_bytes for layer in layers),
        # the received input activation of each in-flight minibatch (kept to return its gradient)
        inputs=flight * input_bytes,
        # transient peak of one layer at a time (activation gradients, temporaries)
        working=max(layer.working_bytes for layer in layers),
    )


def stage_memory(
    layers: Sequence[LayerProfile], stage_index: int, nm: int, weight_stashing: bool, *, input_bytes: int
) -> int:
    """Total bytes of `stage_memory_terms`: weights + gradients + optimizer state + stashed versions
    + saved activations x in_flight + input buffers x in_flight + the largest layer's working memory."""
    return stage_memory_terms(layers, stage_index, nm, weight_stashing, input_bytes=input_bytes).total


def format_bytes(count: float) -> str:
    """Bytes for people: `512 B`, `3.0 KiB`, `7.10 GiB`."""
    if count < 1024:
        return f"{int(count)} B"
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if count >= scale:
            return f"{count / scale:.2f} {unit}"
    raise AssertionError("unreachable")
