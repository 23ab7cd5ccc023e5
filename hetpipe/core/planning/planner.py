"""The planner's search (docs/planning.md): for every schedule and allocation policy, the virtual workers and
their splits and Nm (hetpipe.core.planning.groupings; per VW: per_vw_work), each D, its memory, its prediction
by the simulator and its share of the cluster's capacity, then the baselines. This module is the planner's
entry point: it also re-exports what callers use of the candidates, profile sources and output modules.
Pure."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from hetpipe.core.config.schema import WIRE_BYTES_PER_VALUE, ClusterConfig
from hetpipe.core.errors import UsageError
from hetpipe.core.pipeline.schedule import SCHEDULES, get_schedule
from hetpipe.core.planning.analytic import Relayed, least_wave_s
from hetpipe.core.planning.baselines import allreduce, baseline_bounds, sync_pipeline
from hetpipe.core.planning.candidates import (
    ALLREDUCE,
    D_TOLERANCE,
    SYNC_PIPELINE,
    Candidate,
    GpuUse,
    best,
    gpu_uses,
    own_lag,
    ranked,
    slowest_stage_text,
)
from hetpipe.core.planning.capacity import PsFigures, plan_bounds, standalone_rates
from hetpipe.core.planning.freeze_gain import frozen_plan, frozen_profiles
from hetpipe.core.planning.groupings import Grouping, GroupingSearch
from hetpipe.core.planning.headroom import HEADROOM, with_headroom
from hetpipe.core.planning.memory import format_bytes
from hetpipe.core.planning.partition import minibatch_time_s
from hetpipe.core.planning.per_vw_work import PerVwWork
from hetpipe.core.planning.plan import Plan, VwPlan
from hetpipe.core.planning.profile import ModelProfile
from hetpipe.core.planning.profile_sources import (
    check_profiles,
    derived_profiles,
    emulated_profiles,
    supplied_profiles,
)
from hetpipe.core.planning.relays import Relay, plan_relays, ps_bytes_per_wave
from hetpipe.core.planning.report import candidates_json, explain, format_plan, format_table
from hetpipe.core.planning.simulate import PsNetwork, simulate
from hetpipe.core.protocol.placement import spread_layers
from hetpipe.core.wsp.aggregation import DEFAULT_AGGREGATION, get_aggregation, needs_pulls

__all__ = [
    "ALLREDUCE",
    "D_TOLERANCE",
    "D_VALUES",
    "EMULATED_P2P_GBPS",
    "EMULATED_PS_GBPS",
    "SYNC_PIPELINE",
    "Candidate",
    "GpuUse",
    "best",
    "candidates_json",
    "derived_profiles",
    "emulated_profiles",
    "explain",
    "format_plan",
    "format_table",
    "own_lag",
    "plan_candidates",
    "ranked",
    "search_space",
    "supplied_profiles",
]

D_VALUES = (0, 1, 2, 4)
# Under emulation every "link" is this machine's loopback (docs/emulation.md#measured-limits): gloo send/recv
# ~3.4 GB/s between stages, ZeroMQ ~4.5 GB/s to the PS. The runtime does not stretch transfers.
EMULATED_P2P_GBPS = 27.0
EMULATED_PS_GBPS = 36.0


@dataclass(frozen=True)
class _Prediction:
    """How each candidate is predicted: simulated for `waves` waves over the PS's links; measured against the
    GPUs' standalone rates (capacity.standalone_rates), naming what bounds it over the GPUs' links."""

    waves: int
    ps_gbps: float  # each shard's link as float32 weights see it: its Gbit/s / `wire`
    shards: int
    network: PsNetwork | None  # the nodes' links, likewise
    rates: Mapping[str, float] = dataclasses.field(default_factory=dict)
    link: Callable[[str, str], float] | None = None
    wire: float = 1.0  # bytes on the PS's wire per byte of float32 weights ([ps] wire_dtype)
    node_aggregation: bool = False  # [ps] node_aggregation: relayed groups priced (relays.py)
    # without a PsNetwork, each node's inside link as float32 weights see it (a relay's stages cross it)
    inside_gbps: Mapping[str, float] = dataclasses.field(default_factory=dict)

    @classmethod
    def of(
        cls,
        config: ClusterConfig,
        waves: int,
        ps_gbps: float,
        network: PsNetwork | None,
        rates: Mapping[str, float],
        link: Callable[[str, str], float] | None,
    ) -> _Prediction:
        """With [ps] wire_dtype = "bfloat16" the weights cross every PS link in half the bytes: each link is
        counted at twice its Gbit/s for them (the packing, 1-2 GB/s on one CPU core, is not priced: it pays
        where the links are slower than that; BatchNorm buffers, sent as float32, are counted as packed).

        With [ps] node_aggregation each relayed group (relays.py) pushes and pulls one copy of the weights
        over the PS's links per wave, and its stages' traffic to and from the relay crosses their node's
        inside link: the PsNetwork's loopback, else the link between two GPUs of the node (`link`, else
        [network] intra_node_gbps)."""
        wire = WIRE_BYTES_PER_VALUE[config.ps.wire_dtype] / WIRE_BYTES_PER_VALUE["float32"]
        if network is not None and wire != 1.0:
            network = dataclasses.replace(
                network,
                egress_gbps={k: v / wire for k, v in network.egress_gbps.items()},
                inside_gbps={k: v / wire for k, v in network.inside_gbps.items()},
            )
        inside = {}
        if config.ps.node_aggregation:
            for node in config.nodes:
                gbps = link(f"{node.name}:0", f"{node.name}:1") if link else config.network.intra_node_gbps
                inside[node.name] = gbps / wire
        return cls(
            waves,
            ps_gbps / wire,
            config.ps.shards,
            network,
            rates,
            link,
            wire,
            config.ps.node_aggregation,
            inside,
        )

    def slowed(self, factor: float) -> _Prediction:
        """The same prediction with every PS link (the shards', the nodes' and their inside links) at `factor`
        x its speed."""
        network = self.network
        if network is not None:
            network = dataclasses.replace(
                network,
                egress_gbps={k: v * factor for k, v in network.egress_gbps.items()},
                inside_gbps={k: v * factor for k, v in network.inside_gbps.items()},
            )
        inside = {k: v * factor for k, v in self.inside_gbps.items()}
        return dataclasses.replace(self, ps_gbps=self.ps_gbps * factor, network=network, inside_gbps=inside)

    @property
    def ps_bytes_per_s(self) -> float:
        """All shards' links together, in float32 bytes of weights per second."""
        return self.ps_gbps * self.shards * 1e9 / 8

    def ps_figures(
        self,
        utilisation: float,
        link: str,
        float32_bytes: float,
        wave_s: float,
        plan: Plan | None = None,
        relays: Sequence[Relay] = (),
    ) -> PsFigures:
        """What the report says of the PS: its links at their own Gbit/s, the bytes on the wire (with node
        aggregation, a relayed group's once over the PS's links, and each relay's over its node's inside
        link)."""
        if not relays or plan is None:
            return PsFigures(
                self.ps_gbps * self.wire, self.shards, utilisation, link, float32_bytes * self.wire, wave_s
            )
        per_pass = 2 if _pulls(plan) else 1
        inside = tuple(sum(plan.vws[v].param_bytes for v in r.vws) * per_pass * self.wire for r in relays)
        return PsFigures(
            self.ps_gbps * self.wire,
            self.shards,
            utilisation,
            link,
            float32_bytes * self.wire,
            wave_s,
            tuple(relays),
            inside,
        )

    def relays(self, plan: Plan) -> tuple[Relay, ...]:
        """The plan's relayed groups under [ps] node_aggregation (none when it is off), each with its node's
        inside link as weights see it."""
        if not self.node_aggregation:
            return ()
        network = self.network
        inside = network.inside_gbps if network is not None else self.inside_gbps
        return plan_relays([vw.gpus for vw in plan.vws], True, lambda node: inside.get(node, float("inf")))

    def relayed(self, relays: Sequence[Relay]) -> tuple[Relayed, ...]:
        """The relays for the steady-state model of a plan's VWs one by one (kind v = VW v); a PsNetwork's
        links are capped by the PS's rate, as the simulator caps them."""
        cap = self.ps_bytes_per_s if self.network is not None else float("inf")
        return tuple(Relayed(r.vws, min(cap, r.inside_gbps * 1e9 / 8)) for r in relays)


def plan_candidates(
    config: ClusterConfig,
    profiles_by_type: Mapping[str, ModelProfile],
    *,
    ps_gbps: float,
    d_values: Iterable[int] = D_VALUES,
    link_gbps: Callable[[str, str], float] | None = None,
    policies: Sequence[str] | None = None,
    nm_max: int | None = None,
    waves: int = 10,
    reserve_bytes: int = 0,
    baselines: bool = True,
    schedules: Sequence[str] | None = None,
    slower_but_fewer: bool = False,
    ps_network: PsNetwork | None = None,
    progress: Callable[[str], None] | None = None,
    frozen_layers: int = 0,
) -> list[Candidate]:
    """Every candidate plan for `config` with its prediction, then the baselines (docs/planning.md).

    For each allocation policy (np, ed, hd, dp; explicit when the config lists VWs) each VW gets its GPU
    order, split and Nm from the partitioner (Nm up to `nm_max`, default the schedule's nm_cap: max(config's
    nm, the largest VW)). Then two kinds of grouping: one common Nm among those the VWs chose (the one with
    the highest n_vws x slowest-VW rate, larger on ties), the others re-split at it; and per-VW work
    (hetpipe.core.planning.per_vw_work: each VW its own Nm and minibatch size, so that the waves take about as
    long). A VW whose GPUs cannot hold the model is left out, with a note; a policy none of whose VWs fit is
    infeasible. Every candidate carries the cluster's capacity (hetpipe.core.planning.capacity) and, below
    90% of it, what bounds it. Each such grouping is simulated for every D in `d_values` (and the config's D)
    for `waves` waves. All of this for each schedule of `schedules` (default: the config's train.schedule
    first, then the other registered schedules the planner searches); a schedule changes both the partition
    (what a stage keeps: hetpipe.core.planning.memory) and the time. `slower_but_fewer`: for a ranking by
    time to target, also what trades samples/s for samples to target: each grouping with Nm capped below the
    one it chose, and with only its fastest 1, 2, ... VWs (less staleness and a smaller global batch);
    groupings that come out the same are planned once. `frozen_layers` > 0: a re-plan at a freeze point, the
    model's first layers frozen from the start (docs/planning.md#re-planning).

    `ps_gbps`: bandwidth of each PS shard's link (config.ps.shards of them); `link_gbps(a, b)`: between two
    GPUs (default: NetworkConfig.link_gbps of [network]); `ps_network`: the nodes' own links the PS traffic
    crosses (hetpipe.core.planning.simulate.PsNetwork, e.g. the testbed's), each capped by the PS's rate;
    None: one link for all. `progress` gets a line after every candidate (the caller limits how often it
    prints). With [ps] placement = "local" each layer's shard is on the node where the plan's
    first VW runs it. The baselines: ALLREDUCE over the GPUs whose memory holds the whole model, SYNC_PIPELINE
    over all GPUs (at most one per layer, fastest first).
    """
    check_profiles(config, profiles_by_type)
    ds = _d_values(d_values, config.wsp.staleness, waves)
    if frozen_layers:  # a re-plan: the model's first layers frozen (docs/planning.md#re-planning)
        profiles_by_type = frozen_profiles(profiles_by_type, frozen_layers)
    search = GroupingSearch(
        config, profiles_by_type, link_gbps or config.network.link_gbps, reserve_bytes, frozen_layers
    )
    rates = standalone_rates(config, profiles_by_type)
    how = _Prediction.of(
        config, waves, ps_gbps, spread_network(config, search, ps_network), rates, search.link
    )
    work = PerVwWork(search, how.ps_bytes_per_s, how.network)
    out: list[Candidate] = []
    for schedule in _schedules(config, schedules):
        for policy in _policies(config, policies):
            grouping = search.grouping(policy, nm_max, schedule)
            if isinstance(grouping, str):
                out.append(Candidate(policy, None, None, 0.0, reason=grouping, schedule=schedule))
                continue
            groupings = (
                search.slower_but_fewer(grouping, policy, schedule)
                if slower_but_fewer
                else search.fewer([grouping], schedule)
            )
            fitted = search.fit(policy, nm_max, schedule)
            # per-VW work sizes each VW's wave for one D (its memory, the gate's round trip): planned at it
            planned = [(g, d) for g in groupings for d in ds]
            planned += [(g, d) for d in ds for g in work.groupings(fitted, d)]  # type: ignore[arg-type]
            for found, d in _distinct(planned):
                out.append(_candidate(search, policy, schedule, found, d, how))
                if progress is not None:
                    progress(f"plan: {len(out)} candidates planned and simulated ({schedule} {policy})")
    if baselines:
        out += [baseline_bounds(c, rates) for c in (allreduce(search), sync_pipeline(search))]
    capacity = sum(rates.values())
    return [dataclasses.replace(c, capacity=capacity) for c in tie_broken(out, search, how)]


def tie_broken(
    candidates: list[Candidate], search: GroupingSearch, how: _Prediction, max_stages: float = math.inf
) -> list[Candidate]:
    """headroom.with_headroom: the candidates tied with the best predicted again with every PS link at
    HEADROOM x its speed (when none has more than `max_stages` stages)."""
    slow = how.slowed(HEADROOM)

    def rate(c: Candidate) -> float:
        assert c.plan is not None  # tied with the best: runnable
        return _placed_prediction(search, c.plan, c.notes, slow).samples_per_s

    return with_headroom(candidates, rate, max_stages)


def _distinct(planned: list[tuple[Grouping, int]]) -> list[tuple[Grouping, int]]:
    """Each distinct set of VWs once at each D, the first listed kept."""
    out: list[tuple[Grouping, int]] = []
    for (vws, notes), d in planned:
        if all(vws != seen or d != seen_d for (seen, _), seen_d in out):
            out.append(((vws, notes), d))
    return out


def _d_values(d_values: Iterable[int], config_d: int, waves: int) -> list[int]:
    """The D values to plan (the config's among them), checked, with the waves to simulate."""
    ds = sorted({*d_values, config_d})
    if any(isinstance(d, bool) or not isinstance(d, int) or d < 0 for d in ds):
        raise UsageError(f"staleness values must be integers >= 0, got {ds}")
    if isinstance(waves, bool) or not isinstance(waves, int) or waves < 1:
        raise UsageError(f"waves must be an integer >= 1, got {waves!r}")
    return ds


def search_space(
    config: ClusterConfig,
    policies: Sequence[str] | None,
    schedules: Sequence[str] | None,
    d_values: Iterable[int],
    waves: int,
) -> tuple[list[str], list[str], list[int]]:
    """The policies, schedules and D values plan_candidates and the fast search plan for these arguments."""
    return (
        _policies(config, policies),
        _schedules(config, schedules),
        _d_values(d_values, config.wsp.staleness, waves),
    )


def _schedules(config: ClusterConfig, schedules: Sequence[str] | None) -> list[str]:
    """The schedules to plan: those asked for, else the config's first, then every other registered schedule
    the planner searches (ScheduleKind.searched)."""
    if schedules is not None:
        return list(schedules)
    mine = config.train.schedule
    return [mine, *(name for name, kind in SCHEDULES.items() if kind.searched and name != mine)]


def _policies(config: ClusterConfig, policies: Sequence[str] | None) -> list[str]:
    if policies is not None:
        return list(policies)
    return ["np", "ed", "hd", "dp"] + (["explicit"] if config.virtual_workers else [])


def _candidate(
    search: GroupingSearch, policy: str, schedule: str, grouping: Grouping, d: int, how: _Prediction
) -> Candidate:
    """One grouping at one D: infeasible when a stage's memory at that D is over its GPU's, else predicted."""
    config = search.config
    vws, notes = grouping
    rule = search.rule(schedule, d, len(vws))
    sized = tuple(search.with_memory(vw, rule) for vw in vws)
    over = [
        (v, j, st)
        for v, vw in enumerate(sized)
        for j, st in enumerate(vw.stages)
        if st.memory_bytes > st.memory_limit_bytes
    ]
    if over:
        v, j, st = over[0]
        reason = (
            f"{schedule} with D={d} (a stage keeps {d + 2 if rule.pulls else 2} update sums): "
            f"vw{v} stage {j} on {st.gpu} ({st.gpu_type}) needs {format_bytes(st.memory_bytes)} of "
            f"{format_bytes(st.memory_limit_bytes)}"
        )
        return Candidate(policy, d, None, 0.0, reason=reason, schedule=schedule)
    plan = Plan(
        policy,
        search.any_profile.model,
        config.train.batch_size,
        d,
        sized,
        placement=config.ps.placement,
        schedule=schedule,
        recompute=config.train.recompute and get_schedule(schedule).recompute,
        aggregation=config.ps.aggregation,
        mitigation=config.train.mitigation,
    )
    if search.frozen:  # a re-plan's candidate: its frozen layers' weights stay off the wire
        plan = frozen_plan(plan, search.profiles, search.frozen)
    candidate = _placed_prediction(search, plan, notes, how)
    if config.train.freeze and not search.frozen:
        candidate = dataclasses.replace(
            candidate,
            after_freeze=_after_freeze(search, plan, how),
            cached_after_freeze=_after_freeze(search, plan, how, cached=True)
            if config.train.freeze_cache_mib
            else (),
        )
    return candidate


def _placed_prediction(
    search: GroupingSearch, plan: Plan, notes: tuple[str, ...], how: _Prediction
) -> Candidate:
    """_predict, with placement "local" putting each layer's shard where the plan's first VW runs it."""
    network = how.network
    if network is not None and search.config.ps.placement == "local":
        network = dataclasses.replace(
            network,
            layer_nodes=_layer_nodes(plan.vws[0]),
            layer_bytes=tuple(float(layer.param_bytes) for layer in search.any_profile.layers),
        )
    return _predict(plan, notes, dataclasses.replace(how, network=network))


def _after_freeze(
    search: GroupingSearch, plan: Plan, how: _Prediction, cached: bool = False
) -> tuple[tuple[int, int, float], ...]:
    """(wave, frozen layers, samples/s predicted) at each of [train] freeze's points: the same plan with
    those layers frozen (hetpipe.core.planning.freeze_gain); `cached`: their outputs from the frozen layers'
    cache too."""
    return tuple(
        (
            wave,
            layers,
            _placed_prediction(
                search, frozen_plan(plan, search.profiles, layers, cached), (), how
            ).samples_per_s,
        )
        for wave, layers in search.config.train.freeze
    )


def spread_network(
    config: ClusterConfig, search: GroupingSearch, network: PsNetwork | None
) -> PsNetwork | None:
    """`network` with each layer's shard on its node under placement "spread" (spread_layers of the profile's
    weights, as the runtime deals them; shard i on node i); as it is otherwise."""
    if network is None or config.ps.placement != "spread":
        return network
    layer_bytes = [layer.param_bytes for layer in search.any_profile.layers]
    shards = spread_layers(layer_bytes, len(config.nodes))
    return dataclasses.replace(
        network,
        layer_nodes=tuple(config.nodes[shard].name for shard in shards),
        layer_bytes=tuple(float(b) for b in layer_bytes),
    )


def _layer_nodes(vw: VwPlan) -> tuple[str, ...]:
    """The node of each layer's shard under placement "local": where the first VW runs it."""
    return tuple(stage.gpu.rsplit(":", 1)[0] for stage in vw.stages for _ in range(stage.start, stage.stop))


def _predict(plan: Plan, notes: tuple[str, ...], how: _Prediction) -> Candidate:
    """Simulate `how.waves` waves; the prediction is the long run: every VW at the slowest VW's steady wave
    time (WSP keeps any VW within D + 1 waves of the slowest), fill and drain left out."""
    relays = how.relays(plan)
    result = simulate(
        plan,
        waves=how.waves,
        ps_gbps=how.ps_gbps,
        ps_shards=how.shards,
        network=how.network,
        relays=relays,
    )
    # The simulated gaps can come out under what the long run allows (analytic.least_wave_s): while the
    # first waves' queue on the PS link drains, the gaps grow for a few waves (3% on uneven-14gpu.toml's
    # best at 10 waves, 0.3% at 80). The long run is the larger.
    floor = least_wave_s(
        [(vw, 1) for vw in plan.vws],
        plan.schedule,
        plan.recompute,
        _pulls(plan),
        how.ps_bytes_per_s,
        how.relayed(relays),
    )
    per_wave = max(max(r.wave_s for r in result.vws), floor)
    samples = sum(vw.nm * vw.batch(plan.batch_size) for vw in plan.vws)  # one wave of every VW
    steady = samples / per_wave if per_wave > 0 else result.samples_per_s
    uses = tuple(u for vw in plan.vws for u in gpu_uses(vw))
    busy = sum(s.time_s * vw.nm for vw in plan.vws for s in vw.stages) * how.waves
    gate = sum(r.gate_wait_s for r in result.vws)
    slow = max(
        range(len(plan.vws)),
        key=lambda v: plan.vws[v].nm * minibatch_time_s(plan.vws[v], plan.schedule, plan.recompute),
    )
    bottleneck = slowest_stage_text(plan.vws[slow], slow, "vw")
    if result.ps_utilisation > 0.9:
        bottleneck = f"PS link ({result.ps_utilisation:.0%} busy); then {bottleneck}"
    moved = ps_bytes_per_wave(plan.vws, relays, _pulls(plan))
    ps = how.ps_figures(result.ps_utilisation, result.ps_link, moved, per_wave, plan, relays)
    bounds = plan_bounds(plan, steady, how.rates, notes, ps, how.link) if how.link and how.rates else ()
    return Candidate(
        plan.policy,
        plan.staleness,
        plan,
        steady,
        uses,
        bottleneck,
        notes=notes,
        nm=max(vw.nm for vw in plan.vws),
        gate_wait_share=gate / max(busy + gate, 1e-12),
        ps_utilisation=result.ps_utilisation,
        run_samples_per_s=result.samples_per_s,
        schedule=plan.schedule,
        bounds=bounds,
        node_aggregation=how.node_aggregation,
        relayed=tuple(r.vws for r in relays),
    )


def _pulls(plan: Plan) -> bool:
    """Whether the plan's VWs pull every wave (hetpipe.core.wsp.aggregation.needs_pulls)."""
    return needs_pulls(len(plan.vws), get_aggregation(plan.aggregation or DEFAULT_AGGREGATION))
