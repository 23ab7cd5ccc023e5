"""What a stage process builds from its StageJob besides its compute: its start-up points, schedule and action
list, emulated links, trace, profiler and the spec of its PS client."""

from __future__ import annotations

import time
from pathlib import Path

import torch

from hetpipe.compute.build import audit_shape, ps_placement
from hetpipe.core.hardware.emulate import LinkEmulator
from hetpipe.core.pipeline.resume import rejoin_actions
from hetpipe.core.pipeline.schedule import Action, Schedule, get_schedule
from hetpipe.core.runs.metrics import TraceRecorder
from hetpipe.core.runs.procs import child_entered_at, process_started_at
from hetpipe.core.wsp.aggregation import get_aggregation, needs_pulls
from hetpipe.models import ModelSpec
from hetpipe.worker.jobs import StageJob
from hetpipe.worker.ps_client import ClientSpec
from hetpipe.worker.stage_profile import StageProfiler

__all__ = [
    "PS_ROW",
    "client_spec",
    "neighbour_links",
    "stage_profiler",
    "stage_schedule",
    "stage_trace",
    "startup_points",
]

PS_ROW = 1000  # trace row of a stage's PS traffic: PS_ROW + stage


def startup_points() -> dict[str, float | None]:
    """When this stage's process started and when its imports were done (Unix seconds); the stage adds its
    later start-up steps (hetpipe.app.startup.STAGE_STEPS) as it ends them."""
    imported = child_entered_at() or time.time()
    started = process_started_at()  # from /proc's 10 ms ticks: may read a few ms after `imported`
    return {"process": None if started is None else min(started, imported), "imported": imported}


def stage_schedule(job: StageJob) -> tuple[Schedule, list[Action]]:
    """The run's schedule and this stage's action list (a rejoining VW's: the actions of its waves from its
    start wave on; a VW with a planned span's: up to its end)."""
    t, wsp = job.config.train, job.config.wsp
    kind = get_schedule(t.schedule)
    schedule = kind(job.num_stages, wsp.nm, job.end_wave, wsp.staleness)
    actions = list(schedule.stages[job.stage])
    if job.start_wave:
        actions = rejoin_actions(actions, job.start_wave, wsp.nm)
    return schedule, actions


def neighbour_links(job: StageJob) -> dict[int, LinkEmulator]:
    """The emulated link to each neighbouring stage (off unless [emulation] link_bandwidth)."""
    config = job.config
    link = config.network.link_gbps
    emulate_links = config.emulation.enabled and config.emulation.link_bandwidth
    return {
        peer: LinkEmulator.for_link(emulate_links, link(job.gpus[job.stage], job.gpus[peer]), job.time_scale)
        for peer in (job.stage - 1, job.stage + 1)
        if 0 <= peer < job.num_stages
    }


def stage_trace(job: StageJob) -> TraceRecorder:
    """The stage's trace: its own row, and a row for its PS agent's traffic."""
    trace = TraceRecorder(f"vw{job.vw}", job.stage)
    trace.other_threads[PS_ROW + job.stage] = f"stage {job.stage} PS traffic"
    return trace


def stage_profiler(job: StageJob, device: torch.device) -> StageProfiler | None:
    """`hetpipe train --profile`: torch.profiler over the job's window of actions (else None)."""
    if job.profile is None:
        return None
    return StageProfiler(job.profile, device, Path(job.run_dir) / "profile", f"vw{job.vw}-s{job.stage}")


def records_only_waits(job: StageJob) -> bool:
    """Whether the stage's WAITs ask the PS for [train] autofreeze's movement records alone: a lone VW that
    applies its own updates pulls no weights (its own are the global ones), and waits for the records only
    under the rule (docs/wsp.md#adaptive-freezing)."""
    pulls = needs_pulls(job.num_vws, get_aggregation(job.config.ps.aggregation))
    return not pulls and bool(job.config.train.autofreeze_every)


def client_spec(job: StageJob, spec: ModelSpec) -> ClientSpec:
    """What the stage's PS client connects to and registers as (its shards, its keys' placement)."""
    config = job.config
    return ClientSpec(
        list(job.ps_endpoints),
        config.name,
        job.vw,
        job.stage,
        job.num_vws,
        job.num_stages,
        ps_placement(
            config, spec, audit_shape(config.train.waves, job.nms) if job.audit else None, job.first_vw
        ),
        timeout_s=config.ps.timeout_s,
        retry_s=min(5.0, config.ps.timeout_s / 4),
        curve=job.ps_keys,
        wire_dtype=config.ps.wire_dtype,
        vw_weights=job.vw_weights,
        freeze=config.train.freeze,
        movement=bool(config.train.autofreeze_every),
        records_only=records_only_waits(job),
        vw_spans=tuple((start, 0 if end == config.train.waves else end) for start, end in job.spans),
    )
