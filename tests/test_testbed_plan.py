"""hetpipe.core.runs.testbed: the testbed's names, addresses, tbf parameters, overrides and link scale, as
data."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from hetpipe.core.config.files import load_config
from hetpipe.core.config.overrides import apply_overrides
from hetpipe.core.errors import UsageError
from hetpipe.core.runs.testbed import (
    LinkScale,
    Tbf,
    Topology,
    WorkerPlace,
    describe_drift,
    effective_config,
    format_nodes,
    is_stale,
    layout_overrides,
    node_address,
    plan_topology,
    rate_gbps,
    run_of,
    tbf_for,
    within,
    worker_places,
)

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "launch" / "clusters" / "bench.toml"


def test_plan_of_the_bench_cluster() -> None:
    config = load_config(BENCH)  # 3 nodes n0 n1 n2 on 127.0.0.1, ps.host 127.0.0.1, 10 Gbit/s between nodes
    topology = plan_topology(config, "ab12", 0.0004)
    assert topology.bridge == "hp-ab12-br"
    assert [(n.node, n.netns, n.host_veth, n.address) for n in topology.nodes] == [
        ("n0", "hp-ab12-n0", "hp-ab12-0", "10.77.0.2"),
        ("n1", "hp-ab12-n1", "hp-ab12-1", "10.77.0.3"),
        ("n2", "hp-ab12-n2", "hp-ab12-2", "10.77.0.4"),
    ]
    assert topology.ps_node == "n0"  # the first node whose host is ps.host
    assert topology.shaped_gbps == pytest.approx(0.004)
    assert all(n.tbf == tbf_for(0.004) for n in topology.nodes)
    assert topology.overrides() == (
        "nodes.0.host=10.77.0.2",
        "nodes.1.host=10.77.0.3",
        "nodes.2.host=10.77.0.4",
        "ps.host=10.77.0.2",
        "emulation.link_bandwidth=false",
    )
    # inside a node: its two GPUs' 100 Gbit/s (intra_node_gbps' default) links x the scale, on its loopback
    assert topology.intra_node_gbps == 100.0 and topology.shaped_intra_gbps == pytest.approx(0.04)
    assert all(n.inside_tbf == tbf_for(0.08) for n in topology.nodes)
    assert topology.link_gbps("n0:0", "n0:1") == pytest.approx(0.04)
    assert topology.link_gbps("n0:0", "n2:1") == pytest.approx(0.004)
    assert Topology.from_dict(topology.to_dict()) == topology
    assert topology.of_gpu("n2:1").netns == "hp-ab12-n2"


def test_the_ps_network_routes_each_gpu_over_its_nodes_links() -> None:
    network = plan_topology(load_config(BENCH), "t", 0.001).ps_network()  # the PS on n0
    [(name, gbps)] = network.route("n0:1", push=True)
    assert name == "n0 loopback" and gbps == pytest.approx(0.2)  # 2 GPUs x 100 Gbit/s x 0.001
    # a push leaves its node and enters the PS's; a pull leaves the PS's node and enters the GPU's
    assert network.route("n1:0", push=True) == [("n1 egress", pytest.approx(0.01)), ("n0 ingress", 0.01)]
    assert network.route("n2:1", push=False) == [("n0 egress", pytest.approx(0.01)), ("n2 ingress", 0.01)]


def test_effective_config_puts_every_node_and_the_ps_on_its_address() -> None:
    config = apply_overrides(load_config(BENCH), ["emulation.link_bandwidth=true"])
    effective = effective_config(config, plan_topology(config, "x", 0.01))
    assert [n.host for n in effective.nodes] == ["10.77.0.2", "10.77.0.3", "10.77.0.4"]
    assert effective.ps_endpoints() == ["tcp://10.77.0.2:7600"]
    assert effective.emulation.link_bandwidth is False  # the shaped veths are the links, not sleeps


def test_ps_node_follows_ps_host_or_is_named() -> None:
    config = apply_overrides(
        load_config(BENCH), ["nodes.0.host=a", "nodes.1.host=b", "nodes.2.host=c", "ps.host=c"]
    )
    assert plan_topology(config, "x", 1.0).ps_node == "n2"
    assert plan_topology(config, "x", 1.0, ps_node="n1").ps_node == "n1"
    with pytest.raises(UsageError, match="--ps-node 'n9'.*nodes n0, n1, n2"):
        plan_topology(config, "x", 1.0, ps_node="n9")


@pytest.mark.parametrize("run", ["", "ABC", "a-b", "123456789"])
def test_bad_run_ids_are_refused(run: str) -> None:
    with pytest.raises(UsageError, match="run id"):
        plan_topology(load_config(BENCH), run, 1.0)


def test_interface_names_fit_linux_limit() -> None:
    topology = plan_topology(load_config(BENCH), "abcdefgh", 1.0)  # the longest run id
    assert max(len(n.host_veth) for n in topology.nodes) <= 15 and len(topology.bridge) <= 15


def test_addresses() -> None:
    assert [node_address(i) for i in (0, 1, 253, 254, 65532)] == [
        "10.77.0.2",
        "10.77.0.3",
        "10.77.0.255",
        "10.77.1.0",
        "10.77.255.254",
    ]
    with pytest.raises(UsageError):
        node_address(65533)


@pytest.mark.parametrize(
    ("gbps", "expected"),
    [
        # rate in bit/s; burst max(4096, 1 ms of rate); limit = burst + max(16384, 50 ms of rate), in bytes
        (0.004, Tbf(4_000_000, 4096, 4096 + 25_000)),
        (0.001, Tbf(1_000_000, 4096, 4096 + 16384)),
        (1.0, Tbf(1_000_000_000, 125_000, 125_000 + 6_250_000)),
        (10.0, Tbf(10_000_000_000, 1_250_000, 1_250_000 + 62_500_000)),
    ],
)
def test_tbf_parameters(gbps: float, expected: Tbf) -> None:
    assert tbf_for(gbps) == expected


def test_tbf_words_for_tc_and_too_slow_a_link() -> None:
    assert Tbf(4_000_000, 4096, 29096).tc_args() == (
        "tbf",
        "rate",
        "4000000bit",
        "burst",
        "4096",
        "limit",
        "29096",
    )
    with pytest.raises(UsageError, match="at least 8 kbit/s"):
        tbf_for(1e-6)


def test_link_scale_is_real_step_over_emulated_step() -> None:
    # 5.96 GFLOP at 14.9 TFLOPS: 0.4 ms on the real GPU; 0.1 s on one CPU thread x slowdown 10: 1 s emulated
    scale = LinkScale(cpu_step_s=0.1, time_scale=10.0, step_flops=5.96e9, gpu_tflops=14.9)
    assert scale.real_step_s == pytest.approx(4e-4)
    assert scale.emulated_step_s == pytest.approx(1.0)
    assert scale.scale == pytest.approx(4e-4)  # 10 Gbit/s -> 4 Mbit/s
    # a GPU at half its peak takes twice as long: the links may be twice as fast
    assert LinkScale(0.1, 10.0, 5.96e9, 14.9, efficiency=0.5).scale == pytest.approx(8e-4)
    assert "link scale 0.0004" in scale.describe()
    with pytest.raises(UsageError, match="time_scale"):
        LinkScale(0.1, 0.0, 1e9, 1.0)


def test_compute_communication_ratio_is_kept() -> None:
    """What the scale is for: bytes / emulated link over emulated step = bytes / real link over real step."""
    scale = LinkScale(cpu_step_s=0.05, time_scale=10.0, step_flops=3.2e9, gpu_tflops=14.9)
    nbytes, real_gbps = 8.8e6, 10.0
    emulated = nbytes * 8 / (real_gbps * scale.scale * 1e9) / scale.emulated_step_s
    real = nbytes * 8 / (real_gbps * 1e9) / scale.real_step_s
    assert emulated == pytest.approx(real)


def test_speed_drift_says_how_the_links_compare_with_the_end_of_the_run() -> None:
    # derived from a 52 ms CPU step; at the end the machine takes 39 ms: compute is 1.33x faster, so a scale
    # derived then is 1.33x larger and the run's links were 0.75x, slower than the end's speed calls for
    start = LinkScale(cpu_step_s=0.052, time_scale=10.0, step_flops=2.68e9, gpu_tflops=14.9)
    assert LinkScale.from_dict(start.to_dict()) == start  # as the benches read it back from their record
    drift = start.drift(0.039)
    assert drift["cpu_step_ratio"] == pytest.approx(0.75)
    assert drift["scale_at_end"] == pytest.approx(start.scale / 0.75)
    assert drift["links_over_end"] == pytest.approx(0.75)
    assert "52 ms at the start, 39 ms at the end (0.75x)" in describe_drift(drift)
    assert "were 0.75x, slower than" in describe_drift(drift)
    # a scale given instead of the derived one is what the links had
    given = start.drift(0.052, used_scale=2 * start.scale)
    assert given["links_over_end"] == pytest.approx(2.0)
    assert "faster than" in describe_drift(given)
    assert "as fast as" in describe_drift(start.drift(0.052))


def test_worker_places() -> None:
    vws = [["n0:0", "n1:0"], ["n1:1", "n1:2"], ["n2:0"]]
    assert worker_places(vws) == [
        WorkerPlace(0, 0, "n0"),
        WorkerPlace(0, 1, "n1"),
        WorkerPlace(1, None, "n1"),
        WorkerPlace(2, None, "n2"),
    ]
    assert WorkerPlace(0, 1, "n1").args() == ("--vw", "0", "--stage", "1")
    assert WorkerPlace(1, None, "n1").args() == ("--vw", "1")


def test_layout_overrides_list_the_virtual_workers() -> None:
    config = apply_overrides(load_config(BENCH), ["allocation.policy=np", "virtual_workers=[]"])
    config = apply_overrides(
        config, layout_overrides([(("n0:0", "n1:0", "n2:0"), (4, 3, 3), 0, 0), (("n0:1",), (10,), 6, 64)])
    )
    assert config.allocation.policy == "explicit"
    assert [
        ([str(g) for g in vw.gpus], vw.layers, vw.nm, vw.batch_size) for vw in config.virtual_workers
    ] == [
        (["n0:0", "n1:0", "n2:0"], (4, 3, 3), None, None),
        (["n0:1"], (10,), 6, 64),
    ]


def test_run_of_names() -> None:
    assert run_of("hp-ab12-n0") == "ab12"
    assert run_of("hp-ab12-br") == "ab12"
    assert run_of("hp-ab12-my-node") == "ab12"
    assert [run_of(n) for n in ("eth0", "hp-", "hp-ab12", "hp-AB-n0", "hpx-ab-n0")] == [None] * 5


def test_stale_runs() -> None:
    alive = {(10, 5.0)}.__contains__

    def check(pid: int, start: float) -> bool:
        return alive((pid, start))

    assert is_stale(None, check)  # namespaces without a record
    assert is_stale({"owner": {"pid": 10, "start": 6.0}}, check)  # pid reused by another process
    assert is_stale({"owner": {"pid": 11, "start": 5.0}}, check)  # owner gone
    assert not is_stale({"owner": {"pid": 10, "start": 5.0}}, check)
    assert not is_stale({"owner": None}, check)  # `hetpipe testbed up`: stays until `down`


def test_measured_rates_and_tolerance() -> None:
    assert rate_gbps(1000, 1000 + 500_000, 2.0) == pytest.approx(0.002)
    assert within(0.0035, 0.004) and within(0.0045, 0.004)
    assert not within(0.0033, 0.004) and not within(0.0047, 0.004)
    with pytest.raises(ValueError):
        rate_gbps(0, 1, 0.0)


def test_format_nodes_says_which_are_in_range() -> None:
    topology = plan_topology(load_config(BENCH), "t", 0.001)  # 10 Mbit/s
    text = format_nodes(topology, {"n0": 0.0099, "n1": 0.0080, "n2": None})
    lines = text.splitlines()
    assert "hp-t-n0" in lines[1] and "9.9 (-1.0%, ok)" in lines[1] and "[PS]" in lines[1]
    assert "8 (-20.0%, OUT OF RANGE)" in lines[2]
    assert lines[3].split()[4] == "-"  # n2: not measured
    assert lines[1].split()[-2] == "200"  # inside: 2 GPUs x 100 Gbit/s x 0.001, in Mbit/s
    text = format_nodes(topology, inside={"n0": 0.199, "n1": 0.0, "n2": 0.2})
    lines = text.splitlines()
    assert "199 (-0.5%, ok)" in lines[1] and "0 (-100.0%, OUT OF RANGE)" in lines[2]


def test_ddp_on_one_node_pays_for_its_all_reduce_at_the_inside_rate() -> None:
    import sys

    sys.path.insert(0, str(REPO / "launch" / "bench"))
    import peers
    import throughput

    config = load_config(BENCH)
    topology = plan_topology(config, "t", 0.001)  # inside: 0.1 Gbit/s a GPU; between nodes 0.01
    one_node = [d for d in peers.devices(config) if d.gpu.startswith("n0:")]
    two_nodes = [d for d in peers.devices(config) if d.gpu in ("n0:0", "n1:0")]
    param_bytes = 10**6
    # a ring over 2 ranks: each sends 2 (n - 1) / n = 1x the parameters, at its link's rate
    assert throughput.allreduce_s(param_bytes, one_node, topology) == pytest.approx(8e6 / 0.1e9)
    assert throughput.allreduce_s(param_bytes, two_nodes, topology) == pytest.approx(8e6 / 0.01e9)
    assert throughput.allreduce_s(param_bytes, one_node, None) == 0.0


def test_the_benches_measure_the_profile_again_at_the_end(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """throughput.speed_drift profiles the model afresh and sets it against the record's derivation."""
    import sys

    sys.path.insert(0, str(REPO / "launch" / "bench"))
    import throughput

    from hetpipe.app.testbed import derive_link_scale

    config = apply_overrides(
        load_config(BENCH), ['model.name="mnist-cnn"', "model.options={ channels = [4, 8], hidden = 16 }"]
    )
    start = derive_link_scale(config, tmp_path)
    halved = dataclasses.replace(start, cpu_step_s=start.cpu_step_s / 2)  # as if the start ran 2x faster
    record = {"scale": halved.scale, "scale_derived": halved.to_dict()}
    drift = throughput.speed_drift(config, tmp_path, record)
    assert drift["cpu_step_s_start"] == pytest.approx(start.cpu_step_s / 2)
    assert drift["cpu_step_s_end"] > 0.0
    assert drift["links_over_end"] == pytest.approx(drift["cpu_step_ratio"])
    assert "ms at the end" in capsys.readouterr().out
