"""The end of a `hetpipe train` run: the final model from the PS's weights (model.pt), the merged trace, the
final evaluation and the summary's numbers, with the audit's check of the final ledgers. Runs after every
child has stopped."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import torch

from hetpipe.app.progress import Progress
from hetpipe.compute.build import VwLayout, dataset_of, run_work
from hetpipe.compute.evaluate import evaluate
from hetpipe.core.config.schema import ClusterConfig
from hetpipe.core.runs.metrics import merge_traces
from hetpipe.core.wsp.audit import expected_ledger
from hetpipe.models import ModelSpec

__all__ = ["run_summary"]


def run_summary(
    config: ClusterConfig,
    spec: ModelSpec,
    run_dir: Path,
    final: list[dict[str, Any]],
    infos: list[dict[str, Any]],
    wall: float,
    training: float,
    progress: Progress,
    vws: tuple[VwLayout, ...],
    eval_device: str,
) -> dict[str, Any]:
    """Save the final weights (each shard's `final` tensors, audit ledgers left out) as model.pt, merge the
    stages' traces, evaluate the model on `eval_device` and point <train.out_dir>/latest at the run; returns
    the summary: the run's shape, its speed, the progress's numbers, the audit's ledgers and the
    evaluation."""
    state = {
        k: torch.from_numpy(v.copy())
        for tensors in final
        for k, v in tensors.items()
        if not k.startswith("audit/")
    }
    torch.save(state, run_dir / "model.pt")
    traces = sorted((run_dir / "trace").glob("vw*-s*.json"))
    if traces:
        merge_traces(traces, run_dir / "trace.json")
    dataset = dataset_of(config)
    work = run_work(config, vws)
    samples = sum(  # this run's part: each VW's waves from the resumed wave on, its planned span's only
        max(0, end - max(start, progress.start_wave)) * w.samples
        for (start, end), w in zip((lay.span(config.train.waves) for lay in vws), work, strict=True)
    )
    summary: dict[str, Any] = {
        "config": str(config.path),
        "run_dir": str(run_dir),
        "model": spec.name,
        "virtual_workers": len(vws),
        "waves": config.train.waves,
        "nm": config.wsp.nm,
        "work": [{"nm": w.nm, "batch": w.batch} for w in work],  # each VW's wave (docs/wsp.md#per-vw-work)
        "staleness": config.wsp.staleness,
        "pull": config.wsp.pull,
        "samples": samples,
        "wall_s": round(wall, 2),
        # speed over the training itself: the minibatches finished after the first one, over the time from
        # the first to the last (process start-up, data loading, registration and shutdown excluded)
        "train_s": round(training, 2),
        "timed_samples": progress.samples,  # the samples train_s covers: every minibatch after the first
        "samples_per_s": round(progress.samples / max(training, 1e-9), 2),  # timed_samples / train_s
        "max_lead_waves": progress.max_lead,
        "gate_wait_s": {
            str(v): round(max((w for (vv, _), w in progress.gate_wait.items() if vv == v), default=0.0), 3)
            for v in range(len(vws))
        },
        "final_train_loss": {str(v): progress.loss.get(v) for v in range(len(vws))},
        # where each VW's waves went, ms per wave (its slowest stage in each part; see docs/architecture.md)
        "wave_breakdown_ms": progress.breakdown_ms(config.train.waves),
        "evals": progress.evals,
    }
    summary.update(_freezing(config, progress))
    summary.update(_checkpoint_failures(infos))
    audit = _audit_ledgers(final, infos, tuple(w.nm for w in work))
    if audit is not None:  # every (vw, minibatch) update must sit in the final weights exactly once
        summary["audit_checks"] = progress.audit_checks
        summary["audit_final_ledgers_exact"] = audit["lost"] == audit["duplicated"] == audit["stray"] == 0
        summary["audit_ledger"] = audit
    summary.update(
        evaluate(
            spec, state, dataset, batch_size=256, device=eval_device, max_samples=config.train.eval_samples
        )
    )
    latest = Path(config.train.out_dir) / "latest"
    try:
        if latest.is_symlink() or latest.exists():
            latest.unlink()
        os.symlink(run_dir.resolve(), latest)
    except OSError:
        pass
    return summary


def _audit_ledgers(
    final: list[dict[str, Any]], infos: list[dict[str, Any]], nms: tuple[int, ...]
) -> dict[str, int] | None:
    """Each shard's final ledgers against what its clock and its VWs' gaps say they must hold: every update of
    a wave a VW contributed exactly once (lost: missing; duplicated: more than once; stray: in a gap)."""
    counts = {"slots": 0, "lost": 0, "duplicated": 0, "stray": 0}
    found = False
    for tensors, info in zip(final, infos, strict=True):
        for key, ledger in tensors.items():
            if not key.startswith("audit/"):
                continue
            found = True
            want = expected_ledger(ledger.shape, nms, info.get("gaps", []), info["c_global"])
            counts["slots"] += ledger.size
            counts["lost"] += int(((want == 1.0) & (ledger < 1.0)).sum())
            counts["duplicated"] += int((ledger > 1.0).sum())
            counts["stray"] += int(((want == 0.0) & (ledger > 0.0) & (ledger <= 1.0)).sum())
    return counts if found else None


def _checkpoint_failures(infos: list[dict[str, Any]]) -> dict[str, Any]:
    """The shards' failed checkpoints over the run (each shard logged them as they came; a run that ends well
    must still say so): their count and errors for the summary, and a warning; {} when none failed."""
    failed = sum(info.get("checkpoint_failures", 0) for info in infos)
    if not failed:
        return {}
    errors = [info["checkpoint_error"] for info in infos if info.get("checkpoint_error")]
    print(
        f"warning: {failed} PS checkpoint(s) failed during the run (e.g. {errors[0] if errors else '?'}); a "
        "crash of a shard then would have lost pushes: free disk space or file descriptors",
        file=sys.stderr,
        flush=True,
    )
    return {"checkpoint_failures": failed, "checkpoint_errors": errors}


def _freezing(config: ClusterConfig, progress: Progress) -> dict[str, Any]:
    """The frozen layers' cache's counts, and the freeze points the adaptive rule chose."""
    out: dict[str, Any] = {}
    if config.train.freeze_cache_mib and config.train.freezes:  # hits: minibatches served from kept rows
        out["frozen_cache"] = {k: round(v, 2) for k, v in progress.frozen_cache.items()}
    if config.train.autofreeze_every:  # [wave, layers frozen from it]
        out["autofreeze"] = [[w, n] for w, n in sorted(progress.frozen_from.items())]
    return out
