"""`hetpipe worker`: run one virtual worker's stages (or one stage) against a running `hetpipe server`."""

from __future__ import annotations

import sys
from pathlib import Path

from hetpipe.compute.build import model_of, vw_layouts
from hetpipe.core.config import ClusterConfig
from hetpipe.core.errors import HetpipeError, UsageError
from hetpipe.core.keys import client_keys, vw_user
from hetpipe.core.procs import ChildFailed, ChildGroup
from hetpipe.worker.jobs import StageJob, stage_jobs
from hetpipe.worker.stage import run_stage

__all__ = ["run_worker", "worker_jobs"]


def worker_jobs(config: ClusterConfig, vw: int, run_dir: Path) -> list[StageJob]:
    """The stage jobs of VW `vw` for a multi-machine run: the PS at [ps] host:port+i, the VW's P2P
    rendezvous on its first GPU's node at ps.port + 100 + vw (open these ports between the machines)."""
    vws = vw_layouts(config, model_of(config))
    if not 0 <= vw < len(vws):
        raise UsageError(f"--vw {vw} is out of range: {config.path} has {len(vws)} virtual workers (0..{len(vws) - 1})")
    first_node = vws[vw].gpus[0].split(":")[0]
    keys = None
    if config.ps.auth == "curve":
        if not config.ps.keys_dir:
            raise UsageError(f'{config.path}: [ps] auth = "curve" but keys_dir is empty: a worker needs its VW\'s '
                             "key pair; run `hetpipe keys CONFIG --out DIR`, give each machine what it needs from DIR "
                             "(a worker: server.key and its vw<I>.key_secret) and set [ps] keys_dir = DIR")
        keys = client_keys(Path(config.ps.keys_dir), vw_user(vw))
    return stage_jobs(config, vws, vw, run_dir=run_dir, ps_endpoints=tuple(config.ps_endpoints()),
                      p2p_host=config.node(first_node).host, p2p_port=config.ps.port + 100 + vw, ps_keys=keys)


def run_worker(config: ClusterConfig, vw: int, stage: int | None, run_dir: Path) -> None:
    """Run one VW's stages (or one stage) against a running `hetpipe server`; owned children, logs in run_dir."""
    jobs = worker_jobs(config, vw, run_dir)
    if stage is not None:
        if not 0 <= stage < len(jobs):
            raise UsageError(f"--stage {stage} is out of range: vw {vw} has {len(jobs)} stages (0..{len(jobs) - 1})")
        jobs = [jobs[stage]]
    group = ChildGroup(log_dir=run_dir / "logs")
    names = ", ".join(f"vw{job.vw}-s{job.stage}" for job in jobs)
    print(f"hetpipe worker: starting {names} against the PS at {', '.join(config.ps_endpoints())}; "
          f"logs in {run_dir / 'logs'}", file=sys.stderr, flush=True)
    try:
        for job in jobs:
            group.start(f"vw{job.vw}-s{job.stage}", run_stage, job, None)
        group.wait()
        print(f"hetpipe worker: {names} finished {config.train.waves} waves", file=sys.stderr, flush=True)
    except ChildFailed as exc:
        raise HetpipeError(str(exc)) from None
    except KeyboardInterrupt:
        raise HetpipeError("interrupted: stopped this worker's stages") from None
    finally:
        group.stop()
