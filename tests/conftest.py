"""Shared fixtures: a process group that owns every child a test starts, and PS shards on ephemeral ports."""

from __future__ import annotations

import os
import random
import signal
import socket
from collections.abc import Iterable, Iterator
from pathlib import Path

import pytest

from hetpipe.core.runs.procs import ChildGroup
from hetpipe.server.launch import serve_settings
from hetpipe.server.shard import ShardSettings


@pytest.fixture
def children(tmp_path: Path) -> Iterator[ChildGroup]:
    """Every process a test starts; at teardown all are stopped and none may be left alive."""
    group = ChildGroup(log_dir=tmp_path / "logs")
    yield group
    group.stop(grace_s=5.0)
    alive = [c.name for c in group.children if c.process.is_alive()]
    assert not alive, f"processes left behind: {alive}"
    for child in group.children:
        if child.process.pid:
            with pytest.raises(ProcessLookupError):
                os.kill(child.process.pid, 0)


def start_shard(group: ChildGroup, settings: ShardSettings, name: str = "ps") -> tuple[str, object]:
    """Start one shard as a child; returns its endpoint (the port it bound) and the child."""
    queue = group.ctx.Queue()
    child = group.start(name, serve_settings, settings, queue)
    try:
        port = queue.get(timeout=30)
    except Exception as exc:
        raise AssertionError(
            f"shard {name} did not start: {child.log.read_text() if child.log else ''}"
        ) from exc
    return f"tcp://127.0.0.1:{port}", child


def free_port_block(offsets: Iterable[int], host: str = "127.0.0.1") -> int:
    """A base port with base + each offset free on `host` now, all below the OS's ephemeral range: for ports a
    test's processes bind later by rule (`hetpipe worker`'s rendezvous at ps.port + 100 + vw). A port the OS
    picked (`free_port`) lies inside that range, where any other process's outgoing connection may take
    base + 100 before the worker binds it (CI saw EADDRINUSE)."""
    offsets = sorted(set(offsets))
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    rng = random.Random()
    for _ in range(200):
        base = rng.randrange(10000, low - offsets[-1])
        try:
            for offset in offsets:
                with socket.socket() as s:
                    s.bind((host, base + offset))
        except OSError:
            continue
        return base
    raise AssertionError(f"no block of free ports {offsets} below {low} on {host}")


def write_config(
    tmp_path: Path,
    *,
    vws: list[list[str]],
    nm: int,
    staleness: int,
    waves: int,
    optimizer: str = "momentum",
    pull: str = "exact",
    speeds: list[float] | None = None,
    emulation: bool = False,
    time_scale: float = 1.0,
    hidden: tuple[int, ...] = (24, 16),
    model: str = "mlp",
    batch_size: int = 16,
    device: str = "cpu",
    extra: str = "",
    work: list[tuple[int, int]] | None = None,
) -> Path:
    """A cluster config for runtime tests: one node, one GPU type per entry of `speeds` (GPU i has type i
    when speeds are given), the given VWs (with `work`: each one's own nm and batch_size), a small MLP on
    MNIST. Every GPU computes on `device` (the CPU by default, so the tests take the CPU path on a machine
    with a GPU too); `extra` is appended TOML."""
    num = sum(len(v) for v in vws)
    speeds = speeds or [1.0] * num
    types = "".join(f"[gpu_types.g{i}]\nspeed = {s}\nmemory_gib = 4.0\n" for i, s in enumerate(speeds))
    gpus = ", ".join(f'"g{i if len(speeds) == num else 0}"' for i in range(num))
    own = [f"nm = {nm_v}\nbatch_size = {b}\n" for nm_v, b in work] if work else [""] * len(vws)
    vw_tables = "".join(
        "[[virtual_workers]]\ngpus = [" + ", ".join(f'"{g}"' for g in v) + "]\n" + own[i]
        for i, v in enumerate(vws)
    )
    text = f"""name = "test"
seed = 3
{types}[[nodes]]
name = "n0"
gpus = [{gpus}]
devices = [{", ".join(f'"{device}"' for _ in range(num))}]
[wsp]
staleness = {staleness}
nm = {nm}
pull = "{pull}"
[checkpoint]
dir = ""
[model]
name = "{model}"
{f"options = {{ hidden = {list(hidden)} }}" if model == "mlp" else ""}
[data]
name = "mnist"
test_fraction = 0.2
[train]
batch_size = {batch_size}
waves = {waves}
optimizer = "{optimizer}"
lr = 0.05
out_dir = "{tmp_path / "runs"}"
[emulation]
enabled = {str(emulation).lower()}
time_scale = {time_scale}
{extra}
{vw_tables}"""
    path = tmp_path / "cluster.toml"
    path.write_text(text)
    return path


def as_from_a_terminal() -> None:
    """Popen preexec_fn for a child a test sends SIGINT: SIGINT and SIGHUP as a terminal leaves them. A suite
    started in the background (`cmd &` in a script, nohup) runs with them ignored, children inherit that, and
    a child that ignores Ctrl-C cannot show that it stops on one."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGHUP, signal.SIG_DFL)
