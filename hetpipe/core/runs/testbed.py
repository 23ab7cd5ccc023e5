"""The shaped-network testbed as plain data: namespace, bridge and veth names, addresses, tbf parameters, the
effective config's overrides, where each `hetpipe worker` runs, and the link scale. No I/O:
hetpipe/app/testbed.py runs the `ip`/`tc` commands this plans (docs/testbed.md).

One network namespace per config node, all on one bridge in the root namespace, each with its own address in
10.77.0.0/16 (private to the machine). A node's link is shaped both ways by a tbf qdisc at inter_node_gbps x
scale, like a full-duplex NIC: its egress on its end of its veth, its ingress on the bridge's end (so several
nodes sending to one, e.g. pushes to the PS, share its rate). Traffic between processes of one node stays
inside its namespace, on its loopback, shaped by a tbf at its GPUs x intra_node_gbps x scale: the node's GPUs
each on their own full-duplex PCIe-like link through a switch that does not block, so all of them can send at
once (lo_mtu: the loopback's frames are cut to an Ethernet MTU so that the bucket stays small).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, fields, replace

from hetpipe.core.config.overrides import apply_overrides
from hetpipe.core.config.schema import ClusterConfig
from hetpipe.core.errors import UsageError
from hetpipe.core.planning.simulate import PsNetwork

__all__ = [
    "BURST_S",
    "LO_MTU",
    "MIN_BURST_BYTES",
    "MIN_QUEUE_BYTES",
    "NS_IFNAME",
    "PREFIX",
    "QUEUE_S",
    "LinkScale",
    "NodeNet",
    "Tbf",
    "Topology",
    "WorkerPlace",
    "describe_drift",
    "effective_config",
    "format_nodes",
    "is_stale",
    "layout_overrides",
    "node_address",
    "plan_topology",
    "rate_gbps",
    "run_of",
    "tbf_for",
    "within",
    "worker_places",
]

PREFIX = "hp-"  # every namespace and root-namespace link the testbed makes starts with it
SUBNET = "10.77.0.0/16"
PREFIX_LEN = 16
NS_IFNAME = (
    "hpnet"  # a node's end of its veth, inside its namespace: the same name everywhere (GLOO_SOCKET_IFNAME)
)
IFNAMSIZ = 15  # longest Linux interface name
LO_MTU = 1500  # a node's loopback MTU in the testbed (Linux's 65536 would need a 64 KiB bucket for one frame)
_RUN = re.compile(r"[a-z0-9]{1,8}")

# tbf: a bucket of at least MIN_BURST_BYTES (two full 1514-byte frames and change) or 1 ms of the rate, and a
# queue of QUEUE_S of the rate (at least MIN_QUEUE_BYTES) on top. Measured on veth pairs here with a TCP
# sender, link-level bytes: 0.5, 2, 20, 100 Mbit/s and 1 Gbit/s shaped to within 1% (0.9995, 1.998, 20.0,
# 98.5, 957 Mbit/s).
MIN_BURST_BYTES = 4096
BURST_S = 0.001
QUEUE_S = 0.05
MIN_QUEUE_BYTES = 16384


# ---------------------------------------------------------------------------------------------- shaping


@dataclass(frozen=True)
class Tbf:
    """A token-bucket filter: rate in bit/s, bucket (burst) and queue limit in bytes."""

    rate_bit: int
    burst_bytes: int
    limit_bytes: int

    @property
    def gbps(self) -> float:
        return self.rate_bit / 1e9

    def tc_args(self) -> tuple[str, ...]:
        """The qdisc's words for `tc qdisc replace dev DEV root ...`."""
        return (
            "tbf",
            "rate",
            f"{self.rate_bit}bit",
            "burst",
            str(self.burst_bytes),
            "limit",
            str(self.limit_bytes),
        )


def tbf_for(gbps: float) -> Tbf:
    """The tbf that shapes a link to `gbps` Gbit/s: burst max(4 KiB, 1 ms of rate), queue 50 ms of rate on
    top."""
    if not (math.isfinite(gbps) and gbps * 1e9 >= 8000):
        raise UsageError(
            f"a testbed link of {gbps} Gbit/s cannot be shaped: give it at least 8 kbit/s "
            "(raise --scale or network.inter_node_gbps)"
        )
    rate_bit = round(gbps * 1e9)
    per_s = rate_bit / 8
    burst = max(MIN_BURST_BYTES, math.ceil(per_s * BURST_S))
    return Tbf(rate_bit, burst, burst + max(MIN_QUEUE_BYTES, math.ceil(per_s * QUEUE_S)))


# ---------------------------------------------------------------------------------------------- scale


@dataclass(frozen=True)
class LinkScale:
    """How much slower the emulated cluster runs than the real one, so how much slower its links must be.

    The fastest emulated GPU runs a training step of the model in cpu_step_s x time_scale (the CPU profile's
    forward + backward times, one thread, stretched by that GPU's slowdown, hetpipe.core.hardware.emulate).
    The real GPU runs it in step_flops / (gpu_tflops x 1e12 x efficiency). A link of the real cluster carries
    inter_node_gbps; to keep the compute/communication ratio, the emulated link must carry
    inter_node_gbps x scale with scale = real step time / emulated step time (= emulated speed / real speed).
    efficiency 1.0 takes the real GPU at its peak FP32 rate: the fastest it could be, so the smallest scale
    and the slowest links - the harshest reading for communication (docs/testbed.md).
    """

    cpu_step_s: float
    time_scale: float
    step_flops: float
    gpu_tflops: float
    efficiency: float = 1.0

    def __post_init__(self) -> None:
        for name in ("cpu_step_s", "time_scale", "step_flops", "gpu_tflops", "efficiency"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise UsageError(f"link scale: {name} must be a finite number > 0, got {value!r}")

    @property
    def emulated_step_s(self) -> float:
        return self.cpu_step_s * self.time_scale

    @property
    def real_step_s(self) -> float:
        return self.step_flops / (self.gpu_tflops * 1e12 * self.efficiency)

    @property
    def scale(self) -> float:
        return self.real_step_s / self.emulated_step_s

    def describe(self) -> str:
        """One line: the scale and where it comes from."""
        return (
            f"link scale {self.scale:.3g} = real step {self.real_step_s * 1e3:.3g} ms "
            f"({self.step_flops / 1e9:.3g} GFLOP at {self.gpu_tflops:g} TFLOPS x {self.efficiency:g}) "
            f"/ emulated step {self.emulated_step_s:.3g} s "
            f"(CPU {self.cpu_step_s * 1e3:.3g} ms x slowdown {self.time_scale:g})"
        )

    def to_dict(self) -> dict[str, float]:
        return {
            **asdict(self),
            "emulated_step_s": self.emulated_step_s,
            "real_step_s": self.real_step_s,
            "scale": self.scale,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, float]) -> LinkScale:
        """The scale `to_dict` wrote (its derived figures are recomputed, not read)."""
        return cls(**{f.name: data[f.name] for f in fields(cls)})

    def drift(self, end_cpu_step_s: float, used_scale: float | None = None) -> dict[str, float]:
        """How far this machine's speed moved from the profile this scale was derived from to a profile taken
        at the end of the run (`end_cpu_step_s`): the end's CPU step over the start's, the scale the end's
        profile would derive, and the run's links (this scale, or `used_scale` when one was given instead)
        over the ones it would give (above 1: faster than the end's speed calls for, below 1 slower)."""
        end = replace(self, cpu_step_s=end_cpu_step_s)
        used = self.scale if used_scale is None else used_scale
        return {
            "cpu_step_s_start": self.cpu_step_s,
            "cpu_step_s_end": end.cpu_step_s,
            "cpu_step_ratio": end.cpu_step_s / self.cpu_step_s,
            "scale_at_end": end.scale,
            "links_over_end": used / end.scale,
        }


def describe_drift(drift: Mapping[str, float]) -> str:
    """One line for LinkScale.drift: the CPU step at both ends and what it means for the run's links."""
    links = drift["links_over_end"]
    how = "as fast as" if abs(links - 1.0) < 0.005 else ("faster than" if links > 1.0 else "slower than")
    start, end = drift["cpu_step_s_start"] * 1e3, drift["cpu_step_s_end"] * 1e3
    steps = f"CPU step {start:.3g} ms at the start, {end:.3g} ms at the end ({drift['cpu_step_ratio']:.2f}x)"
    now = f"a profile taken now would derive scale {drift['scale_at_end']:.3g}"
    return f"{steps}: {now}, so this run's links were {links:.2f}x, {how} the end's speed calls for"


# ---------------------------------------------------------------------------------------------- topology


@dataclass(frozen=True)
class NodeNet:
    """One config node in the testbed: its namespace, its veth's bridge end, its address, its shaped egress,
    and the shaping of its loopback (the traffic between its own GPUs)."""

    node: str
    netns: str  # hp-<run>-<node>
    host_veth: str  # hp-<run>-<index>, in the root namespace, a port of the bridge
    address: str
    tbf: Tbf
    inside_tbf: Tbf  # on its loopback: its GPUs x intra_node_gbps x scale

    @property
    def egress_gbps(self) -> float:
        return self.tbf.gbps

    @property
    def inside_gbps(self) -> float:
        return self.inside_tbf.gbps


@dataclass(frozen=True)
class Topology:
    """A whole testbed: run id, bridge, one NodeNet per config node (config order), the PS node, the scale."""

    run: str
    bridge: str
    nodes: tuple[NodeNet, ...]
    ps_node: str
    scale: float
    inter_node_gbps: float
    intra_node_gbps: float

    def node(self, name: str) -> NodeNet:
        for net in self.nodes:
            if net.node == name:
                return net
        raise UsageError(
            f"testbed {self.run} has no node {name!r}; its nodes: {', '.join(n.node for n in self.nodes)}"
        )

    def of_gpu(self, gpu: str) -> NodeNet:
        """The node of GPU "n0:1"."""
        return self.node(gpu.rsplit(":", 1)[0])

    @property
    def ps(self) -> NodeNet:
        return self.node(self.ps_node)

    @property
    def shaped_gbps(self) -> float:
        """Every node's egress rate: inter_node_gbps x scale."""
        return self.inter_node_gbps * self.scale

    @property
    def shaped_intra_gbps(self) -> float:
        """One GPU's share of its node's loopback: intra_node_gbps x scale."""
        return self.intra_node_gbps * self.scale

    def link_gbps(self, a: str, b: str) -> float:
        """Gbit/s between GPUs a and b ("n0:1"): shaped_intra_gbps on one node, else shaped_gbps."""
        return self.shaped_intra_gbps if a.rsplit(":", 1)[0] == b.rsplit(":", 1)[0] else self.shaped_gbps

    def ps_network(self) -> PsNetwork:
        """The links the PS's traffic crosses here, for the simulator: each node's shaped egress and
        loopback."""
        return PsNetwork(
            self.ps_node,
            {n.node: n.egress_gbps for n in self.nodes},
            {n.node: n.inside_gbps for n in self.nodes},
        )

    def overrides(self) -> tuple[str, ...]:
        """`--set` overrides that make a config run in this testbed: node hosts, the PS host, no sleep-based
        links."""
        hosts = tuple(f"nodes.{i}.host={net.address}" for i, net in enumerate(self.nodes))
        return (*hosts, f"ps.host={self.ps.address}", "emulation.link_bandwidth=false")

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping) -> Topology:
        nodes = tuple(
            NodeNet(**{**n, "tbf": Tbf(**n["tbf"]), "inside_tbf": Tbf(**n["inside_tbf"])})
            for n in data["nodes"]
        )
        return cls(
            data["run"],
            data["bridge"],
            nodes,
            data["ps_node"],
            data["scale"],
            data["inter_node_gbps"],
            data["intra_node_gbps"],
        )


def effective_config(config: ClusterConfig, topology: Topology) -> ClusterConfig:
    """`config` as it runs in the testbed: each node at its namespace's address, the PS at its node's, and the
    sleep-based link emulation off (the shaped veths are the links)."""
    return apply_overrides(config, topology.overrides())


def node_address(index: int) -> str:
    """Node `index`'s address: host index + 2 of 10.77.0.0/16 (.0 is the network, .1 is left free)."""
    host = index + 2
    if not 0 <= index < 2**16 - 3:
        raise UsageError(f"a testbed holds at most {2**16 - 3} nodes; node index {index} is out of range")
    return f"10.77.{host // 256}.{host % 256}"


def plan_topology(config: ClusterConfig, run: str, scale: float, ps_node: str | None = None) -> Topology:
    """The testbed of `config`: one namespace per node, egress at inter_node_gbps x scale, its loopback at its
    GPUs x intra_node_gbps x scale.

    The PS runs on `ps_node`, else on the first node whose host is the config's ps.host, else on the first
    node.
    """
    if not _RUN.fullmatch(run):
        raise UsageError(f"testbed run id {run!r}: use 1 to 8 lower-case letters or digits")
    if not (math.isfinite(scale) and scale > 0):
        raise UsageError(f"--scale {scale}: give a number > 0 (the emulated GPUs' speed over the real ones')")
    names = [n.name for n in config.nodes]
    if ps_node is None:
        ps_node = next((n.name for n in config.nodes if n.host == config.ps.host), names[0])
    elif ps_node not in names:
        raise UsageError(f"--ps-node {ps_node!r}: {config.path} has nodes {', '.join(names)}")
    gbps = config.network.inter_node_gbps
    tbf = tbf_for(gbps * scale)
    nodes = []
    for i, name in enumerate(names):
        veth = f"{PREFIX}{run}-{i}"
        if len(veth) > IFNAMSIZ:
            raise UsageError(
                f"testbed interface name {veth!r} is longer than {IFNAMSIZ} characters: "
                "use a shorter run id or fewer nodes"
            )
        inside = tbf_for(len(config.nodes[i].gpus) * config.network.intra_node_gbps * scale)
        nodes.append(NodeNet(name, f"{PREFIX}{run}-{name}", veth, node_address(i), tbf, inside))
    return Topology(
        run, f"{PREFIX}{run}-br", tuple(nodes), ps_node, scale, gbps, config.network.intra_node_gbps
    )


def run_of(name: str) -> str | None:
    """The run id in a testbed namespace or link name ("hp-3f2a-n0" -> "3f2a"), None for other names."""
    if not name.startswith(PREFIX):
        return None
    run = name[len(PREFIX) :].split("-", 1)[0]
    return run if _RUN.fullmatch(run) and name != f"{PREFIX}{run}" else None


def is_stale(state: Mapping | None, alive: Callable[[int, float], bool]) -> bool:
    """Whether a run's namespaces are leftovers: no state recorded, or its owner process (pid, start time)
    gone. A run made by `hetpipe testbed up` has no owner and stays until `hetpipe testbed down`."""
    if state is None:
        return True
    owner = state.get("owner")
    return owner is not None and not alive(owner["pid"], owner["start"])


# ---------------------------------------------------------------------------------------------- processes


@dataclass(frozen=True)
class WorkerPlace:
    """One `hetpipe worker` process: VW `vw` (all its stages when `stage` is None) in `node`'s namespace."""

    vw: int
    stage: int | None
    node: str

    def args(self) -> tuple[str, ...]:
        return ("--vw", str(self.vw)) + (() if self.stage is None else ("--stage", str(self.stage)))


def worker_places(vw_gpus: Sequence[Sequence[str]]) -> list[WorkerPlace]:
    """Where each `hetpipe worker` runs: a VW on one node as one worker there; a VW spanning nodes as one
    worker per stage, in its GPU's node."""
    places = []
    for v, gpus in enumerate(vw_gpus):
        nodes = [g.rsplit(":", 1)[0] for g in gpus]
        if len(set(nodes)) == 1:
            places.append(WorkerPlace(v, None, nodes[0]))
        else:
            places += [WorkerPlace(v, j, node) for j, node in enumerate(nodes)]
    return places


def layout_overrides(layouts: Iterable[tuple[Sequence[str], Sequence[int], int, int]]) -> list[str]:
    """`--set` overrides listing virtual workers (GPUs, layers per stage, and each one's own Nm and minibatch
    size, 0: the config's) by hand, e.g. a plan's."""
    tables = ", ".join(
        "{ gpus = ["
        + ", ".join(f'"{g}"' for g in gpus)
        + "], layers = ["
        + ", ".join(str(n) for n in split)
        + "]"
        + (f", nm = {nm}" if nm else "")
        + (f", batch_size = {batch}" if batch else "")
        + " }"
        for gpus, split, nm, batch in layouts
    )
    return ["allocation.policy=explicit", f"virtual_workers=[{tables}]"]


# ---------------------------------------------------------------------------------------------- measuring


def format_nodes(
    topology: Topology,
    measured: Mapping[str, float | None] | None = None,
    tolerance: float = 0.15,
    inside: Mapping[str, float | None] | None = None,
) -> str:
    """A table of the testbed's nodes: namespace, address, configured egress and inside (loopback) rates and,
    when given, the measured ones (Mbit/s) with whether each is within `tolerance` of its configured rate."""

    def cell(got: float | None, want: float) -> str:
        if got is None:
            return "-"
        return (
            f"{got * 1e3:.4g} ({got / want - 1:+.1%}, "
            f"{'ok' if within(got, want, tolerance) else 'OUT OF RANGE'})"
        )

    lines = [
        f"{'node':<8} {'namespace':<16} {'address':<12} {'egress Mbit/s':>13}"
        + ("  measured" if measured else "")
        + f"  {'inside Mbit/s':>13}"
        + ("  measured" if inside else "")
    ]
    for net in topology.nodes:
        line = f"{net.node:<8} {net.netns:<16} {net.address:<12} {net.egress_gbps * 1e3:>13.4g}"
        if measured is not None:
            line += f"  {cell(measured.get(net.node), net.egress_gbps):<28}"
        line += f"  {net.inside_gbps * 1e3:>13.4g}"
        if inside is not None:
            line += f"  {cell(inside.get(net.node), net.inside_gbps)}"
        lines.append(line + ("  [PS]" if net.node == topology.ps_node else ""))
    return "\n".join(lines)


def rate_gbps(bytes_before: int, bytes_after: int, seconds: float) -> float:
    """Gbit/s of a byte counter's growth over `seconds`."""
    if seconds <= 0:
        raise ValueError(f"seconds must be > 0, got {seconds}")
    return (bytes_after - bytes_before) * 8 / seconds / 1e9


def within(measured: float, configured: float, tolerance: float = 0.15) -> bool:
    """|measured - configured| <= tolerance x configured (the issue's acceptance: 15%)."""
    return abs(measured - configured) <= tolerance * configured
