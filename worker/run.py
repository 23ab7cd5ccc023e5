"""`hetpipe worker`: run one virtual worker's stages (or one stage) against a running PS: a `hetpipe server`,
or the PS of a `hetpipe train` run (--join RUN_DIR). A VW the PS evicted after a failure rejoins at the next
wave boundary the shards accept, from the current global weights (docs/recovery.md)."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from hetpipe.compute.build import VwLayout, model_of, vw_layouts
from hetpipe.core.config.schema import ClusterConfig
from hetpipe.core.errors import HetpipeError, UsageError
from hetpipe.core.pipeline.profile_window import ProfileWindow
from hetpipe.core.planning.cluster import check_vw_index
from hetpipe.core.protocol.keys import ClientKeys, client_keys, vw_user
from hetpipe.core.runs.procs import ChildFailed, ChildGroup, free_port
from hetpipe.core.wsp.groups import relay_node
from hetpipe.worker.jobs import StageJob, stage_jobs
from hetpipe.worker.ps_client import PSClient, PSError
from hetpipe.worker.stage import run_stage

__all__ = ["join_wave", "run_worker", "worker_jobs"]


def _keys(config: ClusterConfig, vw: int, join: Path | None) -> ClientKeys | None:
    if config.ps.auth != "curve":
        return None
    if config.ps.keys_dir:
        return client_keys(Path(config.ps.keys_dir), vw_user(vw))
    if join is not None and (join / "keys").is_dir():
        return client_keys(join / "keys", vw_user(vw))
    raise UsageError(
        f'{config.path}: [ps] auth = "curve" but keys_dir is empty: a worker needs its VW\'s '
        "key pair; run `hetpipe keys CONFIG --out DIR`, give each machine what it needs from DIR "
        "(a worker: server.key and its vw<I>.key_secret) and set [ps] keys_dir = DIR"
    )


def _joined(join: Path) -> dict:
    try:
        return json.loads((join / "ps.json").read_text())
    except (OSError, ValueError) as exc:
        raise UsageError(
            f"--join {join}: cannot read the PS's endpoints from {join / 'ps.json'} ({exc}); is it the run "
            "dir of a running `hetpipe train`?"
        ) from None


def _shard_endpoints(config: ClusterConfig, join: Path | None) -> list[str]:
    """The PS shards: the config's, or those of the joined run."""
    return config.ps_endpoints() if join is None else list(_joined(join)["endpoints"])


def _endpoints(config: ClusterConfig, join: Path | None, vws: tuple[VwLayout, ...], vw: int) -> list[str]:
    """Where VW `vw`'s stages push and pull: the shards, or its node's relays when node aggregation relays
    it (docs/wsp.md#node-local-aggregation)."""
    shards = _shard_endpoints(config, join)
    node = relay_node([lay.gpus for lay in vws], vw, config.ps.node_aggregation)
    return shards if join is not None or node is None else config.relay_endpoints(node)


def worker_jobs(
    config: ClusterConfig,
    vw: int,
    run_dir: Path,
    join: Path | None = None,
    start_wave: int = 0,
    profile: ProfileWindow | None = None,
    audit: bool = False,
) -> list[StageJob]:
    """The stage jobs of VW `vw` for a multi-machine run: the PS at [ps] host:port+i, the VW's P2P
    rendezvous on its first GPU's node at ps.port + 100 + vw (open these ports between the machines). With
    `join`, the PS of that `hetpipe train` run and a free local port."""
    vws = _checked_vws(config, vw)
    first_node = vws[vw].gpus[0].split(":")[0]
    host, port = (
        ("127.0.0.1", free_port()) if join else (config.node(first_node).host, config.ps.port + 100 + vw)
    )
    # the run's stages carry ledgers (every worker of a run started with --audit, or a joined `hetpipe train
    # --audit`): this VW's must too
    audit = audit or bool(join and _joined(join).get("audit"))
    return stage_jobs(
        config,
        vws,
        vw,
        run_dir=run_dir,
        ps_endpoints=tuple(_endpoints(config, join, vws, vw)),
        p2p_host=host,
        p2p_port=port,
        ps_keys=_keys(config, vw, join),
        start_wave=start_wave,
        audit=audit,
        profile=profile,
    )


def _checked_vws(config: ClusterConfig, vw: int) -> tuple[VwLayout, ...]:
    """The config's VWs; UsageError when `vw` is not one of them."""
    check_vw_index(config, vw)
    return vw_layouts(config, model_of(config))


def join_wave(
    config: ClusterConfig, vw: int, endpoints: list[str], keys: ClientKeys | None, say=lambda line: None
) -> int:
    """The wave VW `vw` starts at: 0 for a VW the PS has not seen work from; for one the PS evicted, a wave
    every shard accepts it back at (it waits while the PS still counts the VW live: its heartbeats time
    out)."""
    patience = config.ps.hung_after_s + 30.0 if config.ps.hung_after_s else 60.0
    deadline = time.monotonic() + patience
    with PSClient(endpoints, config.name, vw, 0, 1, 1, {}, timeout_s=30, retry_s=1, curve=keys) as ps:
        while True:
            infos = ps.status()
            states = {_state_of(info, vw) for info in infos}
            if states == {"fresh"}:
                return 0  # nothing of this VW at the PS yet: a start, not a rejoin
            if states == {"evicted"}:
                wave = max(info["c_global"] for info in infos) + config.wsp.staleness + 2
                if wave >= config.train.waves:
                    raise HetpipeError(
                        f"vw {vw} cannot rejoin: the run is at wave {wave - config.wsp.staleness - 2} "
                        f"of {config.train.waves}, too close to its end"
                    )
                try:
                    call = ps.send(
                        [("rejoin", {"run": config.name, "vw": vw, "start_wave": wave}, None)]
                        * len(ps.sockets),
                        what=f"rejoin of vw {vw}",
                    )
                    ps.wait(call)
                    return wave
                except PSError as exc:
                    if exc.code != "stale":
                        raise HetpipeError(f"vw {vw} cannot rejoin: {exc}") from None
                    say(f"hetpipe worker: {exc}; trying a later wave")
            elif time.monotonic() > deadline:
                raise HetpipeError(
                    f"vw {vw} is still live at the PS after {patience:.0f} s: is another worker running "
                    'it? (a VW rejoins once the PS evicted it: [ps] on_vw_failure = "evict")'
                )
            time.sleep(1.0)


def _state_of(info: dict, vw: int) -> str:
    """What one shard's status says of VW `vw`: "fresh" (no work of it yet), "live" or "evicted"."""
    if info["num_vws"] is None or (
        vw in info["live"] and info["c_local"][vw] == 0 and info["epochs"][vw] == [[0, -1]]
    ):
        return "fresh"
    return "live" if vw in info["live"] else "evicted"


def _evict_self(config: ClusterConfig, vw: int, endpoints: list[str], keys: ClientKeys | None) -> None:
    """This worker's stage failed: take its VW out now, so the others do not wait for its heartbeats to time
    out."""
    if config.ps.on_vw_failure != "evict":
        return
    try:
        with PSClient(endpoints, config.name, vw, 0, 1, 1, {}, timeout_s=10, retry_s=1, curve=keys) as ps:
            ps.wait(
                ps.send(
                    [("evict", {"run": config.name, "vw": vw}, None)] * len(ps.sockets),
                    what=f"evict of vw {vw}",
                )
            )
    except HetpipeError:
        pass  # the PS's heartbeat check evicts it anyway


def run_worker(
    config: ClusterConfig,
    vw: int,
    stage: int | None,
    run_dir: Path | None,
    join: Path | None = None,
    profile: ProfileWindow | None = None,
    audit: bool = False,
) -> None:
    """Run one VW's stages (or one stage) against a running PS; owned children, logs in run_dir (and with
    `profile` each stage's op profile in run_dir/profile, as `hetpipe train --profile` writes it). `audit`:
    the stages carry tagged-update ledgers (every worker of the run must; `hetpipe finish` then checks the
    PS's final ledgers)."""
    _checked_vws(config, vw)  # before anything waits on the PS
    if profile is not None:
        profile.check_fits(config.train.waves, config.wsp.nm)
    run_dir = run_dir or (join / f"worker-vw{vw}-{time.strftime('%H%M%S')}" if join else Path("runs/worker"))
    say = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
    endpoints, keys = _shard_endpoints(config, join), _keys(config, vw, join)
    start = join_wave(config, vw, endpoints, keys, say) if stage is None else 0
    jobs = worker_jobs(config, vw, run_dir, join, start, profile, audit)
    if stage is not None:
        if not 0 <= stage < len(jobs):
            raise UsageError(
                f"--stage {stage} is out of range: vw {vw} has {len(jobs)} stages (0..{len(jobs) - 1})"
            )
        jobs = [jobs[stage]]
    group = ChildGroup(log_dir=run_dir / "logs")
    names = ", ".join(f"vw{job.vw}-s{job.stage}" for job in jobs)
    joined = f" (rejoining at wave {start})" if start else ""
    say(
        f"hetpipe worker: starting {names}{joined} against the PS at {', '.join(jobs[0].ps_endpoints)}; "
        f"logs in {run_dir / 'logs'}"
    )
    try:
        for job in jobs:
            group.start(f"vw{job.vw}-s{job.stage}", run_stage, job, None)
        (run_dir / "pids.json").write_text(
            json.dumps({c.name: c.process.pid for c in group.children}, indent=1)
        )
        group.wait()
        say(f"hetpipe worker: {names} finished {config.train.waves} waves")
    except ChildFailed as exc:
        group.stop()
        _evict_self(config, vw, endpoints, keys)
        raise HetpipeError(str(exc)) from None
    except KeyboardInterrupt:
        raise HetpipeError("interrupted: stopped this worker's stages") from None
    finally:
        group.stop()
