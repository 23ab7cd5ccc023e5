"""A re-plan's optimizer hand-over (docs/wsp.md#planned-spans): a stage of a VW that retires writes its
optimizer's state by parameter name once its actions are done; a stage of a VW that starts then reads its
source VW's files (hetpipe.core.wsp.handover) before its first action."""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch

from hetpipe.compute.optimizer_state import load_state_by_name, state_by_name
from hetpipe.compute.stage_compute import StageCompute
from hetpipe.core.errors import HetpipeError
from hetpipe.worker.jobs import StageJob

__all__ = ["handover_path", "load_handover", "save_handover"]


def handover_path(run_dir: str | Path, vw: int, stage: int) -> Path:
    return Path(run_dir) / "handover" / f"vw{vw}-s{stage}.pt"


def save_handover(job: StageJob, compute: StageCompute) -> None:
    """Write this stage's optimizer state by parameter name, when a later VW takes it (written whole, then
    renamed, so a reader never sees half a file)."""
    if not job.hands_over:
        return
    path = handover_path(job.run_dir, job.vw, job.stage)
    path.parent.mkdir(parents=True, exist_ok=True)
    part = path.with_suffix(".part")
    torch.save(state_by_name(compute.optimizer, list(compute.params)), part)
    os.replace(part, path)


def load_handover(job: StageJob, compute: StageCompute, timeout_s: float) -> None:
    """Start this stage's optimizer from its source VW's state (every stage of that VW wrote a file), waiting
    up to `timeout_s` for the files; nothing for a VW without a source, or one resumed from its snapshot."""
    source = job.handover_from
    if source is None or job.resume_wave:
        return
    paths = [handover_path(job.run_dir, source, s) for s in range(job.handover_stages)]
    deadline = time.monotonic() + timeout_s
    while not all(p.exists() for p in paths):
        if time.monotonic() > deadline:
            missing = [str(p) for p in paths if not p.exists()]
            raise HetpipeError(
                f"vw {job.vw} stage {job.stage}: vw {source}'s optimizer state did not come within "
                f"{timeout_s:.0f} s ({', '.join(missing)} missing): the hand-over goes through the run dir, "
                f"so with `hetpipe worker` start vw {job.vw} once vw {source} has finished its waves, on a "
                "machine that shares the run dir with vw "
                f"{source}'s (docs/wsp.md#planned-spans)"
            )
        time.sleep(0.05)
    states: dict[str, dict[str, torch.Tensor]] = {}
    for path in paths:
        states.update(torch.load(path, weights_only=True))
    load_state_by_name(compute.optimizer, list(compute.params), states)
