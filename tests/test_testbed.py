"""The shaped-network testbed for real: namespaces, shaped veths, `hetpipe server` + `hetpipe worker`s on
their nodes' addresses, the bench peers across namespaces, and teardown whichever way a run ends. Needs root,
`ip netns` and `tc`; skipped (naming what is missing) elsewhere."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hetpipe.app import testbed as tb
from hetpipe.core.config.files import load_config
from hetpipe.core.config.overrides import apply_overrides
from hetpipe.core.runs.testbed import plan_topology, within

from conftest import as_from_a_terminal

REASON = tb.unavailable_reason()
needs_testbed = pytest.mark.skipif(REASON is not None, reason=f"no network testbed here: {REASON}")

TWO_NODES = """name = "tb2"
seed = 3
[gpu_types.g]
speed = 1.0
memory_gib = 4.0
[[nodes]]
name = "n0"
gpus = ["g", "g"]
[[nodes]]
name = "n1"
gpus = ["g", "g"]
[network]
inter_node_gbps = 1.0
[ps]
port = 7700
[wsp]
staleness = 0
nm = 2
[checkpoint]
dir = ""
[model]
name = "mlp"
options = { image_size = 8, hidden = [24, 16] }
[data]
name = "synthetic"
options = { input_shape = [1, 8, 8], num_classes = 10, n = 512 }
[train]
batch_size = 16
waves = 3
optimizer = "momentum"
lr = 0.05
out_dir = "OUT"
[emulation]
enabled = false
[[virtual_workers]]
gpus = ["n0:0", "n1:0"]
[[virtual_workers]]
gpus = ["n1:1"]
"""
# the MLP's parameters: 64 -> 24 -> 16 -> 10, weights and biases, float32
PARAM_BYTES = 4 * ((64 * 24 + 24) + (24 * 16 + 16) + (16 * 10 + 10))


def two_nodes(tmp_path: Path) -> Path:
    path = tmp_path / "tb2.toml"
    path.write_text(TWO_NODES.replace("OUT", str(tmp_path / "runs")))
    return path


def run_id(tag: str) -> str:
    return f"{tag}{os.getpid() % 36**6:x}"[:8]


def leftovers(run: str) -> list[str]:
    """Every namespace, link and state folder of testbed run `run` still on the machine."""
    names = [*os.listdir("/run/netns")] if Path("/run/netns").exists() else []
    names += os.listdir("/sys/class/net")
    found = [n for n in names if n.startswith(f"hp-{run}-")]
    return found + ([str(tb.state_dir(run))] if tb.state_dir(run).exists() else [])


def hetpipe(*args: str, **kwargs) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "hetpipe", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=as_from_a_terminal,
        **kwargs,
    )


@pytest.fixture
def reaper():
    """Processes a test starts outside hetpipe's own launchers; any still alive at teardown is killed by
    PID."""
    started: list[subprocess.Popen] = []
    yield started
    for proc in started:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def test_without_root_or_ip_netns_the_cli_says_why(tmp_path: Path, monkeypatch, capsys) -> None:
    from hetpipe.cli import main

    monkeypatch.setattr(tb, "unavailable_reason", lambda: "the testbed needs root (...); run as root")
    with pytest.raises(SystemExit) as exit_info:
        main(["testbed", "up", str(two_nodes(tmp_path)), "--scale", "0.01", "--run", "nope"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "cannot build the network testbed: the testbed needs root" in err and "Traceback" not in err


@pytest.mark.slow
@needs_testbed
@pytest.mark.timeout(300)
def test_local_placement_runs_a_shard_in_every_nodes_namespace(tmp_path: Path, reaper) -> None:
    """ED-local in the testbed: `hetpipe server --shard I` in node I's namespace on its address, two VWs each
    spanning both nodes; 3 waves on both shards."""
    text = TWO_NODES.replace("[ps]\n", '[ps]\nshards = 2\nplacement = "local"\n').replace(
        'gpus = ["n1:1"]', 'gpus = ["n0:1", "n1:1"]'
    )
    path = tmp_path / "tb2.toml"
    path.write_text(text.replace("OUT", str(tmp_path / "runs")))
    run, run_dir = run_id("l"), tmp_path / "run"
    proc = hetpipe(
        "testbed",
        "train",
        str(path),
        "--scale",
        "0.01",
        "--run",
        run,
        "--run-dir",
        str(run_dir),
        "--no-probe",
    )
    reaper.append(proc)
    out, err = proc.communicate(timeout=280)
    assert proc.returncode == 0, err + out
    assert load_config(run_dir / "cluster.toml").ps_endpoints() == [
        "tcp://10.77.0.2:7700",
        "tcp://10.77.0.3:7701",
    ]
    assert "n0 (10.77.0.2): -m hetpipe server" in out and "n1 (10.77.0.3): -m hetpipe server" in out
    for shard in (0, 1):
        assert "clock 3  c_local [3, 3]" in (run_dir / "logs" / f"server-{shard}.log").read_text()
    assert leftovers(run) == []


@pytest.mark.slow
@needs_testbed
@pytest.mark.timeout(300)
def test_server_and_workers_train_three_waves_on_distinct_addresses(tmp_path: Path, reaper) -> None:
    """The acceptance test of the several-machines flow: a 2-node testbed, `hetpipe server` in n0's namespace,
    VW 0 spanning both nodes (`hetpipe worker --vw 0 --stage J` in each), VW 1 on n1; 3 waves; torn down."""
    run, run_dir = run_id("a"), tmp_path / "run"
    proc = hetpipe(
        "testbed",
        "train",
        str(two_nodes(tmp_path)),
        "--scale",
        "0.01",
        "--run",
        run,
        "--run-dir",
        str(run_dir),
        "--no-probe",
    )
    reaper.append(proc)
    out, err = proc.communicate(timeout=280)
    assert proc.returncode == 0, err + out
    effective = load_config(run_dir / "cluster.toml")
    assert [n.host for n in effective.nodes] == ["10.77.0.2", "10.77.0.3"]
    assert effective.ps_endpoints() == ["tcp://10.77.0.2:7700"]
    assert not effective.emulation.link_bandwidth
    logs = run_dir / "logs"
    assert "clock 3  c_local [3, 3]" in (logs / "server.log").read_text()
    for name, stage in (("worker-vw0-s0", "vw0-s0"), ("worker-vw0-s1", "vw0-s1"), ("worker-vw1", "vw1-s0")):
        assert f"{stage} finished 3 waves" in (logs / f"{name}.log").read_text()
    assert "n0 (10.77.0.2): -m hetpipe worker" in out and "n1 (10.77.0.3): -m hetpipe worker" in out
    sent = {node: int(b) for node, b in re.findall(r"(n\d) (\d+)", out.split("bytes sent per node:")[1])}
    # n0 sends the PS's replies (VW 1's weights at registration) and VW 0's activations; n1 pushes VW 1's
    # updates every wave: both far more than the model once
    assert sent["n0"] > PARAM_BYTES and sent["n1"] > PARAM_BYTES
    assert leftovers(run) == []


@pytest.mark.slow
@needs_testbed
def test_every_node_egress_is_shaped_to_its_rate(tmp_path: Path) -> None:
    config = load_config(two_nodes(tmp_path))
    topology = plan_topology(config, run_id("p"), 0.002)  # 1 Gbit/s x 0.002: 2 Mbit/s
    with tb.testbed(topology, config) as folder:
        assert (folder / "cluster.toml").exists()
        measured = tb.probe_egress(topology, seconds=1.5)
    assert set(measured) == {"n0", "n1"}
    for node, gbps in measured.items():
        assert within(gbps, 0.002, 0.15), f"{node}: {gbps * 1e3:.3f} Mbit/s, configured 2"
    assert leftovers(topology.run) == []


@pytest.mark.slow
@needs_testbed
def test_traffic_inside_a_node_is_shaped_to_its_gpus_links(tmp_path: Path) -> None:
    """A node's loopback (what its own GPUs send each other) runs at its GPUs x intra_node_gbps x scale."""
    config = apply_overrides(load_config(two_nodes(tmp_path)), ["network.intra_node_gbps=2"])
    topology = plan_topology(config, run_id("l"), 0.001)  # 2 Gbit/s x 0.001 = 2 Mbit/s a GPU
    with tb.testbed(topology, config):
        inside = tb.probe_inside(topology, seconds=1.5)
    for node, net in zip(config.nodes, topology.nodes, strict=True):  # plan_topology keeps the config's order
        want = len(node.gpus) * 0.002
        assert net.inside_gbps == pytest.approx(want)
        assert within(inside[net.node], want, 0.15), (
            f"{net.node}: {inside[net.node] * 1e3:.3f} Mbit/s, configured {want * 1e3:g}"
        )
    assert leftovers(topology.run) == []


@pytest.mark.slow
@needs_testbed
def test_a_node_receiving_from_two_nodes_gets_its_rate_not_twice(tmp_path: Path) -> None:
    """Ingress is shaped too: n1 and n2 both stream to n0; n0 takes in its link's rate, not the sum of
    theirs."""
    import socket
    import threading

    config = load_config(Path(__file__).resolve().parents[1] / "launch" / "clusters" / "bench.toml")
    topology = plan_topology(config, run_id("i"), 0.0002)  # 10 Gbit/s x 0.0002: 2 Mbit/s
    n0, n1, n2 = topology.nodes
    with tb.testbed(topology):
        with tb.in_netns(n0.netns):
            server = socket.create_server((n0.address, 0), backlog=2)
        drains = []

        def drain(conn: socket.socket) -> None:
            with conn:
                while conn.recv(1 << 16):
                    pass

        def accept() -> None:
            for _ in range(2):
                conn, _ = server.accept()
                drains.append(threading.Thread(target=drain, args=(conn,), daemon=True))
                drains[-1].start()

        acceptor = threading.Thread(target=accept, daemon=True)
        acceptor.start()
        senders = []
        for net in (n1, n2):
            with tb.in_netns(net.netns):
                senders.append(socket.create_connection((n0.address, server.getsockname()[1]), timeout=10))

        def send(sock: socket.socket, until: float) -> None:
            sock.settimeout(0.2)
            while time.monotonic() < until:
                with contextlib.suppress(TimeoutError):
                    sock.send(bytes(1 << 16))
            sock.close()

        until = time.monotonic() + 3.0
        threads = [threading.Thread(target=send, args=(s, until)) for s in senders]
        for t in threads:
            t.start()
        time.sleep(1.0)  # past slow start and the buckets' bursts
        before, start = tb.ingress_bytes(topology)["n0"], time.monotonic()
        time.sleep(1.5)
        received = (tb.ingress_bytes(topology)["n0"] - before) * 8 / (time.monotonic() - start) / 1e9
        for t in [*threads, acceptor, *drains]:
            t.join(10)
        server.close()
    assert within(received, 0.002, 0.15), f"n0 received {received * 1e3:.3f} Mbit/s from two senders, link 2"
    assert leftovers(topology.run) == []


def _start_run(tmp_path: Path, run: str, reaper: list) -> tuple[subprocess.Popen, int]:
    """`hetpipe testbed run ... -- sleep 120`, once its namespaces exist; (it, the sleep's pid)."""
    proc = hetpipe(
        "testbed", "run", str(two_nodes(tmp_path)), "--scale", "0.01", "--run", run, "--", "sleep", "120"
    )
    reaper.append(proc)
    deadline = time.monotonic() + 60
    while True:  # the set-up's own short-lived children (ip, tc) come and go before the sleep starts
        sleeper = next((pid for pid in _children(proc.pid) if _cmdline(pid)[-2:] == ["sleep", "120"]), None)
        if sleeper is not None and len(leftovers(run)) >= 3:
            return proc, sleeper
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.1)


def _children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def _cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")[:-1]
    except OSError:
        return []


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return Path(f"/proc/{pid}/stat").read_text().split(")")[1].split()[0] == "Z"


@pytest.mark.slow
@needs_testbed
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP])
def test_a_stopped_run_tears_the_testbed_down(sig: signal.Signals, tmp_path: Path, reaper) -> None:
    run = run_id("s")
    proc, sleeper = _start_run(tmp_path, run, reaper)
    proc.send_signal(sig)
    proc.communicate(timeout=30)
    assert proc.returncode != 0
    assert leftovers(run) == []
    deadline = time.monotonic() + 10
    while not _gone(sleeper) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _gone(sleeper), "the command the testbed ran outlived it"


@needs_testbed
def test_a_stop_while_the_command_starts_still_ends_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A SIGTERM that lands inside subprocess.Popen once the child runs, before run_command holds it (the CLI
    test above hit this under load: its `sleep 120` outlived the run and held its pipes), stops the run when
    Popen returns: the child is ended and the testbed torn down."""
    started: list[subprocess.Popen] = []
    real = subprocess.Popen

    def popen_then_stop(argv, *args, **kwargs):
        child = real(argv, *args, **kwargs)
        if list(argv) == ["sleep", "120"]:
            started.append(child)
            os.kill(os.getpid(), signal.SIGTERM)  # its handler runs before this returns
        return child

    monkeypatch.setattr(subprocess, "Popen", popen_then_stop)
    config = load_config(two_nodes(tmp_path))
    topology = plan_topology(config, run_id("p"), 0.01)
    with pytest.raises(SystemExit) as stopped:
        tb.run_command(topology, config, ["sleep", "120"])
    assert stopped.value.code == 128 + signal.SIGTERM
    (child,) = started
    try:
        assert child.poll() is not None, "the command outlived the run"
    finally:
        child.kill()
        child.wait()
    assert leftovers(topology.run) == []


@pytest.mark.slow
@needs_testbed
def test_the_next_up_removes_what_a_killed_run_left(tmp_path: Path, reaper) -> None:
    run = run_id("k")
    proc, sleeper = _start_run(tmp_path, run, reaper)
    proc.kill()  # SIGKILL: no teardown
    proc.wait(10)
    os.kill(sleeper, signal.SIGKILL)
    assert len(leftovers(run)) >= 3 and json.loads((tb.state_dir(run) / "state.json").read_text())["owner"]
    config = load_config(two_nodes(tmp_path))
    other = plan_topology(config, run_id("n"), 0.01)
    try:
        tb.up(other, config)
        assert leftovers(run) == []
        assert len(leftovers(other.run)) >= 3  # the live testbed is left alone
    finally:
        tb.remove(other.run)
    assert leftovers(other.run) == []


@pytest.mark.slow
@needs_testbed
@pytest.mark.timeout(300)
def test_ddp_and_the_pipeline_cross_the_shaped_links(tmp_path: Path) -> None:
    """The bench peers in the testbed: each rank in its GPU's node's namespace, their traffic on the veths."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "launch" / "bench"))
    import peers

    config = load_config(two_nodes(tmp_path))
    devs = [d for d in peers.devices(config) if d.gpu in ("n0:0", "n1:0")]
    topology = plan_topology(config, run_id("d"), 0.1)  # 100 Mbit/s
    steps = 4
    with tb.testbed(topology, config):
        before = tb.egress_bytes(topology)
        ddp = peers.run_ddp(config, devs, 16, steps, tmp_path / "ddp", testbed=topology, timeout_s=240)
        after_ddp = tb.egress_bytes(topology)
        layout = peers.pipeline_layout(devs, peers.model_profile(config, 8, tmp_path / "profiles"))
        pipe = peers.run_pipeline(
            config, layout, 8, 2, steps, tmp_path / "pipe", testbed=topology, timeout_s=240
        )
        after_pipe = tb.egress_bytes(topology)
    assert len(ddp.ends) == steps and len(pipe.ends) == steps
    for node in ("n0", "n1"):
        # a 2-rank all-reduce sends each rank's half of the gradients and receives the other: P/2 each way a
        # step
        assert after_ddp[node] - before[node] > steps * PARAM_BYTES / 2
        assert after_pipe[node] - after_ddp[node] > 0  # activations one way, gradients the other
    assert leftovers(topology.run) == []


@pytest.mark.slow
@needs_testbed
@pytest.mark.timeout(600)
def test_a_node_relay_halves_what_its_two_vws_send_over_the_nodes_link(tmp_path: Path, reaper) -> None:
    """VW 0 on n0 (the PS's node), VWs 1 and 2 on n1; 10 waves. With node_aggregation on, `hetpipe relay`
    runs in n1's namespace and n1 sends one push a wave instead of two (docs/wsp.md#node-local-aggregation);
    both runs train every wave."""
    text = (
        TWO_NODES.replace('gpus = ["n0:0", "n1:0"]', 'gpus = ["n0:0"]')
        .replace('gpus = ["n1:1"]', 'gpus = ["n1:0"]\n[[virtual_workers]]\ngpus = ["n1:1"]')
        .replace("waves = 3", "waves = 10")
    )
    sent = {}
    for on in (False, True):
        path = tmp_path / f"tb-{on}.toml"
        path.write_text(
            text.replace("OUT", str(tmp_path / "runs")).replace(
                "[ps]\n", f"[ps]\nnode_aggregation = {str(on).lower()}\n"
            )
        )
        run, run_dir = run_id("r" if on else "s"), tmp_path / f"run-{on}"
        proc = hetpipe(
            "testbed",
            "train",
            str(path),
            "--scale",
            "0.01",
            "--run",
            run,
            "--run-dir",
            str(run_dir),
            "--no-probe",
        )
        reaper.append(proc)
        out, err = proc.communicate(timeout=280)
        assert proc.returncode == 0, err + out
        logs = run_dir / "logs"
        assert "clock 10  c_local [10, 10, 10]" in (logs / "server.log").read_text()
        assert ("n1 (10.77.0.3): -m hetpipe relay" in out) == on
        sent[on] = {
            node: int(b) for node, b in re.findall(r"(n\d) (\d+)", out.split("bytes sent per node:")[1])
        }
        assert leftovers(run) == []
    # n1 pushes 10 waves of the MLP: two VWs' worth without the relay, one with it (the rest: handshakes,
    # heartbeats, registration)
    assert sent[False]["n1"] > 2 * 10 * PARAM_BYTES
    assert sent[True]["n1"] < 0.6 * sent[False]["n1"]
