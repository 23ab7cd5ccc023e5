"""Training in the testbed as on several machines: `hetpipe server` in the PS node's namespace (with placement
"local", `hetpipe server --shard I` in node I's) and one
`hetpipe worker` per virtual worker (or per stage, for a VW spanning nodes) in its node's namespace, each a
real process on its node's address, reading the effective config the run directory holds (docs/testbed.md).

Each command runs in its own session, so stopping one stops the stage processes it spawned too; any failure
or Ctrl-C stops all of them and names the command that failed, with its last log lines.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from hetpipe.app.testbed import egress_bytes, netns_argv
from hetpipe.compute.build import VwLayout, model_of, vw_layouts
from hetpipe.core.config.overrides import apply_overrides
from hetpipe.core.config.schema import ClusterConfig
from hetpipe.core.config.serialize import config_toml
from hetpipe.core.errors import HetpipeError
from hetpipe.core.runs.procs import tail
from hetpipe.core.runs.testbed import Topology, effective_config, layout_overrides, worker_places
from hetpipe.core.wsp.groups import group_node, node_groups, relayed

__all__ = ["TestbedRun", "train_in_testbed"]


@dataclass
class TestbedRun:
    """What a run in the testbed leaves: its run dir (traces, logs, the effective config), how long the
    workers took, and the bytes each node sent meanwhile."""

    run_dir: Path
    config_path: Path
    wall_s: float
    egress_bytes: dict[str, int]
    commands: list[str] = field(default_factory=list)


@dataclass
class _Command:
    name: str
    popen: subprocess.Popen
    log: Path


class _Commands:
    """Commands started in their own sessions; stop() ends each one's whole process group."""

    def __init__(self) -> None:
        self.started: list[_Command] = []

    def start(self, name: str, argv: list[str], log: Path) -> _Command:
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "wb") as out:
            popen = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        command = _Command(name, popen, log)
        self.started.append(command)
        return command

    def failure(self, commands: Sequence[_Command]) -> HetpipeError | None:
        for c in commands:
            code = c.popen.poll()
            if code not in (None, 0):
                return HetpipeError(
                    f"{c.name} (pid {c.popen.pid}) exited with code {code}; its last log lines "
                    f"({c.log}):\n{tail(c.log)}"
                )
        return None

    def stop(self, commands: Sequence[_Command] | None = None, grace_s: float = 10.0) -> None:
        """SIGTERM each command's process group, wait up to grace_s, SIGKILL what is left."""
        commands = self.started if commands is None else commands
        for c in commands:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(c.popen.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for c in commands:
            with contextlib.suppress(subprocess.TimeoutExpired):
                c.popen.wait(timeout=max(0.0, deadline - time.monotonic()))
        for c in commands:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(c.popen.pid, signal.SIGKILL)
            c.popen.wait()


def _hetpipe(*args: str) -> list[str]:
    return [sys.executable, "-m", "hetpipe", *args]


def _wait_listening(commands: _Commands, server: _Command, shards: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while server.log.read_text(errors="replace").count("listening on port") < shards:
        bad = commands.failure([server])
        if bad is not None:
            raise bad
        if time.monotonic() > deadline:
            raise HetpipeError(
                f"the PS did not start listening within {timeout_s:.0f} s; its log ({server.log}):\n"
                f"{tail(server.log)}"
            )
        time.sleep(0.1)


def _server_places(config: ClusterConfig, topology: Topology) -> list[tuple[str, int | None]]:
    """(node, shard) of each `hetpipe server` to start: every shard on the PS node (shard None: all of them),
    or with placement "local" or "spread" shard i on node i."""
    if config.ps.shard_per_node:
        return [(node.name, i) for i, node in enumerate(config.nodes)]
    return [(topology.ps_node, None)]


def _relay_nodes(config: ClusterConfig, vws: Sequence[VwLayout]) -> list[str]:
    """The nodes that run a relay: those of node aggregation's relayed groups."""
    gpus = [lay.gpus for lay in vws]
    groups = relayed(node_groups(gpus, config.ps.node_aggregation))
    return [group_node(gpus, members) for members in groups]


def _start_relays(
    commands: _Commands,
    config: ClusterConfig,
    vws: Sequence[VwLayout],
    config_path: Path,
    topology: Topology,
    lines: list[str],
) -> list[_Command]:
    """`hetpipe relay --node N` in the namespace of each node that runs one, once it listens."""
    relays = []
    for node in _relay_nodes(config, vws):
        argv = _hetpipe("relay", "--config", str(config_path), "--node", node)
        log = config_path.parent / "logs" / f"relay-{node}.log"
        relay = commands.start(f"hetpipe relay --node {node}", netns_argv(topology, node, argv), log)
        _wait_listening(commands, relay, config.ps.shards, timeout_s=120)
        relays.append(relay)
        lines.append(f"{node} ({topology.node(node).address}): {' '.join(argv[1:])}")
    return relays


def train_in_testbed(
    config: ClusterConfig,
    topology: Topology,
    run_dir: Path,
    *,
    layouts: Sequence[VwLayout] | None = None,
    timeout_s: float = 900.0,
    say: Callable[[str], None] = lambda line: None,
) -> TestbedRun:
    """Train `config` in the (already built) testbed: the PS, then every worker, until all workers finish;
    then the PS is stopped (SIGTERM: it checkpoints when checkpoints are on). `layouts` lists the VWs and
    splits (e.g. a plan's); default: the config's. Returns the run, or raises naming the command that
    failed."""
    run_dir.mkdir(parents=True, exist_ok=True)
    run_dir = run_dir.resolve()
    if layouts is not None:
        config = apply_overrides(
            config, layout_overrides((lay.gpus, lay.split, lay.nm, lay.batch) for lay in layouts)
        )
    config = effective_config(config, topology)
    vws = vw_layouts(config, model_of(config))
    config_path = run_dir / "cluster.toml"
    config_path.write_text(config_toml(config))
    commands = _Commands()
    lines = []
    try:
        servers = []
        for node, shard in _server_places(config, topology):
            argv = _hetpipe(
                "server", "--config", str(config_path), *(() if shard is None else ("--shard", str(shard)))
            )
            log = run_dir / "logs" / ("server.log" if shard is None else f"server-{shard}.log")
            name = "hetpipe server" + ("" if shard is None else f" --shard {shard}")
            servers.append(commands.start(name, netns_argv(topology, node, argv), log))
            lines.append(f"{node} ({topology.node(node).address}): {' '.join(argv[1:])}")
        for server in servers:
            _wait_listening(commands, server, 1 if len(servers) > 1 else config.ps.shards, timeout_s=120)
        servers += _start_relays(commands, config, vws, config_path, topology, lines)
        before = egress_bytes(topology)
        started = time.monotonic()
        workers = []
        for place in worker_places([lay.gpus for lay in vws]):
            argv = _hetpipe("worker", "--config", str(config_path), *place.args(), "--run-dir", str(run_dir))
            name = f"hetpipe worker {' '.join(place.args())}"
            log = (
                run_dir
                / "logs"
                / ("worker-vw{}{}.log".format(place.vw, "" if place.stage is None else f"-s{place.stage}"))
            )
            workers.append(commands.start(name, netns_argv(topology, place.node, argv), log))
            lines.append(f"{place.node} ({topology.node(place.node).address}): {' '.join(argv[1:])}")
        for line in lines:
            say(f"  {line}")
        deadline = started + timeout_s
        while any(w.popen.poll() is None for w in workers):
            bad = commands.failure([*workers, *servers])
            if bad is not None:
                raise bad
            if time.monotonic() > deadline:
                raise HetpipeError(
                    f"the workers did not finish in {timeout_s:.0f} s (logs in {run_dir / 'logs'}): "
                    "give them more time or fewer waves"
                )
            time.sleep(0.2)
        bad = commands.failure(workers)
        if bad is not None:
            raise bad
        wall = time.monotonic() - started
        after = egress_bytes(topology)
        commands.stop(servers, grace_s=30.0)  # SIGTERM: the PS checkpoints (when on), then exits
    except KeyboardInterrupt:
        raise HetpipeError("interrupted: stopped the PS and every worker") from None
    finally:
        commands.stop()
    return TestbedRun(run_dir, config_path, wall, {n: after[n] - before[n] for n in after}, lines)
