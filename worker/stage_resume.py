"""A stage's snapshots for `hetpipe train --resume`: its state saved right after its PUSH c-1, and loaded to
go on from wave c (docs/recovery.md#resume)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from hetpipe.compute.stage_checkpoint import save_stage
from hetpipe.compute.stage_compute import StageCompute
from hetpipe.core.errors import HetpipeError
from hetpipe.core.pipeline.resume import cut_position, forwarded_before, snapshot_floor
from hetpipe.core.pipeline.schedule import Action, Schedule
from hetpipe.worker.jobs import StageJob
from hetpipe.worker.snapshot import load_snapshot, save_snapshot, snapshot_dir

__all__ = ["load_stage_snapshot", "save_stage_snapshot"]


def save_stage_snapshot(
    job: StageJob, compute: StageCompute, wave: int, runner: dict[str, int], ps_oldest: int
) -> None:
    """Save the stage's state at wave `wave`: its compute's, and the runner's place (`runner`: the next
    action's index, the next WAIT's, the waves pushed, c_global, the samples trained on); keep the older
    snapshots back to the oldest checkpoint the PS keeps (`ps_oldest`, 0: none yet)."""
    meta, tensors = save_stage(compute)
    keep_from = snapshot_floor(runner["c_global"], job.snapshot_every, job.snapshot_keep, ps_oldest)
    save_snapshot(
        snapshot_dir(job.run_dir, job.vw, job.stage),
        wave,
        {
            "vw": job.vw,
            "stage": job.stage,
            "run": job.config.name,
            "wave": wave,
            "compute": meta,
            "runner": runner,
        },
        tensors,
        keep_from,
    )


def load_stage_snapshot(
    job: StageJob,
    schedule: Schedule,
    actions: Sequence[Action],
    compute: StageCompute,
    loss_fn: Callable[..., torch.Tensor],
    batch: Callable[[int], tuple[torch.Tensor, torch.Tensor]],
    targets: dict[int, torch.Tensor],
) -> tuple[dict[str, int], dict[int, torch.Tensor]]:
    """Load the stage's snapshot of job.resume_wave into `compute` (the last stage puts the targets of its
    forwards in flight into `targets`, read from `batch`); returns the runner's place (as saved) and the
    activations to send the next stage again."""
    wave = job.resume_wave
    meta, tensors = load_snapshot(snapshot_dir(job.run_dir, job.vw, job.stage), wave)
    runner = meta["runner"]
    if runner["position"] != cut_position(actions, wave):
        raise HetpipeError(
            f"vw {job.vw} stage {job.stage}: its snapshot of wave {wave} is at action "
            f"{runner['position']}, this run's schedule cuts there at {cut_position(actions, wave)}: "
            "resume with the config the run was started with"
        )
    in_flight = [entry["p"] for entry in meta["compute"]["in_flight"]]
    last = job.stage == job.num_stages - 1
    if last:
        targets.update({p: batch(p)[1] for p in in_flight})
    resend: frozenset[int] = frozenset()
    if not last:
        following = schedule.stages[job.stage + 1]
        received = forwarded_before(following, cut_position(following, wave))
        resend = frozenset(p for p in in_flight if p not in received)
    device = torch.device(job.device)
    return runner, compute.load_state_dict(
        meta["compute"],
        {k: t.to(device) for k, t in tensors.items()},
        targets=targets,
        loss_fn=loss_fn,
        resend=resend,
    )
