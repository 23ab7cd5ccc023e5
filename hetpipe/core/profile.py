"""Per-layer profiles of a model on a GPU type: the numbers the partitioner, planner and simulator use.

Data only here (plus JSON round trip); measuring lives in hetpipe.compute.profiler.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from hetpipe.core.errors import UsageError

__all__ = ["LayerProfile", "ModelProfile", "derive_profile"]


@dataclass(frozen=True)
class LayerProfile:
    """One layer at the profiled batch size on one GPU type."""

    name: str
    forward_s: float  # forward time of one minibatch
    backward_s: float  # backward time of one minibatch (without the optimizer step)
    param_bytes: int  # weights
    optimizer_bytes: int  # optimizer state for those weights (momentum: = param_bytes, adam: 2x)
    output_bytes: int  # the layer's output activation for one minibatch (what crosses a stage boundary)
    saved_bytes: int  # activations autograd keeps for the backward, per minibatch in flight
    working_bytes: int  # transient peak beyond the above while the layer runs


@dataclass(frozen=True)
class ModelProfile:
    """All layers of a model, in order, on one GPU type; keyed for caching by the fields before `layers`."""

    model: str
    batch_size: int
    gpu_type: str
    dtype: str
    torch_version: str
    input_bytes: int  # one minibatch of the model's input
    layers: tuple[LayerProfile, ...]

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def scaled(self, gpu_type: str, time_factor: float) -> ModelProfile:
        """The same model on another GPU type whose times are `time_factor` x these (memory unchanged)."""
        layers = tuple(
            replace(layer, forward_s=layer.forward_s * time_factor, backward_s=layer.backward_s * time_factor)
            for layer in self.layers
        )
        return replace(self, gpu_type=gpu_type, layers=layers)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    @classmethod
    def from_json(cls, text: str) -> ModelProfile:
        data = json.loads(text)
        data["layers"] = tuple(LayerProfile(**layer) for layer in data["layers"])
        return cls(**data)

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(self.to_json())

    @classmethod
    def load(cls, path: Path) -> ModelProfile:
        return cls.from_json(path.read_text())


def derive_profile(
    cpu_profile: ModelProfile,
    gpu_type_speed: float,
    reference_speed: float,
    time_scale: float,
    *,
    gpu_type: str | None = None,
) -> ModelProfile:
    """The profile of an emulated GPU: times x reference_speed / gpu_type_speed x time_scale, sizes unchanged.

    `reference_speed` is the speed the measured CPU stands for (the fastest type, design.md), so a type half
    as fast runs 2 x time_scale times slower than the measurement. Labelled `gpu_type` (default: unchanged).
    """
    for what, value in (("gpu_type_speed", gpu_type_speed), ("reference_speed", reference_speed),
                        ("time_scale", time_scale)):
        if isinstance(value, bool) or not isinstance(value, int | float) or not (value > 0 and math.isfinite(value)):
            raise UsageError(f"derive_profile: {what} must be a finite number > 0, got {value!r}")
    factor = reference_speed / gpu_type_speed * time_scale
    return cpu_profile.scaled(gpu_type or cpu_profile.gpu_type, factor)
