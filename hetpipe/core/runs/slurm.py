"""A cluster config as a Slurm heterogeneous job, as plain data and text (docs/clusters.md#slurm): one
component per config node that runs something, the `hetpipe server` and `hetpipe worker` steps each runs (the
testbed's places: hetpipe.core.runs.testbed), and the batch script that starts them. No I/O.

The script runs on the job's first node: it learns each component's address (the node's first address, or
its Slurm hostname), points the config's nodes and PS at them (`--set`), starts the PS and waits until every
shard listens, starts the workers and waits for them (stopping everything when one fails), then runs `hetpipe
finish` (the final model from the PS, evaluated, and the summary, as `hetpipe train` leaves them) and stops
the PS with SIGTERM, which checkpoints.
"""

from __future__ import annotations

import shlex
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from hetpipe.core.config.schema import ClusterConfig
from hetpipe.core.errors import UsageError
from hetpipe.core.runs.testbed import worker_places

__all__ = ["ADDRESS_MODES", "SlurmJob", "Step", "job_script", "slurm_job"]

Address = Literal["ip", "hostname"]
ADDRESS_MODES: tuple[Address, ...] = ("ip", "hostname")
LISTEN_TIMEOUT_S = 120  # the PS's shards must listen within this


@dataclass(frozen=True)
class Step:
    """One `srun` step: `hetpipe ARGS` on config node `node`, its output in logs/`log` of the run dir."""

    node: str
    args: tuple[str, ...]
    log: str
    server: bool


@dataclass(frozen=True)
class SlurmJob:
    """The job of a config: its het components (config nodes, in config order, with their GPU counts), the
    PS steps, then the worker steps."""

    name: str
    nodes: tuple[str, ...]
    gpus: tuple[int, ...]
    node_index: tuple[int, ...]  # each component's index among the config's nodes (for --set nodes.I.host)
    ps_node: str
    steps: tuple[Step, ...]

    def component(self, node: str) -> int:
        return self.nodes.index(node)


def slurm_job(
    config: ClusterConfig, vw_gpus: Sequence[Sequence[str]], ps_node: str | None = None
) -> SlurmJob:
    """The job that runs `config`'s PS and its VWs (`vw_gpus`: each VW's GPUs, "node:index"). The PS runs on
    `ps_node`, else the node whose host is ps.host, else the first node; with placement "local" or "spread",
    shard i on node i."""
    names = [n.name for n in config.nodes]
    if ps_node is None:
        ps_node = next((n.name for n in config.nodes if n.host == config.ps.host), names[0])
    elif ps_node not in names:
        raise UsageError(f"--ps-node {ps_node!r}: {config.path} has nodes {', '.join(names)}")
    steps: list[Step] = []
    if config.ps.shard_per_node:
        steps += [
            Step(n, ("server", "--shard", str(i)), f"server-{i}.log", True) for i, n in enumerate(names)
        ]
    else:
        steps.append(Step(ps_node, ("server",), "server.log", True))
    for place in worker_places(vw_gpus):
        log = f"worker-vw{place.vw}" + ("" if place.stage is None else f"-s{place.stage}") + ".log"
        steps.append(Step(place.node, ("worker", *place.args()), log, False))
    used = {s.node for s in steps}
    index = [i for i, n in enumerate(names) if n in used]
    gpus = [len(config.nodes[i].gpus) for i in index]
    return SlurmJob(
        config.name, tuple(names[i] for i in index), tuple(gpus), tuple(index), ps_node, tuple(steps)
    )


def job_script(
    job: SlurmJob,
    *,
    config_file: str,
    run_dir: str,
    python: str = "python3",
    address: Address = "ip",
    gres: bool = False,
    shards: int = 1,
    evict: bool = False,
) -> str:
    """The batch script of `job`: `sbatch` it as it is. `config_file`, `run_dir` and `python` as every node
    sees them (shared storage); `address`: how a component's address is found ("ip": the first of `hostname
    -I` on it; "hostname": its Slurm node name, resolved by DNS); `gres`: ask for each node's GPUs
    (--gres=gpu:N); `shards`: the PS's shard count (each prints "listening on port" once); `evict`: the
    config's on_vw_failure is "evict", so a failed worker leaves the others going (and its VW can be started
    again into the job: the script prints the srun to do it) instead of stopping the job."""
    if address not in ADDRESS_MODES:
        raise UsageError(f"address {address!r}: choose one of {', '.join(ADDRESS_MODES)}")
    q = shlex.quote
    lines = [
        "#!/bin/bash",
        f"# hetpipe: cluster {job.name} as a Slurm heterogeneous job, one component per node (written by",
        "# `hetpipe slurm`; docs/clusters.md#slurm). Submit it as it is: sbatch THIS_FILE",
        f"#SBATCH --job-name=hetpipe-{job.name}",
        f"#SBATCH --output={run_dir}/logs/slurm-%j.out",
    ]
    for c, (node, gpus) in enumerate(zip(job.nodes, job.gpus, strict=True)):
        if c:
            lines.append("#SBATCH hetjob")
        # the whole node: its steps (the PS, a worker per VW or stage) overlap in one task's allocation
        lines.append(
            "#SBATCH --nodes=1 --ntasks=1 --exclusive" + (f" --gres=gpu:{gpus}" if gres and gpus else "")
        )
        lines.append(f"#   component {c}: config node {node}")
    lines += _body(job, q(config_file), q(run_dir), q(python), address, gres, shards, evict)
    return "\n".join(lines) + "\n"


def _body(
    job: SlurmJob,
    config_file: str,
    run_dir: str,
    python: str,
    address: str,
    gres: bool,
    shards: int,
    evict: bool,
) -> list[str]:
    """The script after its #SBATCH lines (bash; arguments already quoted)."""
    het = len(job.nodes) > 1  # one component: a plain job, without --het-group or HET_GROUP variables
    if address == "ip":
        group = ' --het-group="$1"' if het else ""
        find = f"srun{group} --nodes=1 --ntasks=1 --overlap hostname -I | awk '{{print $1}}'"
    else:
        nodelist = "$(eval echo \\$SLURM_JOB_NODELIST_HET_GROUP_$1)" if het else "$SLURM_JOB_NODELIST"
        find = f'scontrol show hostnames "{nodelist}" | head -n 1'
    out = [
        "set -euo pipefail",
        f"RUN_DIR={run_dir}",
        f"CONFIG={config_file}",
        f"PY={python}",
        'mkdir -p "$RUN_DIR/logs"',
        f"address() {{ {find}; }}",
        "SETS=()",
    ]
    for c, index in enumerate(job.node_index):
        out.append(f'A{c}=$(address {c}); SETS+=(--set "nodes.{index}.host=$A{c}")')
        out.append(f'echo "node {job.nodes[c]}: $A{c}"')
    out.append(f'SETS+=(--set "ps.host=$A{job.component(job.ps_node)}")')  # the PS's node runs a server step
    out += [
        "PIDS=()",
        'stop() { kill -TERM "${PIDS[@]}" 2>/dev/null || true; wait || true; }',
        "trap 'stop; exit 1' INT TERM",
    ]
    workers = [s for s in job.steps if not s.server]
    out += _start_servers(job, gres, shards)
    out += [
        'SERVERS=("${PIDS[@]}")',
        "STARTED=$(date +%s%N)",
        "declare -A STEP WHOLE  # pid -> the step (and whether a whole VW)",
        "WORKERS=()",
    ]
    for s in workers:
        command = _srun(job, s.node, s.args, gres) + ' --config "$CONFIG" --run-dir "$RUN_DIR" "${SETS[@]}"'
        out.append(command + ' > "$RUN_DIR/logs/' + s.log + '" 2>&1 &')
        shown = command.replace('"', "")  # expanded when assigned: a command to copy
        whole = "--stage" not in s.args  # a whole VW rejoins when started again; one stage of it cannot yet
        out += ["WORKERS+=($!)", "PIDS+=($!)", f'STEP[$!]="{shown}"; WHOLE[$!]={int(whole)}']
    out += ["status=0", "failed=0"] + (_wait_evicting() if evict else _wait_stopping())
    out += [
        "WALL_MS=$(( ($(date +%s%N) - STARTED) / 1000000 ))",
        "# as `hetpipe train` ends: the final model from the PS, evaluated, and the summary",
        _srun(job, job.ps_node, ("finish",), False)
        + ' --config "$CONFIG" --run-dir "$RUN_DIR" --wall-s "${WALL_MS}e-3" "${SETS[@]}" || status=1',
        'kill -TERM "${SERVERS[@]}"  # the PS checkpoints (when on), then exits',
        'wait "${SERVERS[@]}" || true',
        'echo "hetpipe: every worker finished; model, summary and logs in $RUN_DIR"',
        'exit "$status"',
    ]
    return out


def _start_servers(job: SlurmJob, gres: bool, shards: int) -> list[str]:
    """Start the PS steps, then wait until every shard listens (LISTEN_TIMEOUT_S at most)."""
    servers = [s for s in job.steps if s.server]
    out = []
    for s in servers:
        out.append(
            _srun(job, s.node, s.args, gres)
            + ' --config "$CONFIG" "${SETS[@]}" > "$RUN_DIR/logs/'
            + s.log
            + '" 2>&1 &'
        )
        out.append("PIDS+=($!)")
    want = (shards if len(servers) == 1 else 1) * len(servers)
    logs = " ".join(f'"$RUN_DIR/logs/{s.log}"' for s in servers)
    return out + [
        f"for _ in $(seq {LISTEN_TIMEOUT_S * 10}); do  # every shard listening, or give up",
        f"  n=$(cat {logs} 2>/dev/null | grep -c 'listening on port' || true)",
        f'  [ "$n" -ge {want} ] && break',
        "  sleep 0.1",
        "done",
        f'if [ "$n" -lt {want} ]; then',
        f'  echo "the PS did not listen within {LISTEN_TIMEOUT_S} s: see $RUN_DIR/logs/server*.log" >&2',
        "  stop; exit 1",
        "fi",
    ]


def _wait_stopping() -> list[str]:
    """Wait for the workers; the first to fail stops the job."""
    return [
        'for _ in "${WORKERS[@]}"; do',
        '  if ! wait -n -p DONE "${WORKERS[@]}"; then',
        '    echo "failed: ${STEP[$DONE]}; stopping the job" >&2; stop; exit 1',
        "  fi",
        "done",
    ]


def _wait_evicting() -> list[str]:
    """Wait for every worker; one that fails is evicted by the PS and the others go on (on_vw_failure =
    "evict"); the job fails only when every worker did. `hetpipe finish` then waits for a VW started
    again."""
    return [
        'for _ in "${WORKERS[@]}"; do',
        '  if ! wait -n -p DONE "${WORKERS[@]}"; then',
        "    failed=$((failed + 1))",
        '    echo "failed: ${STEP[$DONE]}; the PS evicts its VW and the others go on" >&2',
        '    if [ "${WHOLE[$DONE]}" = 1 ]; then',
        '      echo "start it again into this job (it rejoins):"'
        ' "srun --jobid=$SLURM_JOB_ID ${STEP[$DONE]#srun }" >&2',
        "    fi",
        "  fi",
        "done",
        'if [ "$failed" -eq "${#WORKERS[@]}" ]; then echo "every worker failed" >&2; stop; exit 1; fi',
    ]


def _srun(job: SlurmJob, node: str, args: Sequence[str], gres: bool) -> str:
    """`hetpipe ARGS` as an srun step on `node`'s component, one task (steps overlap: a worker's stages share
    its node's allocation)."""
    c = job.component(node)
    group = f" --het-group={c}" if len(job.nodes) > 1 else ""
    extra = f" --gres=gpu:{job.gpus[c]}" if gres and job.gpus[c] else ""
    quoted = " ".join(shlex.quote(a) for a in args)
    return f'srun{group} --nodes=1 --ntasks=1 --overlap{extra} "$PY" -m hetpipe {quoted}'
