"""The shaped-network testbed's shell: builds and removes it with `ip` and `tc` (the plan is
hetpipe.core.runs.testbed's), enters its namespaces, measures each node's egress, runs a command inside it and
always tears it down (docs/testbed.md).

What is on the machine while a testbed is up: namespaces hp-<run>-<node>, a bridge hp-<run>-br with one veth
port hp-<run>-<i> per node, and /run/hetpipe-testbed/<run>/ (state.json: the topology and its owner process;
cluster.toml: the effective config). `remove()` deletes all of that, for one run or every run; `up()` first
deletes the leftovers of runs whose owner process is gone (a killed run).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import json
import os
import shutil
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from hetpipe.core.config.schema import ClusterConfig
from hetpipe.core.config.serialize import config_toml
from hetpipe.core.errors import HetpipeError, UsageError
from hetpipe.core.runs.testbed import (
    LO_MTU,
    NS_IFNAME,
    PREFIX_LEN,
    LinkScale,
    NodeNet,
    Topology,
    effective_config,
    is_stale,
    rate_gbps,
    run_of,
    tbf_for,
)

__all__ = [
    "STATE_DIR",
    "clean_stale",
    "derive_link_scale",
    "egress_bytes",
    "enter_netns",
    "in_netns",
    "ingress_bytes",
    "netns_argv",
    "probe_egress",
    "probe_inside",
    "remove",
    "run_command",
    "state_dir",
    "testbed",
    "unavailable_reason",
    "up",
]

STATE_DIR = Path("/run/hetpipe-testbed")
NETNS_DIR = Path("/run/netns")  # where `ip netns add` puts its namespaces
SYS_NET = Path("/sys/class/net")
_CLONE_NEWNET = 0x40000000
_PROBE_CHUNK = 1 << 16


# ---------------------------------------------------------------------------------------------- namespaces


def _setns(fd: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.setns(fd, _CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"setns(CLONE_NEWNET): {os.strerror(err)}")


def enter_netns(name: str) -> None:
    """Move the calling thread into network namespace `name`, for good: the sockets and threads it makes from
    now on live there. A child process that must run in a node's namespace calls it first thing, before any
    socket or thread exists (setns(2) on the thread; the child's other threads, if any, stay where they
    were)."""
    fd = os.open(NETNS_DIR / name, os.O_RDONLY)
    try:
        _setns(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def in_netns(name: str) -> Iterator[None]:
    """Within the block, sockets this thread makes belong to namespace `name` (and keep belonging there
    after)."""
    own = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    try:
        enter_netns(name)
        try:
            yield
        finally:
            _setns(own)
    finally:
        os.close(own)


def netns_argv(topology: Topology, node: str, argv: Sequence[str]) -> list[str]:
    """A command line that runs `argv` in `node`'s namespace, gloo bound to the node's veth (not to loopback,
    which it would take when the host name does not resolve to an address of the namespace)."""
    return ["ip", "netns", "exec", topology.node(node).netns, "env", f"GLOO_SOCKET_IFNAME={NS_IFNAME}", *argv]


# ---------------------------------------------------------------------------------------------- support


def _cmd(argv: Sequence[str], *, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(list(argv), capture_output=True, text=True, timeout=30)
    if check and done.returncode != 0:
        raise HetpipeError(
            f"testbed: `{' '.join(argv)}` failed (exit {done.returncode}): "
            f"{done.stderr.strip() or done.stdout.strip()}"
        )
    return done


@functools.cache
def unavailable_reason() -> str | None:
    """Why the testbed cannot run on this machine (None: it can): not root, no `ip`/`tc`, or namespaces, veth
    pairs, bridges or tbf missing - found by building and removing a throwaway namespace with a shaped
    veth."""
    if os.geteuid() != 0:
        return "the testbed needs root (it creates network namespaces, veth pairs and tc qdiscs); run as root"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed (package iproute2)"
    run = f"c{os.getpid() % 36**6:x}"[:8]
    ns, veth, bridge = f"hp-{run}-check", f"hp-{run}-0", f"hp-{run}-br"
    steps = [
        ["ip", "netns", "add", ns],
        ["ip", "link", "add", bridge, "type", "bridge"],
        ["ip", "link", "add", veth, "type", "veth", "peer", "name", NS_IFNAME, "netns", ns],
        ["ip", "link", "set", veth, "master", bridge],
        ["tc", "-n", ns, "qdisc", "add", "dev", NS_IFNAME, "root", *tbf_for(0.001).tc_args()],
    ]
    try:
        for step in steps:
            done = _cmd(step, check=False)
            if done.returncode != 0:
                return f"`{' '.join(step)}` failed here: {done.stderr.strip() or done.returncode}"
    finally:
        _cmd(["ip", "netns", "del", ns], check=False)
        _cmd(["ip", "link", "del", bridge], check=False)
        _cmd(["ip", "link", "del", veth], check=False)
    return None


def _require_support() -> None:
    reason = unavailable_reason()
    if reason is not None:
        raise UsageError(f"cannot build the network testbed: {reason}")


# ---------------------------------------------------------------------------------------------- state


def state_dir(run: str) -> Path:
    return STATE_DIR / run


def _start_time(pid: int) -> float | None:
    """A process's start time (clock ticks since boot), None when it does not exist: pid plus start time names
    a process even after its pid is reused."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return float(stat.rsplit(")", 1)[1].split()[19])


def _alive(pid: int, start: float) -> bool:
    return _start_time(pid) == start


def _read_state(run: str) -> dict | None:
    try:
        return json.loads((state_dir(run) / "state.json").read_text())
    except (OSError, ValueError):
        return None


def _write_state(topology: Topology, owner: bool) -> None:
    folder = state_dir(topology.run)
    folder.mkdir(parents=True, exist_ok=True)
    pid = os.getpid()
    state = {
        "owner": {"pid": pid, "start": _start_time(pid)} if owner else None,
        "topology": topology.to_dict(),
    }
    tmp = folder / "state.json.tmp"
    tmp.write_text(json.dumps(state, indent=1))
    tmp.replace(folder / "state.json")


def _found_runs() -> set[str]:
    names = [*_listdir(NETNS_DIR), *_listdir(SYS_NET)]
    runs = {run for run in map(run_of, names) if run is not None}
    return runs | set(_listdir(STATE_DIR))


def _listdir(path: Path) -> list[str]:
    try:
        return os.listdir(path)
    except OSError:
        return []


# ---------------------------------------------------------------------------------------------- up, down


@contextlib.contextmanager
def _signals_held() -> Iterator[None]:
    """Hold SIGINT/SIGTERM/SIGHUP while the block runs (a teardown must not be cut half way), then deliver
    them."""
    held = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP}
    old = signal.pthread_sigmask(signal.SIG_BLOCK, held)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def remove(run: str | None = None) -> list[str]:
    """Delete the namespaces, links and state of testbed run `run`, or of every run when None; idempotent.
    Returns what it deleted."""
    gone = []
    with _signals_held():
        for name in sorted(_listdir(NETNS_DIR)):
            owner = run_of(name)
            if owner is not None and (run is None or owner == run):
                _cmd(["ip", "netns", "del", name], check=False)
                gone.append(name)
        for name in sorted(_listdir(SYS_NET)):  # bridges; veths usually went with their namespace
            owner = run_of(name)
            if owner is not None and (run is None or owner == run):
                _cmd(["ip", "link", "del", name], check=False)
                gone.append(name)
        for folder in _listdir(STATE_DIR):
            if run is None or folder == run:
                shutil.rmtree(STATE_DIR / folder, ignore_errors=True)
    return gone


def clean_stale() -> list[str]:
    """Remove the leftovers of runs whose owner process is gone (killed before it could tear down)."""
    gone = []
    for run in sorted(_found_runs()):
        if is_stale(_read_state(run), _alive):
            gone += remove(run)
    return gone


def _create_node(topology: Topology, net: NodeNet) -> None:
    ns = net.netns
    for step in (
        ["ip", "netns", "add", ns],
        ["ip", "-n", ns, "link", "set", "lo", "mtu", str(LO_MTU)],
        ["ip", "-n", ns, "link", "set", "lo", "up"],
        ["tc", "-n", ns, "qdisc", "replace", "dev", "lo", "root", *net.inside_tbf.tc_args()],  # inside
        ["ip", "link", "add", net.host_veth, "type", "veth", "peer", "name", NS_IFNAME, "netns", ns],
        ["ip", "link", "set", net.host_veth, "master", topology.bridge],
        ["ip", "link", "set", net.host_veth, "up"],
        ["ip", "-n", ns, "addr", "add", f"{net.address}/{PREFIX_LEN}", "dev", NS_IFNAME],
        ["ip", "-n", ns, "link", "set", NS_IFNAME, "up"],
        ["tc", "-n", ns, "qdisc", "replace", "dev", NS_IFNAME, "root", *net.tbf.tc_args()],  # egress
        ["tc", "qdisc", "replace", "dev", net.host_veth, "root", *net.tbf.tc_args()],
    ):  # ingress
        _cmd(step)


def up(topology: Topology, config: ClusterConfig | None = None, *, owner: bool = True) -> Path:
    """Build the testbed (removing stale leftovers and any earlier copy of this run first); returns its state
    folder, which holds cluster.toml, the effective config of `config`, when given. With owner, the testbed
    counts as a leftover once this process is gone; without (`hetpipe testbed up`), it stays until removed."""
    _require_support()
    clean_stale()
    remove(topology.run)
    _write_state(topology, owner)
    try:
        with _signals_held():
            _cmd(["ip", "link", "add", topology.bridge, "type", "bridge"])
            _cmd(["ip", "link", "set", topology.bridge, "up"])
            for net in topology.nodes:
                _create_node(topology, net)
        if config is not None:
            (state_dir(topology.run) / "cluster.toml").write_text(
                config_toml(effective_config(config, topology))
            )
    except BaseException:
        remove(topology.run)
        raise
    return state_dir(topology.run)


_deferred_stops: list[int] | None = None  # inside _stops_deferred: the stop signals caught, not yet raised


@contextlib.contextmanager
def _stops_deferred() -> Iterator[None]:
    """A SIGTERM or SIGHUP caught in the block stops the run when the block ends, not inside it: a stop
    raised inside subprocess.Popen, after its child started and before the caller holds it, would leave the
    child running with nobody to end it."""
    global _deferred_stops
    _deferred_stops = []
    try:
        yield
    finally:
        caught, _deferred_stops = _deferred_stops, None
        if caught:
            raise SystemExit(128 + caught[0])


@contextlib.contextmanager
def _teardown_on_signals() -> Iterator[None]:
    """SIGTERM and SIGHUP raise SystemExit in the main thread, as Ctrl-C raises KeyboardInterrupt, so the
    `finally` that tears the testbed down runs whichever way the process is asked to stop."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum: int, _frame: object) -> None:
        if _deferred_stops is not None:
            _deferred_stops.append(signum)
            return
        raise SystemExit(128 + signum)

    old = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)


@contextlib.contextmanager
def testbed(topology: Topology, config: ClusterConfig | None = None) -> Iterator[Path]:
    """The testbed up for the block, torn down after it however it ends (error, Ctrl-C, SIGTERM, SIGHUP);
    yields its state folder. A SIGKILLed owner leaves it behind for the next `up` to remove."""
    with _teardown_on_signals():
        try:
            yield up(topology, config)
        finally:
            remove(topology.run)


# ---------------------------------------------------------------------------------------------- measuring


def ingress_bytes(topology: Topology) -> dict[str, int]:
    """Bytes each node has received so far, link-level: its veth's bridge end's tx_bytes."""
    return {
        net.node: int((SYS_NET / net.host_veth / "statistics" / "tx_bytes").read_text())
        for net in topology.nodes
    }


def egress_bytes(topology: Topology) -> dict[str, int]:
    """Bytes each node has sent so far, link-level (what its tbf shaped): its veth's bridge end's rx_bytes."""
    return {
        net.node: int((SYS_NET / net.host_veth / "statistics" / "rx_bytes").read_text())
        for net in topology.nodes
    }


def probe_egress(topology: Topology, seconds: float = 1.5, warmup_s: float = 0.3) -> dict[str, float | None]:
    """Each node's egress in Gbit/s, measured one node at a time: a TCP sender in its namespace streams to the
    next node's for `seconds`, and the link-level bytes its veth carried after `warmup_s` (TCP's slow start
    and the bucket's initial burst) over the time since give the rate. Bounded: each probe stops after
    `seconds` or twice the bytes its configured rate allows (at least 1 MiB). None for a testbed of one
    node."""
    if len(topology.nodes) < 2:
        return {net.node: None for net in topology.nodes}
    nodes = topology.nodes
    return {
        net.node: _probe_one(net, nodes[(i + 1) % len(nodes)], seconds, warmup_s, _counter, net.tbf.rate_bit)
        for i, net in enumerate(nodes)
    }


def probe_inside(topology: Topology, seconds: float = 1.5, warmup_s: float = 0.3) -> dict[str, float]:
    """Each node's inside rate in Gbit/s (its loopback: traffic between its own GPUs), as probe_egress
    measures egress: a TCP stream from the node to itself, the loopback's bytes after `warmup_s`, bounded
    alike."""
    return {
        net.node: _probe_one(net, net, seconds, warmup_s, _loopback_counter, net.inside_tbf.rate_bit)
        for net in topology.nodes
    }


def _counter(net: NodeNet) -> int:
    return int((SYS_NET / net.host_veth / "statistics" / "rx_bytes").read_text())


def _loopback_counter(net: NodeNet) -> int:
    """Bytes the node's loopback has carried: read from /proc/thread-self/net/dev inside its namespace."""
    with in_netns(net.netns):
        lines = Path("/proc/thread-self/net/dev").read_text().splitlines()
    for line in lines:
        name, _, fields = line.partition(":")
        if name.strip() == "lo":
            return int(fields.split()[8])  # transmit bytes
    raise HetpipeError(f"testbed: no loopback in namespace {net.netns}")


def _probe_one(
    src: NodeNet,
    dst: NodeNet,
    seconds: float,
    warmup_s: float,
    counter: Callable[[NodeNet], int],
    rate_bit: int,
) -> float:
    with in_netns(dst.netns):
        server = socket.create_server((dst.address, 0))
    server.settimeout(seconds + 10)
    port = server.getsockname()[1]
    receiver = threading.Thread(target=_drain, args=(server, time.monotonic() + seconds + 10), daemon=True)
    receiver.start()
    try:
        with in_netns(src.netns):
            client = socket.create_connection((dst.address, port), timeout=10)
    except OSError as exc:
        server.close()
        raise HetpipeError(
            f"testbed: {src.node} ({src.address}) cannot reach {dst.node} ({dst.address}) across "
            f"the bridge ({exc}); if br_netfilter is loaded (/proc/sys/net/bridge/bridge-nf-call-"
            "iptables is 1) and the firewall drops forwarded traffic (e.g. Docker's FORWARD policy), "
            "allow traffic on the hp-* bridges"
        ) from None
    limit = max(1 << 20, int(2 * rate_bit / 8 * seconds))
    payload, sent, mark = bytes(_PROBE_CHUNK), 0, None
    client.settimeout(0.2)
    start = time.monotonic()
    try:
        while (now := time.monotonic()) - start < seconds and sent < limit:
            if mark is None and now - start >= warmup_s:
                mark = (now, counter(src))
            with contextlib.suppress(TimeoutError):
                sent += client.send(payload)
        end, after = time.monotonic(), counter(src)
    finally:
        client.close()
        receiver.join(timeout=10)
        server.close()
    if mark is None or end <= mark[0]:
        raise HetpipeError(
            f"testbed probe of {src.node}: sent {sent} bytes before the {warmup_s} s warm-up ended; "
            "give it more time"
        )
    return rate_gbps(mark[1], after, end - mark[0])


def _drain(server: socket.socket, deadline: float) -> None:
    try:
        conn, _ = server.accept()
    except OSError:
        return
    with conn:
        conn.settimeout(1.0)
        while time.monotonic() < deadline:
            try:
                if not conn.recv(1 << 20):
                    return
            except TimeoutError:
                continue
            except OSError:
                return


# ---------------------------------------------------------------------------------------------- scale


def derive_link_scale(
    config: ClusterConfig, cache_dir: Path, efficiency: float = 1.0, refresh: bool = False
) -> LinkScale:
    """The link scale of hetpipe.core.runs.testbed.LinkScale for `config`'s model at its batch: the CPU
    profile (measured on one thread and cached in cache_dir; refresh: measured again now), the step's FLOPs,
    the fastest GPU type's speed read as FP32 TFLOPS (as launch/clusters/bench*.toml give them) and the
    fastest emulated GPU's slowdown."""
    import torch

    from hetpipe.compute.build import model_of
    from hetpipe.compute.flops import training_flops
    from hetpipe.compute.profiler import cached_profile
    from hetpipe.core.hardware.emulate import cpu_cores, gpu_speeds, slowdowns

    torch.set_num_threads(1)
    spec, batch = model_of(config), config.train.batch_size
    profile = cached_profile(spec, batch, "cpu", cache_dir, optimizer=config.train.optimizer, refresh=refresh)
    speeds = gpu_speeds(config)
    time_scale = (
        min(slowdowns(speeds, cpu_cores(), config.emulation.time_scale).values())
        if config.emulation.enabled
        else 1.0
    )
    return LinkScale(
        cpu_step_s=profile.step_s,
        time_scale=time_scale,
        step_flops=float(training_flops(spec, batch)),
        gpu_tflops=max(speeds.values()),
        efficiency=efficiency,
    )


# ---------------------------------------------------------------------------------------------- running


def run_command(topology: Topology, config: ClusterConfig, argv: Sequence[str]) -> tuple[int, dict[str, int]]:
    """Bring the testbed up, run `argv` in the root namespace with HETPIPE_TESTBED (the state folder) and
    HETPIPE_TESTBED_CONFIG (the effective config) set, tear it down; (exit code, bytes each node sent)."""
    with testbed(topology, config) as folder:
        env = {
            **os.environ,
            "HETPIPE_TESTBED": str(folder),
            "HETPIPE_TESTBED_CONFIG": str(folder / "cluster.toml"),
        }
        before = egress_bytes(topology)
        proc: subprocess.Popen | None = None
        try:
            with _stops_deferred():
                try:
                    proc = subprocess.Popen(list(argv), env=env)
                except OSError as exc:
                    raise UsageError(f"cannot run {argv[0]!r}: {exc.strerror or exc}") from None
            code = proc.wait()
        finally:
            if proc is not None and proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        after = egress_bytes(topology)
    return code, {node: after[node] - before[node] for node in after}
