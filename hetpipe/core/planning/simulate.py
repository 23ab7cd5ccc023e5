"""Discrete-event simulator of a plan under WSP (throughput, gate waits, PS load) and of the baselines.
Pure."""

from __future__ import annotations

import heapq
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from hetpipe.core.errors import HetpipeError, UsageError
from hetpipe.core.pipeline.schedule import (
    BACKWARD,
    FORWARD,
    PUSH,
    WAIT,
    Action,
    flushing_schedule,
    get_schedule,
    needs,
)
from hetpipe.core.pipeline.schedule import simulate as simulate_schedule
from hetpipe.core.planning.plan import Plan, VwPlan
from hetpipe.core.planning.relays import Relay
from hetpipe.core.wsp.aggregation import DEFAULT_AGGREGATION, get_aggregation, needs_pulls
from hetpipe.core.wsp.clock import gate_version

__all__ = [
    "BaselineResult",
    "GateRecord",
    "PsNetwork",
    "SimEvent",
    "SimResult",
    "VwResult",
    "simulate",
    "simulate_allreduce",
    "simulate_sync_pipeline",
    "stage_param_bytes",
    "stage_times",
]


@dataclass(frozen=True)
class SimEvent:
    """One action of one stage: F/B busy the stage; PUSH ends when its bytes reach the PS (the stage
    goes on at once); WAIT starts when the gate opens and ends when the pull has arrived."""

    vw: int
    stage: int
    action: Action
    start: float
    end: float


@dataclass(frozen=True)
class GateRecord:
    """A gate opening: stage `stage` of VW `vw` starts wave `wave`; `completed` is c_local of every VW
    then."""

    time_s: float
    vw: int
    stage: int
    wave: int
    completed: tuple[int, ...]

    @property
    def lead(self) -> int:
        """How many waves this VW has completed beyond the slowest; WSP keeps it <= D + 1."""
        return self.completed[self.vw] - min(self.completed)


@dataclass(frozen=True)
class VwResult:
    """One virtual worker's run."""

    wave_done_s: tuple[float, ...]  # when wave c completed: every stage's push of c had reached the PS
    wave_s: float  # steady-state time per wave: mean gap between wave completions, fill and drain excluded
    samples_per_s: float  # its own samples / its own finish time
    finish_s: float
    gate_wait_s: float  # stage-seconds blocked at WAIT: the gate, then the pull's arrival (all stages summed)
    pull_s: float  # seconds from a gate opening to its pull's arrival (queueing on the PS link included)


@dataclass(frozen=True)
class SimResult:
    """A simulated WSP run of every virtual worker of a plan."""

    samples_per_s: float  # batch_size x all minibatches of all VWs / makespan
    makespan_s: float
    ps_utilisation: float  # busy fraction of the PS link (of the busiest, with a PsNetwork) over the makespan
    vws: tuple[VwResult, ...]
    gates: tuple[GateRecord, ...]
    events: tuple[SimEvent, ...]
    ps_link: str = ""  # the busiest link's name: "PS" (one link for all), or a PsNetwork's ("n1 egress")
    link_bytes: tuple[tuple[str, float], ...] = ()  # the bytes each link carried over the run, by name


@dataclass(frozen=True)
class BaselineResult:
    """A synchronous alternative: every step processes `samples_per_step` samples in `step_s`."""

    name: str
    samples_per_s: float
    step_s: float
    comm_s: float  # part of step_s spent synchronising parameters


# ---------------------------------------------------------------------------------------------- inputs


def stage_times(vw: VwPlan) -> tuple[list[float], list[float]]:
    """Per-stage forward and backward durations: compute plus the stage's transfers in that direction.

    recv_s holds the input activation (forward) and the output gradient (backward); send_s the
    output activation (forward) and the input gradient (backward). Stage 0 receives only gradients
    and sends only activations, the last stage the reverse; a middle stage's are split half and
    half (activation and gradient have the same size). So every stage is busy time_s per minibatch
    (transfers block the stage, as gloo send/recv does), and a full pipe runs at batch / bottleneck_s,
    the partitioner's objective.
    """
    k = len(vw.stages)
    forward, backward = [], []
    for j, stage in enumerate(vw.stages):
        recv_forward = 0.5 if k == 1 else 0.0 if j == 0 else 1.0 if j == k - 1 else 0.5
        send_forward = 0.5 if k == 1 else 1.0 if j == 0 else 0.0 if j == k - 1 else 0.5
        forward.append(stage.forward_s + stage.recv_s * recv_forward + stage.send_s * send_forward)
        backward.append(
            stage.backward_s + stage.recv_s * (1 - recv_forward) + stage.send_s * (1 - send_forward)
        )
    return forward, backward


def stage_param_bytes(vw: VwPlan) -> list[float]:
    """Bytes each stage pushes and pulls per wave: StagePlan.param_bytes, or, when no stage has it
    set (all 0), VwPlan.param_bytes split over the stages by layer count."""
    own = [float(stage.param_bytes) for stage in vw.stages]
    layers = sum(vw.split)
    if any(own) or vw.param_bytes == 0 or layers == 0:
        return own
    return [vw.param_bytes * n / layers for n in vw.split]


@dataclass(frozen=True)
class PsNetwork:
    """The nodes' own links as the PS's bytes cross them (the testbed, or a cluster of machines), in Gbit/s
    per node name. A shard on the sender's own node is reached over that node's loopback; else a transfer
    leaves over the sender's egress and arrives over the receiver's ingress: a push from the GPU's node to
    the shard's, a pull back (the shard node's egress and ingress are shared by every VW it serves). A node's
    NIC runs `egress_gbps` each way (full duplex, as the testbed shapes both ends of a node's veth). The
    shards run on `ps_node`, or with placement "local" each layer's on `layer_nodes[layer]`; a stage's bytes
    are then split over its layers by `layer_bytes` (default: evenly)."""

    ps_node: str
    egress_gbps: Mapping[str, float]
    inside_gbps: Mapping[str, float]
    layer_nodes: tuple[str, ...] = ()
    layer_bytes: tuple[float, ...] = ()

    def route(self, gpu: str, push: bool, shard_node: str | None = None) -> list[tuple[str, float]]:
        """(each link's name, its Gbit/s) that a push (else a pull) of GPU "n1:0" to a shard on `shard_node`
        (default: ps_node) crosses: the node's loopback, or the sender's egress and the receiver's ingress."""
        node = gpu.rsplit(":", 1)[0]
        shard_node = shard_node or self.ps_node
        for name in (node, shard_node):
            if name not in self.egress_gbps or name not in self.inside_gbps:
                raise UsageError(
                    f"GPU {gpu!r} or its shard is on node {name!r}, which the PS network does not list "
                    f"(nodes: {', '.join(self.egress_gbps)}); build it from the same config as the plan"
                )
        if node == shard_node:
            return [(f"{node} loopback", self.inside_gbps[node])]
        sender, receiver = (node, shard_node) if push else (shard_node, node)
        out, into = self.egress_gbps[sender], self.egress_gbps[receiver]
        return [(f"{sender} egress", out), (f"{receiver} ingress", into)]

    def parts(
        self, gpu: str, start: int, stop: int, nbytes: float, push: bool
    ) -> list[tuple[str, float, float]]:
        """(link name, Gbit/s, bytes) of each link a stage's transfer of `nbytes` for layers [start, stop)
        crosses."""
        if not self.layer_nodes:
            return [(name, gbps, nbytes) for name, gbps in self.route(gpu, push)]
        if not 0 <= start < stop <= len(self.layer_nodes):
            raise UsageError(
                f"layers [{start}, {stop}) of {gpu!r} are outside the {len(self.layer_nodes)} layers "
                "the PS network places: build it from the same plan"
            )
        weights = self.layer_bytes[start:stop] if self.layer_bytes else (1.0,) * (stop - start)
        total = sum(weights) or 1.0
        by_node: dict[str, float] = {}
        for layer, weight in zip(range(start, stop), weights, strict=True):
            node = self.layer_nodes[layer]
            by_node[node] = by_node.get(node, 0.0) + nbytes * weight / total
        return [
            (name, gbps, part) for node, part in by_node.items() for name, gbps in self.route(gpu, push, node)
        ]

    def relay_parts(self, node: str, nbytes: float, push: bool) -> list[tuple[str, float, float]]:
        """parts of node `node`'s relay pushing (else pulling) the whole model's `nbytes` to its shards: the
        links a GPU of that node crosses for every layer."""
        return self.parts(f"{node}:relay", 0, len(self.layer_nodes), nbytes, push)


# ---------------------------------------------------------------------------------------------- WSP run


class _Link:
    """A FIFO link to or from the PS carrying `bytes_per_s` (every shard's share in parallel)."""

    def __init__(self, bytes_per_s: float) -> None:
        self.bytes_per_s = bytes_per_s
        self.free_at = 0.0
        self.busy_s = 0.0
        self.moved = 0.0

    def transfer(self, now: float, nbytes: float) -> float:
        """Queue `nbytes` at `now`; the time they have arrived."""
        self.moved += nbytes
        if nbytes == 0 or math.isinf(self.bytes_per_s):
            return now
        start = max(now, self.free_at)
        self.free_at = start + nbytes / self.bytes_per_s
        self.busy_s += self.free_at - start
        return self.free_at


class _Vw:
    """Run state of one virtual worker: its lists, times, and what has finished when."""

    def __init__(self, vw: VwPlan, waves: int, staleness: int, schedule: str, recompute: bool) -> None:
        self.schedule = get_schedule(schedule)(len(vw.stages), vw.nm, waves, staleness)
        self.plan = vw
        self.k = len(vw.stages)
        self.forward, self.backward = stage_times(vw)
        if recompute:  # the backward runs the forward again first
            self.backward = [b + f for f, b in zip(self.forward, self.backward, strict=True)]
        self.param_bytes = stage_param_bytes(vw)
        self.gpus = vw.gpus
        self.starts = [stage.start for stage in vw.stages]
        self.stops = [stage.stop for stage in vw.stages]
        self.position = [0] * self.k
        self.free_at = [0.0] * self.k
        self.ready_at = [0.0] * self.k  # when the stage reached its current position
        self.done: list[dict[Action, float]] = [{} for _ in range(self.k)]
        self.push_landed: list[list[float]] = [[] for _ in range(waves)]
        self.pushed = [0] * self.k  # waves each stage has handed to its PS agent
        self.waits = [[a.index for a in actions if a.kind == WAIT] for actions in self.schedule.stages]
        # what each action waits for on the other stages, by position (pipeline.schedule.needs)
        self.needs = [
            [needs(a, j, self.k) for a in actions] for j, actions in enumerate(self.schedule.stages)
        ]
        self.next_wait = [0] * self.k  # index into waits[j] of the stage's next WAIT
        self.pull_handed: list[dict[int, float]] = [{} for _ in range(self.k)]  # wave -> when handed over
        self.pull_pending: list[list[int]] = [[] for _ in range(self.k)]  # handed over, not sent yet
        self.pull_arrived: list[dict[int, float]] = [{} for _ in range(self.k)]  # wave -> when it arrived
        self.completed = 0  # waves completed by the current time (advanced by `completed_at`)
        self.gate_wait_s = 0.0
        self.pull_s = 0.0

    def finished(self, stage: int, action: Action, now: float) -> bool:
        return self.done[stage].get(action, math.inf) <= now

    def completed_at(self, now: float) -> int:
        """c_local at `now` (times only grow, so the count only advances)."""
        while (
            self.completed < len(self.push_landed)
            and len(self.push_landed[self.completed]) == self.k
            and max(self.push_landed[self.completed]) <= now
        ):
            self.completed += 1
        return self.completed

    def wave_done_s(self) -> tuple[float, ...]:
        return tuple(max(landed) for landed in self.push_landed)


class _Links:
    """The links the PS's traffic crosses: one shared FIFO at the PS's own rate, or, given a PsNetwork, one
    FIFO per node link (each no faster than the PS's own rate)."""

    def __init__(self, ps_bytes_per_s: float, network: PsNetwork | None) -> None:
        self.ps_bytes_per_s = ps_bytes_per_s
        self.network = network
        self.by_name: dict[str, _Link] = {}

    def transfer(self, vw: _Vw, j: int, push: bool, now: float) -> float:
        """Queue stage j's push (else pull) at `now`; the time every part of it has arrived."""
        nbytes = vw.param_bytes[j]
        if self.network is None:
            parts = [("PS", math.inf, nbytes)]
        else:
            parts = self.network.parts(vw.gpus[j], vw.starts[j], vw.stops[j], nbytes, push)
        return self._send(parts, now)

    def hop(self, vw: _Vw, j: int, relay: Relay, push: bool, now: float) -> float:
        """Queue stage j's push to (else pull from) its node's relay at `now` over the node's inside link: the
        PsNetwork's loopback (capped as its other links), else `relay.inside_gbps` (the relay is no PS shard:
        not capped by the PS's rate); the time it has arrived."""
        nbytes = vw.param_bytes[j]
        if self.network is None:
            name = f"{relay.node} loopback"
            if name not in self.by_name:
                self.by_name[name] = _Link(relay.inside_gbps * 1e9 / 8)
            return self.by_name[name].transfer(now, nbytes)
        return self._send([(*link, nbytes) for link in self.network.route(vw.gpus[j], push, relay.node)], now)

    def upstream(self, relay: Relay, nbytes: float, push: bool, now: float) -> float:
        """Queue a relay's push (else pull) of the whole model's `nbytes` at `now`, over the links a GPU of
        its node crosses to the shards (the one PS link without a PsNetwork); when every part has arrived."""
        if self.network is None:
            return self._send([("PS", math.inf, nbytes)], now)
        return self._send(self.network.relay_parts(relay.node, nbytes, push), now)

    def _send(self, parts: Sequence[tuple[str, float, float]], now: float) -> float:
        end = now
        for name, gbps, part in parts:
            if name not in self.by_name:
                self.by_name[name] = _Link(min(self.ps_bytes_per_s, gbps * 1e9 / 8))
            end = max(end, self.by_name[name].transfer(now, part))
        return end

    def utilisation(self, makespan: float) -> float:
        """The busiest link's busy share of `makespan`."""
        return max((link.busy_s for link in self.by_name.values()), default=0.0) / makespan

    def busiest(self) -> str:
        """The busiest link's name ("PS" without a PsNetwork, else e.g. "n1 egress"); "" when none is used."""
        return max(self.by_name, key=lambda name: self.by_name[name].busy_s, default="")

    def moved(self) -> tuple[tuple[str, float], ...]:
        """The bytes each link carried, by name."""
        return tuple((name, link.moved) for name, link in self.by_name.items())


class _Relay:
    """Run state of a relay: its group's stage pushes that reached it per wave, the waves it has pushed
    upstream, and per wave when it asked for the pull and when the reply reached it."""

    def __init__(self, relay: Relay, vws: Sequence[_Vw], waves: int) -> None:
        self.relay = relay
        self.vws = vws
        self.stages = sum(vw.k for vw in vws)
        self.nbytes = max(sum(vw.param_bytes) for vw in vws)  # one VW's weights: the whole model's
        self.arrived: list[list[float]] = [[] for _ in range(waves)]
        self.sent = 0
        self.asked: dict[int, float] = {}
        self.replied: dict[int, float] = {}

    def ready(self, now: float) -> bool:
        """Whether every stage of the group has pushed the next wave to send to the relay by `now`."""
        if self.sent >= len(self.arrived):
            return False
        arrived = self.arrived[self.sent]
        return len(arrived) == self.stages and max(arrived) <= now


class _Run:
    """All virtual workers on one clock and one set of PS links, so the D bound couples them."""

    def __init__(
        self, plan: Plan, waves: int, links: _Links, pulls: bool, relays: Sequence[Relay] = ()
    ) -> None:
        self.staleness = plan.staleness
        self.vws = [_Vw(vw, waves, plan.staleness, plan.schedule, plan.recompute) for vw in plan.vws]
        self.links = links
        self.pulls = pulls
        self.events: list[SimEvent] = []
        self.gates: list[GateRecord] = []
        self.upcoming: list[float] = []
        self.relays = [_Relay(r, [self.vws[v] for v in r.vws], waves) for r in relays]
        self.relay_of = {v: state for state in self.relays for v in state.relay.vws}
        self.last_landed = 0.0  # the last relay push's arrival upstream

    def ready(self, i: int, j: int, action: Action, now: float) -> bool:
        vw = self.vws[i]
        for peer, other in vw.needs[j][vw.position[j]]:
            if vw.done[peer].get(other, math.inf) > now:
                return False
        if action.kind != WAIT or not self.pulls:
            return True
        return vw.pull_arrived[j].get(action.index, math.inf) <= now

    def c_global(self, now: float) -> int:
        return min(vw.completed_at(now) for vw in self.vws)

    def hand_over_pull(self, vw: _Vw, j: int, now: float) -> None:
        """As the runtime does: the next WAIT's pull goes to the PS once the stage's previous WAIT is done and
        its own pushes of waves <= c - D - 2 are handed over; the PS answers when the gate opens."""
        if not self.pulls or vw.next_wait[j] >= len(vw.waits[j]):
            return
        wave = vw.waits[j][vw.next_wait[j]]
        if wave not in vw.pull_handed[j] and vw.pushed[j] >= gate_version(wave, self.staleness):
            vw.pull_handed[j][wave] = now
            vw.pull_pending[j].append(wave)

    def serve_pulls(self, now: float) -> None:
        """The PS sends every handed-over pull whose gate is open at `now`, first come first served."""
        if not any(pending for vw in self.vws for pending in vw.pull_pending):
            return
        c_global = self.c_global(now)
        for i, vw in enumerate(self.vws):
            relay = self.relay_of.get(i)
            for j in range(vw.k):
                pending = vw.pull_pending[j]
                for wave in list(pending):
                    if vw.pull_handed[j][wave] <= now and c_global >= gate_version(wave, self.staleness):
                        if relay is not None:
                            self.serve_relayed(vw, j, wave, relay, now)
                            continue
                        pending.remove(wave)
                        arrived = self.links.transfer(vw, j, push=False, now=now)
                        vw.pull_arrived[j][wave] = arrived
                        vw.pull_s += arrived - now
                        if arrived > now:
                            heapq.heappush(self.upcoming, arrived)

    def serve_relayed(self, vw: _Vw, j: int, wave: int, relay: _Relay, now: float) -> None:
        """A relayed stage's pull whose gate is open: the relay's one pull of the wave goes upstream at the
        first of its stages' asking; once its reply has reached the relay, the stage's part crosses the node's
        inside link."""
        if wave not in relay.replied:
            relay.asked[wave] = now
            relay.replied[wave] = self.links.upstream(relay.relay, relay.nbytes, push=False, now=now)
            if relay.replied[wave] > now:
                heapq.heappush(self.upcoming, relay.replied[wave])
        if relay.replied[wave] > now:
            return
        vw.pull_pending[j].remove(wave)
        arrived = self.links.hop(vw, j, relay.relay, push=False, now=now)
        vw.pull_arrived[j][wave] = arrived
        vw.pull_s += arrived - max(relay.asked[wave], vw.pull_handed[j][wave])
        if arrived > now:
            heapq.heappush(self.upcoming, arrived)

    def serve_relays(self, now: float) -> None:
        """Each relay pushes wave c upstream once every stage of its group has pushed c to it, in wave order;
        every VW of the group has completed c when that push has arrived."""
        for relay in self.relays:
            while relay.ready(now):
                landed = self.links.upstream(relay.relay, relay.nbytes, push=True, now=now)
                for vw in relay.vws:
                    vw.push_landed[relay.sent] = [landed] * vw.k
                relay.sent += 1
                self.last_landed = max(self.last_landed, landed)
                if landed > now:
                    heapq.heappush(self.upcoming, landed)

    def start(self, i: int, j: int, action: Action, now: float) -> None:
        vw = self.vws[i]
        end = free = now
        if action.kind == PUSH and i in self.relay_of:  # to the node's relay, which pushes for the group
            end = self.links.hop(vw, j, self.relay_of[i].relay, push=True, now=now)
            self.relay_of[i].arrived[action.index].append(end)
            vw.pushed[j] = action.index + 1
        elif action.kind == PUSH:  # handed to the PS agent: the stage goes on at once
            end = self.links.transfer(vw, j, push=True, now=now)  # the event spans the transfer
            vw.push_landed[action.index].append(end)
            vw.pushed[j] = action.index + 1
        elif action.kind == WAIT and self.pulls:  # the pull has arrived (ready() checked)
            vw.gate_wait_s += now - vw.ready_at[j]
            completed = tuple(other.completed_at(now) for other in self.vws)
            self.gates.append(GateRecord(now, i, j, action.index, completed))
            vw.next_wait[j] += 1
        elif action.kind in (FORWARD, BACKWARD):
            end = free = now + (vw.forward[j] if action.kind == FORWARD else vw.backward[j])
        vw.free_at[j] = vw.ready_at[j] = free
        vw.done[j][action] = free
        vw.position[j] += 1
        self.events.append(SimEvent(i, j, action, now, end))
        if action.kind in (PUSH, WAIT):
            self.hand_over_pull(vw, j, now)
        if end > now:
            heapq.heappush(self.upcoming, end)

    def step(self, now: float) -> None:
        """Start everything that can start at `now` (a zero-time action may unblock others at `now`)."""
        progressed = True
        while progressed:
            progressed = False
            self.serve_relays(now)
            self.serve_pulls(now)
            for i, vw in enumerate(self.vws):
                for j, actions in enumerate(vw.schedule.stages):
                    while vw.free_at[j] <= now and vw.position[j] < len(actions):
                        action = actions[vw.position[j]]
                        if not self.ready(i, j, action, now):
                            break
                        self.start(i, j, action, now)
                        progressed = True

    def finished_all(self) -> bool:
        return all(
            vw.position[j] == len(actions) for vw in self.vws for j, actions in enumerate(vw.schedule.stages)
        ) and all(relay.sent == len(relay.arrived) for relay in self.relays)

    def run(self) -> None:
        now = 0.0
        while True:
            self.step(now)
            if self.finished_all():
                return
            while self.upcoming and self.upcoming[0] <= now:
                heapq.heappop(self.upcoming)
            if not self.upcoming:  # cannot happen with validated lists; a guard against an endless loop
                raise HetpipeError(
                    f"simulation stuck at t={now}: no stage can proceed; this is a bug, report it"
                )
            now = heapq.heappop(self.upcoming)


def simulate(
    plan: Plan,
    *,
    waves: int,
    ps_gbps: float,
    ps_shards: int = 1,
    network: PsNetwork | None = None,
    relays: Sequence[Relay] = (),
) -> SimResult:
    """Run every VW of `plan` for `waves` waves of its schedule under WSP with D = plan.staleness.

    Stages take stage_times() (a recomputing backward adds the forward); PUSH c sends the stage's param
    bytes (stage_param_bytes) to the PS in the background, as the runtime's PS agent does, and VW i has
    completed wave c once every stage's push of c has arrived. WAIT c waits for the pull of W_{c-D-1}: the
    runtime hands it over early (after the stage's previous WAIT and its push of wave c - D - 2) and the PS
    sends it once c_global >= c - D - 1. A single VW skips WAIT, as the runtime does, unless the PS runs
    the optimizer (the plan's aggregation rule: hetpipe.core.wsp.aggregation.needs_pulls).
    Pushes and pulls share one FIFO PS link; with balanced placement every transfer is spread
    evenly over the shards, each with its own `ps_gbps` link, so the link runs at ps_shards x ps_gbps
    (math.inf: free). With a `network`, each transfer instead queues on the node link it crosses
    (PsNetwork.route), at the lesser of that link's rate and the PS's; ps_utilisation is then the busiest
    link's. The run ends when the last push has arrived.

    `relays` ([ps] node_aggregation: hetpipe.core.planning.relays): a relayed group's stages push to and pull
    from their node's relay over the node's inside link (Relay.inside_gbps, or the PsNetwork's loopback); the
    relay pushes the whole model's weights (one VW's) upstream once every stage of the group has pushed the
    wave to it, and each VW of the group has completed the wave when that push has arrived; it pulls once per
    wave, when the first of its stages asks and the gate is open, and hands the reply to each stage.
    """
    if waves < 1:
        raise UsageError(f"waves must be >= 1, got {waves}")
    if not ps_gbps > 0:
        raise UsageError(f"ps_gbps must be > 0 (math.inf for a free PS), got {ps_gbps}")
    if ps_shards < 1:
        raise UsageError(f"ps_shards must be >= 1, got {ps_shards}")
    if not plan.vws:
        raise UsageError("the plan has no virtual workers; allocate GPUs to at least one")
    _check_relays(relays, len(plan.vws))
    links = _Links(ps_gbps * ps_shards * 1e9 / 8, network)
    rule = get_aggregation(plan.aggregation or DEFAULT_AGGREGATION)  # "": a plan file from before, as "sum"
    run = _Run(plan, waves, links, pulls=needs_pulls(len(plan.vws), rule), relays=relays)
    run.run()
    makespan = max(max(e.end for e in run.events), run.last_landed)
    results = []
    for i, vw in enumerate(run.vws):
        done = vw.wave_done_s()
        finish = max(max(e.end for e in run.events if e.vw == i), max(done))
        wave_s = _steady_wave_s(done)
        samples = vw.plan.batch(plan.batch_size) * vw.schedule.num_minibatches
        results.append(VwResult(done, wave_s, samples / finish, finish, vw.gate_wait_s, vw.pull_s))
    total = sum(vw.plan.batch(plan.batch_size) * vw.schedule.num_minibatches for vw in run.vws)
    return SimResult(
        samples_per_s=total / makespan,
        makespan_s=makespan,
        ps_utilisation=links.utilisation(makespan),
        vws=tuple(results),
        gates=tuple(run.gates),
        events=tuple(run.events),
        ps_link=links.busiest(),
        link_bytes=links.moved(),
    )


def _check_relays(relays: Sequence[Relay], num_vws: int) -> None:
    """Each relayed VW is one of the plan's, in one group only."""
    seen = [v for relay in relays for v in relay.vws]
    if len(set(seen)) != len(seen) or any(not 0 <= v < num_vws for v in seen):
        raise UsageError(
            f"relays {[relay.vws for relay in relays]} must name each of the plan's {num_vws} VWs at most "
            "once; build them with hetpipe.core.planning.relays.plan_relays from the same plan"
        )


def _steady_wave_s(done: Sequence[float]) -> float:
    """Mean gap between wave completions, leaving out wave 0 (pipeline fill) and the last wave (drain)."""
    if len(done) >= 3:
        return (done[-2] - done[0]) / (len(done) - 2)
    return done[-1] - done[0] if len(done) == 2 else done[0]


# ---------------------------------------------------------------------------------------------- baselines


def simulate_allreduce(
    step_times: Sequence[float], param_bytes: float, allreduce_gbps: float, batch_size: int
) -> BaselineResult:
    """Synchronous data parallelism (Horovod): one model replica per GPU, each GPU one minibatch per step.

    `step_times[g]` is forward + backward of one minibatch on GPU g (a GPU that cannot hold the model
    does not belong in the list). A step waits for the slowest GPU, then a ring all-reduce moves
    2 (n-1)/n x param_bytes over the slowest link (`allreduce_gbps`).
    """
    if not step_times or any(not t > 0 for t in step_times):
        raise UsageError(f"step_times needs one time > 0 per GPU, got {list(step_times)}")
    if not allreduce_gbps > 0:
        raise UsageError(f"allreduce_gbps must be > 0, got {allreduce_gbps}")
    n = len(step_times)
    comm = 2 * (n - 1) / n * param_bytes / (allreduce_gbps * 1e9 / 8)
    step = max(step_times) + comm
    return BaselineResult("allreduce", n * batch_size / step, step, comm)


def simulate_sync_pipeline(vw: VwPlan, microbatches: int, batch_size: int) -> BaselineResult:
    """One synchronous pipeline (GPipe-like, 1F1B order) over the VW's GPUs with a flush per minibatch.

    The minibatch is cut into `microbatches` pieces; each stage's times (stage_times) are assumed
    to scale linearly, so a microbatch takes 1/m of them. The step is the simulated makespan of
    one wave of m in flight (hetpipe.core.pipeline.schedule.simulate), about (m + k - 1) x the bottleneck / m.
    One replica: no parameter synchronisation.
    """
    if microbatches < 1:
        raise UsageError(f"microbatches must be >= 1, got {microbatches}")
    forward, backward = stage_times(vw)
    schedule = flushing_schedule()(len(vw.stages), microbatches, 1, 0)
    timeline = simulate_schedule(
        schedule, [t / microbatches for t in forward], [t / microbatches for t in backward]
    )
    return BaselineResult("sync-pipeline", batch_size / timeline.makespan, timeline.makespan, 0.0)
