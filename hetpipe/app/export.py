"""`hetpipe export RUN_DIR`: the trained model of a run as an nn.Module, rebuilt from the run's effective
config (config.toml) and its final weights (model.pt, as the PS holds them: float32)."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from hetpipe.compute.build import model_of
from hetpipe.compute.evaluate import load_ps_state
from hetpipe.core.config.files import load_config
from hetpipe.core.errors import HetpipeError, UsageError
from hetpipe.models import build_stage

__all__ = ["export_model", "load_model"]


def load_model(run_dir: str | Path, device: str | torch.device = "cpu") -> nn.Sequential:
    """The trained model of `run_dir` (a `hetpipe train` run directory), in eval mode on `device`.

    It is the model the run trained, whole: an nn.Sequential whose child i is layer i (so its state_dict keys
    equal model.pt's), built by the same builder from the same options, with every weight and buffer of
    model.pt loaded and cast back to the tensor's own dtype (the PS stores all of them as float32; an integer
    buffer such as BatchNorm's num_batches_tracked comes back as int64).
    """
    run_dir = Path(run_dir)
    config_path, weights = run_dir / "config.toml", run_dir / "model.pt"
    for path, what in ((config_path, "its effective config"), (weights, "its final weights")):
        if not path.is_file():
            raise UsageError(
                f"{run_dir} is not a finished `hetpipe train` run directory: {path.name} "
                f"({what}) is missing; give the run dir a finished run wrote"
            )
    spec = model_of(load_config(config_path))
    model = build_stage(spec, 0, spec.num_layers, device)
    try:
        load_ps_state(model, torch.load(weights, map_location=device, weights_only=True), spec.name)
    except ValueError as exc:
        raise HetpipeError(
            f"{weights}: {exc}; was the model's builder or its options changed since the run?"
        ) from None
    return model.eval()


def export_model(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """Save `load_model(run_dir)` whole (torch.save of the module) to `out` (default
    RUN_DIR/model-module.pt)."""
    path = Path(out) if out is not None else Path(run_dir) / "model-module.pt"
    model = load_model(run_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(model, path)
    return path
