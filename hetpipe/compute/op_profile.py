"""torch.profiler over a stretch of training, summarised per minibatch: which ops take the host's and the
device's time.

Used by `hetpipe train --profile FIRST:COUNT` (every stage profiles its minibatches FIRST ... FIRST+COUNT-1,
worker/stage_profile.py) and by launch/bench/host_time.py --profile (the same table for a plain step and a
stage in one process), so a stage process's figures can be laid beside one process's.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

__all__ = ["format_profile", "op_profile", "start_profiler", "stop_profiler"]

ROWS = 25  # ops a table shows


def start_profiler(device: torch.device) -> profile:
    """A started torch.profiler of the host's ops (and, on CUDA, the device's kernels); no shapes or stacks
    (less overhead, so host times stay close to an unprofiled run's)."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    prof = profile(activities=activities)
    prof.start()
    return prof


def stop_profiler(prof: profile, device: torch.device) -> None:
    """Stop it once the device has finished the profiled work (else its last kernels are missing)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    prof.stop()


def op_profile(prof: profile, minibatches: int, wall_s: float, device: torch.device) -> dict[str, Any]:
    """Per minibatch: the wall ms, the host ms spent inside torch ops (every thread: the issuing one and, on
    CUDA, autograd's), the aten calls, and each op's calls and self host / device ms, the costliest first."""
    per = max(minibatches, 1)
    events = prof.key_averages()
    ops = [
        {
            "name": e.key,
            "calls": round(e.count / per, 2),
            "self_host_ms": round(e.self_cpu_time_total / 1000 / per, 4),
            "self_device_ms": round(e.self_device_time_total / 1000 / per, 4),
        }
        for e in events
    ]
    cuda = device.type == "cuda"
    return {
        "device": str(device),
        "minibatches": minibatches,
        "wall_ms": round(1000 * wall_s / per, 3),
        "ops_host_ms": round(sum(e.self_cpu_time_total for e in events) / 1000 / per, 3),
        "ops_device_ms": round(sum(e.self_device_time_total for e in events) / 1000 / per, 3)
        if cuda
        else None,
        "aten_calls": round(sum(e.count for e in events if e.key.startswith("aten::")) / per, 1),
        "by_host": sorted(ops, key=lambda o: -o["self_host_ms"])[:ROWS],
        "by_device": sorted(ops, key=lambda o: -o["self_device_ms"])[:ROWS] if cuda else [],
    }


def format_profile(summary: dict[str, Any], title: str) -> str:
    """The summary as text: a head line, the ops by host time and (on CUDA) by device time, ms per
    minibatch."""
    head = (
        f"{title}: {summary['minibatches']} minibatches' work on {summary['device']}; "
        f"a minibatch: {summary['wall_ms']} ms wall, {summary['ops_host_ms']} ms of host time inside torch "
        "ops (all threads), "
        f"{summary['aten_calls']} aten calls"
    )
    if summary["ops_device_ms"] is not None:
        head += f", {summary['ops_device_ms']} ms of device time"
    lines = [head]
    for key, label in (("by_host", "self host ms"), ("by_device", "self device ms")):
        if not summary[key]:
            continue
        lines += [
            "",
            (
                f"{'op':48s} {'calls':>8s} {'self host ms':>13s} {'self device ms':>15s}   "
                f"(by {label}, a minibatch)"
            ),
        ]
        lines += [
            f"{o['name'][:48]:48s} {o['calls']:8.2f} {o['self_host_ms']:13.4f} {o['self_device_ms']:15.4f}"
            for o in summary[key]
        ]
    return "\n".join(lines)
