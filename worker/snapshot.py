"""A stage's checkpoints on disk: its state at a wave (hetpipe.core.pipeline.resume) in the checkpoint file
format of hetpipe.core.runs.checkpoint, one directory per stage: <run dir>/stages/vw<I>-s<J>/."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hetpipe.core.runs.checkpoint import discard_before, list_clocks, load_clock, write_checkpoint

__all__ = ["list_snapshots", "load_snapshot", "save_snapshot", "snapshot_dir"]


def snapshot_dir(run_dir: Path | str, vw: int, stage: int) -> Path:
    return Path(run_dir) / "stages" / f"vw{vw}-s{stage}"


def list_snapshots(run_dir: Path | str, vw: int, stage: int) -> list[int]:
    """The waves this stage has snapshots of (manifests present; load verifies)."""
    return list_clocks(snapshot_dir(run_dir, vw, stage))


def save_snapshot(
    directory: Path, wave: int, meta: Mapping[str, Any], tensors: Mapping[str, torch.Tensor], keep_from: int
) -> Path:
    """Write the snapshot of `wave` (atomic, sha256 manifest) and drop those older than `keep_from`."""
    arrays, bf16 = {}, []
    for key, t in tensors.items():
        t = t.detach().cpu()
        if t.dtype == torch.bfloat16:  # numpy has no bfloat16: its bits travel as int16
            bf16.append(key)
            t = t.view(torch.int16)
        arrays[key] = t.contiguous().numpy()
    path = write_checkpoint(directory, wave, {**meta, "bf16": bf16}, arrays, keep=0)
    discard_before(directory, keep_from)
    return path


def load_snapshot(directory: Path, wave: int) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    ckpt = load_clock(directory, wave)
    bf16 = set(ckpt.meta.get("bf16", []))
    tensors = {}
    for key, arr in ckpt.arrays.items():
        t = torch.from_numpy(np.ascontiguousarray(arr))
        tensors[key] = t.view(torch.bfloat16) if key in bf16 else t
    return ckpt.meta, tensors
