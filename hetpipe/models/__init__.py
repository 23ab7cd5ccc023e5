"""Models as ordered layer lists, so a stage can build only its own layers."""

from __future__ import annotations

from hetpipe.models.registry import MODELS, from_layers, get_model, model_names
from hetpipe.models.spec import ModelSpec, Task, layer_seed
from hetpipe.models.stages import build_stage, even_split, named_stage_tensors, param_counts, stage_state_keys

__all__ = [
    "MODELS",
    "ModelSpec",
    "Task",
    "build_stage",
    "even_split",
    "from_layers",
    "get_model",
    "layer_seed",
    "model_names",
    "named_stage_tensors",
    "param_counts",
    "stage_state_keys",
]
