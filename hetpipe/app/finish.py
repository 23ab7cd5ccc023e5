"""`hetpipe finish`: end a run started by hand or by a launcher (`hetpipe server` + `hetpipe worker`s, e.g.
`hetpipe slurm`'s job) as `hetpipe train` ends one: the final model from the running PS as model.pt, its
evaluation, summary.json and the final metrics line, in the run directory."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from hetpipe.app.board import EVAL_METRICS
from hetpipe.app.progress import Progress
from hetpipe.app.train_summary import run_summary
from hetpipe.compute.build import model_of, vw_layouts
from hetpipe.core.config.schema import ClusterConfig
from hetpipe.core.errors import HetpipeError, UsageError
from hetpipe.core.protocol.keys import ADMIN, client_keys
from hetpipe.core.runs.metrics import MetricsWriter
from hetpipe.worker.ps_client import PSClient

__all__ = ["finish_run"]


def _until_done(ps: PSClient, waves: int, wait_s: float) -> None:
    """Wait until every shard has every live VW at `waves` completed waves; HetpipeError after `wait_s`."""
    deadline = time.monotonic() + wait_s
    while True:
        behind = sorted({v for info in ps.status() for v in info["live"] if info["c_local"][v] < waves})
        if not behind:
            return
        if time.monotonic() > deadline:
            raise HetpipeError(
                f"vw {', '.join(map(str, behind))} still short of {waves} waves after {wait_s:.0f} s: is its "
                'worker running? (the PS evicts a VW whose worker died when on_vw_failure = "evict")'
            )
        time.sleep(1.0)


def finish_run(
    config: ClusterConfig, run_dir: Path, wall_s: float, eval_device: str = "cpu", wait_s: float = 600.0
) -> dict[str, Any]:
    """Once every VW the PS counts live has completed the run's waves (a VW that rejoined after an eviction
    may still be at work; at most `wait_s`), read the final weights from the PS (which must still run), save
    model.pt, evaluate it and write summary.json; returns the summary. `wall_s`: the workers' wall time, which
    the speed is measured over (the workers report no per-minibatch events to a launcher here, so the
    summary's speed is samples / wall)."""
    if wall_s <= 0:
        raise UsageError(f"--wall-s {wall_s}: give the workers' wall time in seconds, > 0")
    if config.ps.auth == "curve" and not config.ps.keys_dir:
        raise UsageError(
            f'{config.path}: auth = "curve" without [ps] keys_dir: a run on several machines needs its keys '
            "on shared storage (`hetpipe keys CONFIG --out DIR`, then keys_dir = DIR)"
        )
    spec = model_of(config)
    vws = vw_layouts(config, spec)
    admin = client_keys(Path(config.ps.keys_dir), ADMIN) if config.ps.auth == "curve" else None
    client = PSClient(
        config.ps_endpoints(), config.name, 0, 0, len(vws), 1, {}, timeout_s=60, retry_s=1, curve=admin
    )
    with client as ps:
        _until_done(ps, config.train.waves, wait_s)
        final, infos = ps.read_each()
    run_dir.mkdir(parents=True, exist_ok=True)
    summary = run_summary(
        config, spec, run_dir, final, infos, wall_s, wall_s, Progress(vws), vws, eval_device
    )
    samples = summary["samples"]
    summary.update(
        launcher="distributed",
        timed_samples=samples,
        samples_per_s=round(samples / wall_s, 2),  # over the whole wall: start-up and shutdown included
    )
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=1, sort_keys=True))
    final_eval = {k: summary[k] for k in (*EVAL_METRICS, "eval_samples") if k in summary}
    with MetricsWriter(run_dir / "metrics.jsonl") as metrics:
        metrics.write("eval", wave=config.train.waves, final=True, **final_eval)
    return summary
