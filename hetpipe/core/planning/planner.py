"""The planner: allocation policy x GPU order/partition/Nm x D, each plan predicted by the simulator, plus the
baselines. Pure."""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from hetpipe.core.config import ClusterConfig, GpuRef
from hetpipe.core.errors import HetpipeError, UsageError
from hetpipe.core.hardware.emulate import auto_time_scale, gpu_speeds
from hetpipe.core.pipeline.schedule import get_schedule
from hetpipe.core.planning.memory import PLAIN, MemoryRule, format_bytes, stage_memory_terms
from hetpipe.core.planning.partition import Gpu, best_order_and_nm, minibatch_time_s, partition
from hetpipe.core.planning.plan import Plan, VwPlan
from hetpipe.core.planning.profile import ModelProfile, derive_profile
from hetpipe.core.planning.simulate import PsNetwork, simulate, simulate_allreduce, simulate_sync_pipeline

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
    "supplied_profiles",
]

D_VALUES = (0, 1, 2, 4)
SCHEDULES = (
    "wsp",
    "pipedream",
    "pipedream-2bw",
    "1f1b-flush",
    "gpipe",
)  # every schedule the runtime has (hetpipe.core.pipeline.schedule)
D_TOLERANCE = 0.02  # a larger D must predict more than 2% more samples/s to be chosen over a smaller one
ALLREDUCE = (
    "allreduce"  # baseline: Horovod/DDP-style data parallelism over the GPUs that hold the whole model
)
SYNC_PIPELINE = "sync-pipeline"  # baseline: one GPipe-like pipeline over all GPUs, flushed every minibatch
# Under emulation every "link" is this machine's loopback (docs/emulation.md#measured-limits): gloo send/recv
# ~3.4 GB/s between stages, ZeroMQ ~4.5 GB/s to the PS. The runtime does not stretch transfers.
EMULATED_P2P_GBPS = 27.0
EMULATED_PS_GBPS = 36.0
_GIB = 2**30


# ---------------------------------------------------------------------------------------------- results


@dataclass(frozen=True)
class GpuUse:
    """One GPU in a candidate: its peak memory by the memory model of docs/memory.md and what it may use."""

    gpu: str  # "n0:1"
    gpu_type: str
    memory_bytes: int
    limit_bytes: int  # the GPU's memory minus the reserve

    @property
    def fraction(self) -> float:
        return self.memory_bytes / max(self.limit_bytes, 1)


@dataclass(frozen=True)
class Candidate:
    """One way to train on the cluster, with its predicted throughput; `reason` says why it cannot run.

    HetPipe candidates (policy np/ed/hd/explicit) carry the Plan `hetpipe train --plan` runs; the
    baselines (ALLREDUCE, SYNC_PIPELINE) carry none: they show what the user would get instead.
    """

    policy: str
    staleness: int | None  # D; None for the synchronous baselines and for a policy that makes no VWs
    plan: Plan | None
    samples_per_s: float  # predicted for a long run; 0.0 when infeasible
    memory: tuple[GpuUse, ...] = ()
    bottleneck: str = ""  # the stage (or link) that sets the pace
    reason: str = ""  # why it cannot run; "" when it can
    notes: tuple[str, ...] = ()  # what was left out and other facts the table cannot show
    nm: int | None = None
    gate_wait_share: float = 0.0  # WSP: share of stage time blocked at the gate
    ps_utilisation: float = 0.0  # WSP: busy share of the PS link
    comm_share: float = 0.0  # baselines: share of the step spent synchronising
    run_samples_per_s: float = (
        0.0  # WSP: all samples / makespan of the simulated run (fill and drain included)
    )
    schedule: str | None = None  # the pipeline schedule of a hetpipe candidate
    # Samples to the convergence calibration's target (hetpipe.core.planning.convergence.attach_samples): None
    # when not known or not reached; `samples_source` says where the number comes from ("" when no calibration
    # was given).
    samples_to_target: float | None = None
    samples_source: str = ""

    @property
    def feasible(self) -> bool:
        return not self.reason

    @property
    def runnable(self) -> bool:
        """A plan `hetpipe train --plan` can run."""
        return self.feasible and self.plan is not None

    @property
    def label(self) -> str:
        if self.staleness is None:
            return self.policy
        return (
            f"{self.policy} {self.schedule} D={self.staleness}"
            if self.schedule
            else f"{self.policy} D={self.staleness}"
        )

    @property
    def gpus_used(self) -> int:
        return len(self.memory)

    @property
    def time_to_target_s(self) -> float | None:
        """Predicted seconds to the calibration's target: samples to target / samples/s (None when
        unknown)."""
        if self.samples_to_target is None or not self.samples_per_s > 0:
            return None
        return self.samples_to_target / self.samples_per_s

    @property
    def peak(self) -> GpuUse | None:
        """The fullest GPU (largest share of its usable memory)."""
        return max(self.memory, key=lambda u: (u.fraction, u.gpu), default=None)


# ---------------------------------------------------------------------------------------------- profiles


def emulated_profiles(
    config: ClusterConfig, cpu_profile: ModelProfile, cores: int
) -> dict[str, ModelProfile]:
    """Every GPU type's profile under emulation: the CPU's times x the type's slowdown
    (hetpipe.core.hardware.emulate.slowdowns).

    The slowdown is (fastest speed / the type's speed) x time_scale, time_scale from [emulation] or, for
    "auto", auto_time_scale over all the cluster's GPUs (the runtime uses the GPUs of the run's VWs: the same
    set when a plan uses every GPU). So predictions are in wall seconds of `hetpipe train` on this machine.
    Times are also x the profile's origin.emulation_cost: what a whole step costs an emulated device in CPU
    time beyond the layer-by-layer profile (docs/emulation.md#what-dilation-costs).
    """

    speeds = gpu_speeds(config)
    time_scale = config.emulation.time_scale or auto_time_scale(speeds, cores)
    fastest = max(speeds.values())
    used = {config.gpu(ref).name for ref in config.all_gpus()}
    cost = cpu_profile.origin.emulation_cost if cpu_profile.origin is not None else 1.0
    return {
        name: derive_profile(cpu_profile, t.speed, fastest, time_scale * cost, gpu_type=name)
        for name, t in config.gpu_types.items()
        if name in used
    }


def supplied_profiles(
    config: ClusterConfig, found: Mapping[str, ModelProfile]
) -> tuple[dict[str, ModelProfile], list[str]]:
    """Profiles for real GPUs: `found` (type -> measured profile) completed by speed ratio for the missing
    types.

    A missing type's times are those of the fastest type that has a profile x (its speed / missing speed),
    memory sizes unchanged; the notes say which were scaled. UsageError when no type has a profile.
    """
    used = _used_types(config)
    have = [name for name in used if name in found]
    if not have:
        raise UsageError(
            f"no profile of {config.model.name} at batch {config.train.batch_size} for any GPU type of "
            f"{config.path} ({', '.join(used)}): on a machine with one of them run "
            f"`hetpipe profile {config.model.name} --batch {config.train.batch_size} --gpu-type {used[0]} "
            f"--device cuda --out DIR/{used[0]}.json` and pass "
            "--profile-dir DIR, or derive one here from a CPU profile: `hetpipe profile ... --gpu-type "
            f"{used[0]} --like cpu --speed RATIO` (RATIO: its FLOP rate over this CPU's); "
            "types without a profile are scaled from one that has it by speed"
        )
    source = max(have, key=lambda name: (config.gpu_types[name].speed, name))
    profiles, notes = {}, []
    for name in used:
        if name in found:
            profiles[name] = found[name]
        else:
            profiles[name] = derive_profile(
                found[source],
                config.gpu_types[name].speed,
                config.gpu_types[source].speed,
                1.0,
                gpu_type=name,
            )
            notes.append(
                f"{name}: no profile given, times scaled from {source} by speed "
                f"{config.gpu_types[source].speed:g}/{config.gpu_types[name].speed:g}"
            )
    return profiles, notes


def derived_profiles(
    config: ClusterConfig, measured: ModelProfile
) -> tuple[dict[str, ModelProfile], list[str]]:
    """Profiles for real GPUs none of which was measured: each type's derived from `measured` (another device)
    by FLOP rate, reading the type's `speed` as its TFLOPS: times x measured.origin.device_tflops / speed,
    memory sizes unchanged (derive_profile). UsageError when `measured` does not record its device's rate.
    """
    origin = measured.origin
    if origin is None or not origin.device_tflops > 0:
        raise UsageError(
            f"the {measured.gpu_type} profile of {measured.model} does not record its device's FLOP rate "
            "(origin.device_tflops): measure it again with `hetpipe profile`"
        )
    used = _used_types(config)
    profiles = {
        name: derive_profile(measured, config.gpu_types[name].speed, origin.device_tflops, 1.0, gpu_type=name)
        for name in used
    }
    speeds = ", ".join(f"{name} {config.gpu_types[name].speed:g}" for name in used)
    note = (
        f"{', '.join(used)}: no profile measured on them; derived from a {origin.device} profile "
        f"({origin.device_name}, {origin.device_tflops:.3g} TFLOPS by its matmul) by FLOP rate, times x "
        f"{origin.device_tflops:.3g} / speed read as TFLOPS ({speeds}), memory unchanged: the predictions' "
        "ratios mean more than their values"
    )
    return profiles, [note]


def _used_types(config: ClusterConfig) -> list[str]:
    """The GPU types some node has, in [gpu_types] order."""
    return [name for name in config.gpu_types if any(name in node.gpus for node in config.nodes)]


# ---------------------------------------------------------------------------------------------- search


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
) -> list[Candidate]:
    """Every candidate plan for `config` with its prediction, then the baselines (docs/planning.md).

    For each allocation policy (np, ed, hd, dp; explicit when the config lists VWs) each VW gets its GPU
    order, split and Nm from the partitioner (Nm up to `nm_max`, default max(config's nm, the largest VW)).
    The runtime runs one Nm for all VWs, so the planner then picks one common Nm among those the VWs chose
    (the one with the highest n_vws x slowest-VW rate, larger on ties) and re-splits the others at it. A VW
    whose GPUs cannot hold the model is left out, with a note; a policy none of whose VWs fit is infeasible.
    Each such grouping is simulated for every D in `d_values` (and the config's D) for `waves` waves. All of
    this for each schedule of `schedules` (default: the config's train.schedule first, then the others of
    SCHEDULES); a schedule changes both the partition (what a stage keeps: hetpipe.core.planning.memory) and
    the time. `slower_but_fewer`: for a ranking by time to target, also what trades samples/s for samples to
    target: each grouping with Nm capped below the one it chose, and with only its fastest 1, 2, ... VWs (less
    staleness and a smaller global batch); groupings that come out the same are planned once.

    `ps_gbps`: bandwidth of each PS shard's link (config.ps.shards of them); `link_gbps(a, b)`: between two
    GPUs (default: NetworkConfig.link_gbps of [network]); `ps_network`: the nodes' own links the PS traffic
    crosses (hetpipe.core.planning.simulate.PsNetwork, e.g. the testbed's), each capped by the PS's rate;
    None: one link for all. With [ps] placement = "local" each layer's shard is on the node where the plan's
    first VW runs it. The baselines: ALLREDUCE over the GPUs whose memory holds the whole model, SYNC_PIPELINE
    over all GPUs (at most one per layer, fastest first).
    """
    batch = config.train.batch_size
    _check_profiles(config, profiles_by_type)
    link = link_gbps or config.network.link_gbps
    names = (
        list(policies)
        if policies is not None
        else ["np", "ed", "hd", "dp"] + (["explicit"] if config.virtual_workers else [])
    )
    ds = sorted({*d_values, config.wsp.staleness})
    if any(isinstance(d, bool) or not isinstance(d, int) or d < 0 for d in ds):
        raise UsageError(f"staleness values must be integers >= 0, got {ds}")
    if isinstance(waves, bool) or not isinstance(waves, int) or waves < 1:
        raise UsageError(f"waves must be an integer >= 1, got {waves!r}")
    wanted = (
        list(schedules)
        if schedules is not None
        else [config.train.schedule, *(n for n in SCHEDULES if n != config.train.schedule)]
    )
    search = _Search(config, profiles_by_type, link, reserve_bytes)
    server = config.ps.aggregation == "server"
    out: list[Candidate] = []
    for schedule in wanted:
        for policy in names:
            grouping = search.grouping(policy, nm_max, schedule)
            if isinstance(grouping, str):
                out.append(Candidate(policy, None, None, 0.0, reason=grouping, schedule=schedule))
                continue
            groupings = (
                search.slower_but_fewer(grouping, policy, schedule)
                if slower_but_fewer
                else search.fewer([grouping], schedule)
            )
            recompute = config.train.recompute and schedule in ("1f1b-flush", "gpipe")
            for (vws, notes), d in itertools.product(groupings, ds):
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
                    out.append(
                        Candidate(
                            policy,
                            d,
                            None,
                            0.0,
                            reason=(
                                f"{schedule} with D={d} (a stage keeps "
                                f"{d + 2 if rule.pulls else 2} update sums): vw{v} stage {j} "
                                f"on {st.gpu} ({st.gpu_type}) "
                                f"needs {format_bytes(st.memory_bytes)} of "
                                f"{format_bytes(st.memory_limit_bytes)}"
                            ),
                            schedule=schedule,
                        )
                    )
                    continue
                plan = Plan(
                    policy,
                    search.any_profile.model,
                    batch,
                    d,
                    sized,
                    placement=config.ps.placement,
                    schedule=schedule,
                    recompute=recompute,
                    aggregation=config.ps.aggregation,
                    mitigation=config.train.mitigation,
                )
                network = ps_network
                if network is not None and config.ps.placement == "local":
                    network = dataclasses.replace(
                        network,
                        layer_nodes=_layer_nodes(sized[0]),
                        layer_bytes=tuple(float(layer.param_bytes) for layer in search.any_profile.layers),
                    )
                out.append(_predict(plan, notes, waves, ps_gbps, config.ps.shards, server, network))
    if baselines:
        out.append(search.allreduce())
        out.append(search.sync_pipeline())
    return out


def best(candidates: Sequence[Candidate]) -> Candidate:
    """The runnable candidate with the shortest predicted time to target when the candidates carry samples to
    target (a convergence calibration, hetpipe.core.planning.convergence): samples to target / samples/s, ties
    to the smaller D, then the one listed first. Without one, the highest predicted samples/s; but staleness
    costs convergence, so among those within D_TOLERANCE of the highest the smallest D wins, then the least
    local staleness (own_lag), then the higher rate, then the one listed first.

    Baselines are not runnable by hetpipe, so they never win here; `explain` says when one predicts more.
    UsageError when nothing is runnable, with every reason.
    """
    runnable = [c for c in candidates if c.runnable]
    if not runnable:
        reasons = "\n".join(f"  {c.label}: {c.reason}" for c in candidates if c.reason)
        raise UsageError(
            f"no plan fits this cluster:\n{reasons}\n  lower batch_size, use a smaller model, "
            "or add GPUs with more memory"
        )
    timed = [c for c in runnable if c.time_to_target_s is not None]
    if timed:
        return min(timed, key=lambda c: (c.time_to_target_s, c.staleness or 0, candidates.index(c)))
    top = max(c.samples_per_s for c in runnable)
    close = [c for c in runnable if c.samples_per_s >= top * (1 - D_TOLERANCE)]
    return min(
        close, key=lambda c: (c.staleness or 0, own_lag(c.plan), -c.samples_per_s, candidates.index(c))
    )


def own_lag(plan: Plan | None) -> int:
    """A plan's local staleness: the own minibatches whose updates the forward of a wave's first minibatch
    misses at a VW's first stage, past the pipe's fill (wsp Nm - 1, pipedream min(Nm, k) - 1, pipedream-2bw
    Nm, the flushes 0), read off the schedule's lists; the most over the VWs (0 for a baseline)."""
    if plan is None:
        return 0
    kind = get_schedule(plan.schedule)
    return max(2 * vw.nm - 1 - kind(len(vw.stages), vw.nm, 3, 0).own_through(0, 2 * vw.nm) for vw in plan.vws)


def _check_profiles(config: ClusterConfig, profiles: Mapping[str, ModelProfile]) -> None:
    used = sorted({name for node in config.nodes for name in node.gpus})
    missing = [name for name in used if name not in profiles]
    if missing:
        raise UsageError(
            f"no profile for GPU type(s) {', '.join(missing)}: profile {config.model.name} on them "
            "(`hetpipe profile`) or scale one from another type"
        )
    first = profiles[used[0]]
    for name in used:
        p = profiles[name]
        if p.batch_size != config.train.batch_size:
            raise UsageError(
                f"the {name} profile is at batch {p.batch_size} but {config.path} trains at batch "
                f"{config.train.batch_size}: profile at batch {config.train.batch_size}"
            )
        if (p.model, p.num_layers) != (first.model, first.num_layers):
            raise UsageError(
                f"the {name} profile is {p.model} with {p.num_layers} layers, the {used[0]} one "
                f"{first.model} with {first.num_layers}: profile the same model on every type"
            )


class _Search:
    """The cluster's GPUs as the partitioner sees them, and the per-policy and baseline searches."""

    def __init__(
        self,
        config: ClusterConfig,
        profiles: Mapping[str, ModelProfile],
        link: Callable[[str, str], float],
        reserve: int,
    ) -> None:
        self.config, self.profiles, self.link, self.reserve = config, profiles, link, reserve
        self.batch = config.train.batch_size
        self.any_profile = profiles[
            config.nodes[0].gpus[0]
        ]  # the model's layers and sizes (same on every type)
        self.solved: dict[tuple, VwPlan | HetpipeError] = {}

    def gpu(self, ref: GpuRef) -> Gpu:
        t = self.config.gpu(ref)
        return (str(ref), t.name, int(t.memory_gib * _GIB))

    def links_of(self, gpus: Sequence[Gpu]) -> list[float]:
        return [self.link(a[0], b[0]) for a, b in zip(gpus, gpus[1:], strict=False)]

    def rule(self, schedule: str, staleness: int, num_vws: int) -> MemoryRule:
        """What the stages keep under `schedule` (memory), from the config's training and PS settings (Nm is
        set per candidate)."""
        return dataclasses.replace(
            MemoryRule.of(self.config, num_vws),
            nm=1,
            schedule=schedule,
            staleness=staleness,
            recompute=self.config.train.recompute and schedule in ("1f1b-flush", "gpipe"),
        )

    def with_memory(self, vw: VwPlan, rule: MemoryRule) -> VwPlan:
        """The VW's stages with their memory recomputed under `rule` (its D sets how many update sums a stage
        keeps), so every candidate shows the peak memory of its own D."""
        k = len(vw.stages)
        stages = []
        for j, s in enumerate(vw.stages):
            profile = self.profiles[s.gpu_type]
            act_in = profile.input_bytes if s.start == 0 else profile.layers[s.start - 1].output_bytes
            memory = stage_memory_terms(
                profile.layers[s.start : s.stop], j, k, rule.with_nm(vw.nm), input_bytes=act_in
            )
            stages.append(dataclasses.replace(s, memory_bytes=memory.total))
        return dataclasses.replace(vw, stages=tuple(stages))

    # -- HetPipe groupings

    def grouping(
        self, policy: str, nm_max: int | None, schedule: str = "wsp"
    ) -> tuple[tuple[VwPlan, ...], tuple[str, ...]] | str:
        """The VWs of `policy` at one common Nm under `schedule`, with notes; or why the policy cannot run."""
        from hetpipe.core.planning.cluster import allocate

        try:
            groups = allocate(self.config, policy)
        except UsageError as exc:
            return str(exc)
        rule = self.rule(schedule, self.config.wsp.staleness, len(groups))
        listed = self.config.virtual_workers if policy == "explicit" else None
        cap = nm_max if nm_max is not None else max(self.config.wsp.nm, max(len(g) for g in groups))
        fitted: list[tuple[int, list[Gpu], tuple[int, ...] | None, VwPlan]] = []
        left_out: list[str] = []
        for v, refs in enumerate(groups):
            gpus = [self.gpu(ref) for ref in refs]
            split = listed[v].layers if listed else None
            try:
                vw = self.fixed_order(gpus, cap, split, rule) if listed else self.best_order(gpus, cap, rule)
            except HetpipeError as exc:  # UsageError included: more GPUs than layers
                left_out.append(f"vw{v} ({_gpu_list(gpus)}) left out: {_first_line(exc)}")
                continue
            fitted.append((v, [next(g for g in gpus if g[0] == ref) for ref in vw.gpus], split, vw))
        if not fitted:
            return "no virtual worker of this policy can hold the model:\n    " + "\n    ".join(left_out)
        chosen: tuple[tuple[float, int], tuple[VwPlan, ...], list[str]] | None = None
        for nm in sorted({vw.nm for *_, vw in fitted}):
            vws, dropped = [], []
            for v, gpus, split, vw in fitted:
                if vw.nm == nm:
                    vws.append(vw)
                    continue
                try:
                    vws.append(
                        partition(
                            [self.profiles[g[1]] for g in gpus],
                            gpus,
                            self.links_of(gpus),
                            nm,
                            rule=rule,
                            reserve_bytes=self.reserve,
                            fixed_split=split,
                        )
                    )
                except HetpipeError as exc:
                    dropped.append(
                        f"vw{v} ({_gpu_list(gpus)}) left out: the others at nm={nm} without it predict "
                        f"more than with it at its nm={vw.nm}, and at nm={nm} {_first_line(exc)}"
                    )
            if not vws:
                continue
            slowest = max(minibatch_time_s(vw, schedule, rule.recompute) for vw in vws)
            score = (len(vws) * self.batch / slowest, nm)
            if chosen is None or score > chosen[0]:
                chosen = (score, tuple(vws), dropped)
        assert chosen is not None  # the smallest chosen nm always fits every VW that chose a larger one
        _, vws, dropped = chosen
        return tuple(self.with_params(vw) for vw in vws), tuple(left_out + dropped)

    def slower_but_fewer(
        self, grouping: tuple[tuple[VwPlan, ...], tuple[str, ...]], policy: str, schedule: str
    ) -> list[tuple[tuple[VwPlan, ...], tuple[str, ...]]]:
        """`grouping`, then the policy's groupings at every smaller Nm cap, then each of these with only its
        fastest 1, 2, ... VWs (plan_candidates' slower_but_fewer); each distinct set of VWs once."""
        out = [grouping]
        for cap in range(grouping[0][0].nm - 1, 0, -1):
            found = self.grouping(policy, cap, schedule)  # cap < the chosen Nm <= nm_max
            if not isinstance(found, str):
                out.append(found)
        return self.fewer(out, schedule)

    def fewer(
        self, groupings: list[tuple[tuple[VwPlan, ...], tuple[str, ...]]], schedule: str
    ) -> list[tuple[tuple[VwPlan, ...], tuple[str, ...]]]:
        """`groupings`, then each with only its fastest 1, 2, ... VWs: under WSP every VW runs at the slowest
        one's wave rate and adds its own PS traffic, so leaving slow VWs out can give more samples/s (and,
        with a calibration, fewer samples to target); each distinct set of VWs once."""
        out = list(groupings)
        for vws, notes in groupings:
            fastest = sorted(vws, key=lambda vw: minibatch_time_s(vw, schedule))
            for k in range(1, len(vws)):
                kept = tuple(vw for vw in vws if vw in fastest[:k])
                out.append(
                    (
                        kept,
                        (
                            *notes,
                            f"only the {k} fastest of the policy's {len(vws)} VWs: WSP paces every VW "
                            "by the slowest, each sends its own PS traffic, and fewer VWs may need "
                            "fewer samples to target",
                        ),
                    )
                )
        distinct: list[tuple[tuple[VwPlan, ...], tuple[str, ...]]] = []
        for vws, notes in out:
            if all(vws != seen for seen, _ in distinct):
                distinct.append((vws, notes))
        return distinct

    def best_order(self, gpus: list[Gpu], cap: int, rule: MemoryRule) -> VwPlan:
        """best_order_and_nm, solved once per kind of VW: VWs whose GPUs have the same types, memories and
        nodes (ED and HD make several) get the same plan with their own GPU names."""
        key = (tuple(sorted((g[1], g[2], g[0].rsplit(":", 1)[0]) for g in gpus)), cap, rule)
        if key not in self.solved:
            try:
                self.solved[key] = best_order_and_nm(
                    self.profiles, gpus, self.link, cap, rule=rule, reserve_bytes=self.reserve
                )
            except HetpipeError as exc:
                self.solved[key] = exc
        found = self.solved[key]
        if isinstance(found, HetpipeError):
            raise found
        free = list(gpus)
        stages = []
        for s in found.stages:
            node = s.gpu.rsplit(":", 1)[0]
            mine = next(
                g
                for g in free
                if (g[1], g[2], g[0].rsplit(":", 1)[0])
                == (s.gpu_type, s.memory_limit_bytes + self.reserve, node)
            )
            free.remove(mine)
            stages.append(dataclasses.replace(s, gpu=mine[0]))
        return dataclasses.replace(found, stages=tuple(stages))

    def fixed_order(self, gpus: list[Gpu], cap: int, split: Sequence[int] | None, rule: MemoryRule) -> VwPlan:
        """An explicit VW: GPUs in the listed stage order; the Nm in 1..cap with the best minibatch time."""
        profiles = [self.profiles[g[1]] for g in gpus]
        found, error = None, None

        def time_of(vw: VwPlan) -> float:
            return minibatch_time_s(vw, rule.schedule, rule.recompute)

        for nm in range(cap, 0, -1):
            try:
                vw = partition(
                    profiles,
                    gpus,
                    self.links_of(gpus),
                    nm,
                    rule=rule,
                    reserve_bytes=self.reserve,
                    fixed_split=split,
                )
            except HetpipeError as exc:
                error = error or exc
                continue
            if found is None or time_of(vw) < time_of(found) * (1 - 1e-9):
                found = vw
        if found is None:
            assert error is not None
            raise error
        return found

    def with_params(self, vw: VwPlan) -> VwPlan:
        """Each stage's own weight bytes, so the simulator moves the right bytes per stage to the PS."""
        stages = tuple(
            dataclasses.replace(
                s,
                param_bytes=sum(
                    layer.param_bytes for layer in self.profiles[s.gpu_type].layers[s.start : s.stop]
                ),
            )
            for s in vw.stages
        )
        return dataclasses.replace(vw, stages=stages)

    # -- baselines

    def whole_model(self, gpu: Gpu) -> tuple[int, str]:
        """Bytes the whole model needs on one GPU of data parallelism (nm = 1, no stashing), and the terms."""
        profile = self.profiles[gpu[1]]
        terms = stage_memory_terms(profile.layers, 0, 1, PLAIN, input_bytes=profile.input_bytes)
        return terms.total, terms.describe()

    def allreduce(self) -> Candidate:
        gpus = [self.gpu(ref) for ref in self.config.all_gpus()]
        fit, notes = [], []
        for gpu in gpus:
            need, terms = self.whole_model(gpu)
            if need <= gpu[2] - self.reserve:
                fit.append((gpu, need))
            else:
                notes.append(
                    f"{gpu[0]} ({gpu[1]}, {format_bytes(gpu[2])}{self._reserve_text()}) cannot hold "
                    f"{self.any_profile.model} at batch {self.batch}: needs {format_bytes(need)} ({terms})"
                )
        notes = _merge_same_type(notes)
        if not fit:
            return Candidate(
                ALLREDUCE,
                None,
                None,
                0.0,
                reason="no GPU holds the whole model:\n    " + "\n    ".join(notes),
            )
        ring = [g for g, _ in fit]
        gbps = min(
            (self.link(a[0], b[0]) for a, b in zip(ring, ring[1:] + ring[:1], strict=True) if a is not b),
            default=math.inf,
        )
        steps = [self.profiles[g[1]].step_s for g in ring]
        param_bytes = sum(layer.param_bytes for layer in self.any_profile.layers)
        result = simulate_allreduce(steps, param_bytes, gbps if math.isfinite(gbps) else 1e12, self.batch)
        slowest = max(range(len(ring)), key=lambda i: steps[i])
        bottleneck = (
            f"{ring[slowest][0]} ({ring[slowest][1]}): {steps[slowest]:.3g} s/minibatch + all-reduce "
            f"{result.comm_s:.3g} s"
        )
        memory = tuple(GpuUse(g[0], g[1], need, g[2] - self.reserve) for g, need in fit)
        return Candidate(
            ALLREDUCE,
            None,
            None,
            result.samples_per_s,
            memory,
            bottleneck,
            notes=tuple(notes),
            comm_share=result.comm_s / result.step_s,
        )

    def sync_pipeline(self) -> Candidate:
        gpus = [self.gpu(ref) for ref in self.config.all_gpus()]
        n = self.any_profile.num_layers
        notes: list[str] = []
        speed = {name: t.speed for name, t in self.config.gpu_types.items()}
        if len(gpus) > n:
            kept = sorted(gpus, key=lambda g: (-speed[g[1]], -g[2], g[0]))[:n]
            notes.append(
                f"{self.any_profile.model} has {n} layers: the pipeline uses the {n} fastest GPUs, "
                f"{len(gpus) - n} idle"
            )
            gpus = [g for g in gpus if g in kept]
        orders = {
            tuple(gpus),
            tuple(sorted(gpus, key=lambda g: -g[2])),
            tuple(sorted(gpus, key=lambda g: -speed[g[1]])),
        }
        found: list[VwPlan] = []
        error: HetpipeError | None = None
        for order in sorted(orders):
            try:
                found.append(
                    partition(
                        [self.profiles[g[1]] for g in order],
                        order,
                        self.links_of(order),
                        1,
                        rule=PLAIN,
                        reserve_bytes=self.reserve,
                    )
                )
            except HetpipeError as exc:
                error = error or exc
        if not found:
            assert error is not None
            return Candidate(SYNC_PIPELINE, None, None, 0.0, reason=_first_line(error), notes=tuple(notes))
        vw = min(found, key=lambda v: v.bottleneck_s)
        micro = min(self.batch, 4 * len(gpus))
        result = simulate_sync_pipeline(vw, micro, self.batch)
        notes.append(
            f"{micro} microbatches of {self.batch / micro:g} samples, times scaled linearly (optimistic "
            "for small microbatches); memory as one full minibatch in flight"
        )
        return Candidate(
            SYNC_PIPELINE,
            None,
            None,
            result.samples_per_s,
            _uses(vw),
            _slowest_stage(vw, 0, ""),
            notes=tuple(notes),
            nm=micro,
        )

    def _reserve_text(self) -> str:
        return f" minus a reserve of {format_bytes(self.reserve)}" if self.reserve else ""


def _layer_nodes(vw: VwPlan) -> tuple[str, ...]:
    """The node of each layer's shard under placement "local": where the first VW runs it."""
    return tuple(stage.gpu.rsplit(":", 1)[0] for stage in vw.stages for _ in range(stage.start, stage.stop))


def _predict(
    plan: Plan,
    notes: tuple[str, ...],
    waves: int,
    ps_gbps: float,
    shards: int,
    server: bool,
    network: PsNetwork | None,
) -> Candidate:
    """Simulate `waves` waves; the prediction is the long run: every VW at the slowest VW's steady wave time
    (WSP keeps any VW within D + 1 waves of the slowest), fill and drain left out."""
    result = simulate(
        plan, waves=waves, ps_gbps=ps_gbps, ps_shards=shards, server_aggregation=server, network=network
    )
    per_wave = max(r.wave_s for r in result.vws)
    steady = (
        len(plan.vws) * plan.batch_size * plan.vws[0].nm / per_wave if per_wave > 0 else result.samples_per_s
    )
    uses = tuple(u for vw in plan.vws for u in _uses(vw))
    busy = sum(s.time_s for vw in plan.vws for s in vw.stages) * waves * plan.vws[0].nm
    gate = sum(r.gate_wait_s for r in result.vws)
    slow = max(
        range(len(plan.vws)), key=lambda v: minibatch_time_s(plan.vws[v], plan.schedule, plan.recompute)
    )
    bottleneck = _slowest_stage(plan.vws[slow], slow, "vw")
    if result.ps_utilisation > 0.9:
        bottleneck = f"PS link ({result.ps_utilisation:.0%} busy); then {bottleneck}"
    return Candidate(
        plan.policy,
        plan.staleness,
        plan,
        steady,
        uses,
        bottleneck,
        notes=notes,
        nm=plan.vws[0].nm,
        gate_wait_share=gate / max(busy + gate, 1e-12),
        ps_utilisation=result.ps_utilisation,
        run_samples_per_s=result.samples_per_s,
        schedule=plan.schedule,
    )


def _uses(vw: VwPlan) -> tuple[GpuUse, ...]:
    return tuple(GpuUse(s.gpu, s.gpu_type, s.memory_bytes, s.memory_limit_bytes) for s in vw.stages)


def _slowest_stage(vw: VwPlan, v: int, prefix: str) -> str:
    j = max(range(len(vw.stages)), key=lambda i: vw.stages[i].time_s)
    s = vw.stages[j]
    where = f"{prefix}{v} " if prefix else ""
    comm = (s.recv_s + s.send_s) / s.time_s if s.time_s else 0.0
    transfers = f", {comm:.0%} transfers" if comm >= 0.005 else ""
    return (
        f"{where}stage {j} {s.gpu} ({s.gpu_type}) layers {s.start}-{s.stop - 1}: "
        f"{s.time_s:.3g} s/minibatch{transfers}"
    )


def _gpu_list(gpus: Sequence[Gpu]) -> str:
    return ", ".join(f"{g[0]} {g[1]}" for g in gpus)


def _first_line(exc: Exception) -> str:
    return str(exc).split("\n")[0]


def _merge_same_type(notes: list[str]) -> list[str]:
    """`n2:0 (rtx-2060 ...) cannot hold ...` x 4 -> one line naming the four GPUs."""
    merged: dict[str, list[str]] = {}
    for note in notes:
        gpu, rest = note.split(" ", 1)
        merged.setdefault(rest, []).append(gpu)
    return [f"{', '.join(gpus)} {rest}" for rest, gpus in merged.items()]


# ---------------------------------------------------------------------------------------------- output


def _splits(plan: Plan) -> str:
    splits = ["/".join(map(str, vw.split)) for vw in plan.vws]
    return f"{splits[0]} x{len(splits)}" if len(set(splits)) == 1 and len(splits) > 1 else ", ".join(splits)


def format_table(candidates: Sequence[Candidate]) -> str:
    """One row per candidate: policy, D, Nm, VWs x GPUs, splits, samples/s, fullest GPU, bottleneck;
    * = best."""
    try:
        top = best(candidates)
    except HetpipeError:
        top = None
    header = (
        "",
        "policy",
        "schedule",
        "D",
        "Nm",
        "VWs",
        "GPUs",
        "layers per stage",
        "samples/s",
        "peak memory (fullest GPU)",
        "bottleneck",
    )
    converge = any(c.samples_source for c in candidates)
    if converge:
        header = (*header[:9], "samples to target", "s to target", *header[9:])
    rows = []
    for c in candidates:
        peak = c.peak
        memory = (
            f"{format_bytes(peak.memory_bytes)}/{format_bytes(peak.limit_bytes)} {peak.gpu} {peak.gpu_type}"
            if peak
            else "-"
        )
        if c.plan is not None:
            vws, splits = str(len(c.plan.vws)), _splits(c.plan)
        elif c.policy == ALLREDUCE and c.feasible:
            vws, splits = f"{c.gpus_used} replicas", "whole model"
        elif c.policy == SYNC_PIPELINE and c.feasible:
            vws, splits = "1 pipeline", "-"
        else:
            vws, splits = "-", "-"
        rate = f"{c.samples_per_s:.4g}" if c.feasible else "infeasible"
        row = (
            "*" if c is top else "",
            c.policy,
            c.schedule or "-",
            "-" if c.staleness is None else str(c.staleness),
            "-" if c.nm is None else str(c.nm),
            vws,
            str(c.gpus_used) if c.feasible else "-",
            splits,
            rate,
            memory,
            c.bottleneck if c.feasible else c.reason.split("\n")[0],
        )
        if converge:
            row = (
                *row[:9],
                _samples_text(c),
                "-" if c.time_to_target_s is None else f"{c.time_to_target_s:.4g}",
                *row[9:],
            )
        rows.append(row)
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header) - 1)]
    lines = [
        "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=False)) + "  " + row[-1]
        for row in [header, *rows]
    ]
    return "\n".join(line.rstrip() for line in lines)


def format_plan(candidate: Candidate) -> str:
    """The VWs of one candidate, stage by stage: GPU, layers, time, memory."""
    assert candidate.plan is not None
    plan = candidate.plan
    lines = [
        f"{candidate.label}, nm={candidate.nm}: {candidate.samples_per_s:.4g} samples/s predicted "
        f"(gate waits {candidate.gate_wait_share:.0%} of stage time, PS link "
        f"{candidate.ps_utilisation:.0%} busy)"
    ]
    for v, vw in enumerate(plan.vws):
        lines.append(f"  vw{v}: {minibatch_time_s(vw):.3g} s/minibatch")
        for j, s in enumerate(vw.stages):
            lines.append(
                f"    stage {j}  {s.gpu:<8} {s.gpu_type:<12} layers {s.start:>3}-{s.stop - 1:<3} "
                f"{s.time_s:8.3g} s  {format_bytes(s.memory_bytes):>10} of "
                f"{format_bytes(s.memory_limit_bytes)}"
            )
    lines += [f"  note: {note}" for note in candidate.notes]
    return "\n".join(lines)


def _samples_text(c: Candidate) -> str:
    """ "41,000 (fitted)" / "- (not reached)" / "-"."""
    if not c.samples_source:
        return "-"
    value = "-" if c.samples_to_target is None else f"{c.samples_to_target:,.0f}"
    return f"{value} ({c.samples_source})"


def _target_text(c: Candidate, top: Candidate | None = None) -> str:
    """Both factors of the predicted time to target, for explain: samples to target and the time they take."""
    if not c.samples_source:
        return ""
    if c.time_to_target_s is None:
        return f"; samples to target {_samples_text(c)}: no time to target"
    share = (
        f", {c.time_to_target_s / top.time_to_target_s:.2f}x the best's"
        if top is not None and top.time_to_target_s
        else ""
    )
    return f"; {_samples_text(c)} samples to target -> {c.time_to_target_s:.4g} s predicted{share}"


def explain(candidates: Sequence[Candidate]) -> str:
    """Why each candidate lost to the best: infeasible, slower VWs, gate waits, the PS, transfers, fewer GPUs;
    with a convergence calibration, both factors of every candidate's predicted time to target."""
    top = best(candidates)
    lines = [
        f"best: {top.label}, nm={top.nm}, {top.samples_per_s:.4g} samples/s on {top.gpus_used} GPUs"
        f"{_target_text(top)}; bottleneck {top.bottleneck}",
        f"    memory per GPU: {_memory_per_gpu(top)}",
    ]
    for c in candidates:
        if c is top:
            continue
        if not c.feasible:
            lines.append(f"{c.label}: cannot run: {c.reason}")
            continue
        share = c.samples_per_s / top.samples_per_s if top.samples_per_s else 0.0
        head = f"{c.label}: {c.samples_per_s:.4g} samples/s ({share:.0%} of the best){_target_text(c, top)}"
        lines.append(f"{head}: {'; '.join(_why(c, top)) or 'the same prediction; the best is listed first'}")
        lines.append(f"    memory per GPU: {_memory_per_gpu(c)}")
        lines += [f"    note: {note}" for note in c.notes]
    return "\n".join(lines)


def _memory_per_gpu(c: Candidate) -> str:
    """`n0:0 1.20 GiB/12.00 GiB, n0:1 ...`: each GPU's peak by the memory model and what it may use."""
    return (
        ", ".join(f"{u.gpu} {format_bytes(u.memory_bytes)}/{format_bytes(u.limit_bytes)}" for u in c.memory)
        or "-"
    )


def _why(c: Candidate, top: Candidate) -> list[str]:
    why = []
    if c.gpus_used < top.gpus_used:
        why.append(f"uses {c.gpus_used} GPUs, not {top.gpus_used}")
    if (
        c.time_to_target_s is not None
        and top.time_to_target_s is not None
        and top.samples_to_target
        and c.samples_per_s >= top.samples_per_s
    ):
        why.append(
            f"more samples/s than the best, but {c.samples_to_target / top.samples_to_target:.2f}x its "
            "samples to target"
        )
    if c.plan is None and (
        c.samples_per_s > top.samples_per_s
        or (
            c.time_to_target_s is not None
            and top.time_to_target_s is not None
            and c.time_to_target_s < top.time_to_target_s
        )
    ):
        why.append("predicts more than the best, but hetpipe does not run it: it is shown for comparison")
    if c.policy == ALLREDUCE:
        why.append(
            f"every step waits for the slowest replica ({c.bottleneck}); "
            f"synchronising takes {c.comm_share:.0%} of the step"
        )
        return why
    if c.policy == SYNC_PIPELINE:
        why.append(f"one pipeline flushed every minibatch (bubble) with its slowest stage {c.bottleneck}")
        return why
    assert c.plan is not None
    if c.schedule != top.schedule:
        why.append(
            f"schedule {c.schedule} (best: {top.schedule})"
            + (
                "; flushing every wave costs the pipeline's fill and drain"
                if c.schedule in ("1f1b-flush", "gpipe")
                else ""
            )
        )
    if (
        top.plan is not None
        and c.policy == top.policy
        and c.schedule == top.schedule
        and c.plan.vws == top.plan.vws
    ):
        why.append(
            f"the same VWs, splits and nm as the best; only D differs (D={c.staleness} vs {top.staleness})"
        )
        if c.samples_per_s > top.samples_per_s:
            why.append(f"its gain is under {D_TOLERANCE:.0%}, not worth the staler weights of a larger D")
        elif c.gate_wait_share > top.gate_wait_share + 0.005:
            why.append(
                f"stages wait at the WSP gate {c.gate_wait_share:.0%} of the time "
                f"(best: {top.gate_wait_share:.0%})"
            )
        return why
    rates = [minibatch_time_s(vw) for vw in c.plan.vws]
    if abs(c.samples_per_s - top.samples_per_s) <= 0.01 * top.samples_per_s and c.gpus_used == top.gpus_used:
        lags = (own_lag(c.plan), own_lag(top.plan))
        why.append(
            "within 1% of the best, which "
            + (
                f"lags fewer own updates ({lags[1]} vs {lags[0]})"
                if lags[0] > lags[1] and c.staleness == top.staleness
                else "has the smaller D or comes first (np, ed, hd, dp, explicit)"
            )
        )
    elif max(rates) > 1.1 * min(rates):
        slow, fast = rates.index(max(rates)), rates.index(min(rates))
        why.append(
            f"its VWs differ in speed (vw{slow} {max(rates):.3g} s/minibatch vs vw{fast} {min(rates):.3g}); "
            f"WSP holds the fast ones to the slowest ({c.bottleneck})"
        )
    elif c.samples_per_s > top.samples_per_s and c.staleness == top.staleness:
        why.append(
            f"its gain is under {D_TOLERANCE:.0%}, not worth lagging {own_lag(c.plan)} own updates "
            f"(best: {own_lag(top.plan)})"
        )
    elif c.samples_per_s > top.samples_per_s:
        why.append(
            f"its gain is under {D_TOLERANCE:.0%}, not worth the staler weights of D={c.staleness} "
            f"(best: D={top.staleness})"
        )
    else:
        why.append(f"slowest stage {c.bottleneck}")
    if c.gate_wait_share > top.gate_wait_share + 0.02:
        why.append(
            f"stages wait at the WSP gate {c.gate_wait_share:.0%} of the time "
            f"(best: {top.gate_wait_share:.0%})"
        )
    if c.ps_utilisation > 0.8:
        why.append(f"the PS link is {c.ps_utilisation:.0%} busy")
    if c.nm is not None and top.nm is not None and c.plan.vws and c.nm < len(c.plan.vws[0].stages):
        why.append(f"nm={c.nm} cannot fill a {len(c.plan.vws[0].stages)}-stage pipe")
    return why


def candidates_json(
    candidates: Sequence[Candidate], inputs: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """Machine-readable candidates: every field, plans as Plan.to_json's dicts, `best` as an index (or
    None)."""
    try:
        top: int | None = list(candidates).index(best(candidates))
    except HetpipeError:
        top = None
    rows = []
    for c in candidates:
        rows.append(
            {
                "policy": c.policy,
                "staleness": c.staleness,
                "nm": c.nm,
                "feasible": c.feasible,
                "runnable": c.runnable,
                "samples_per_s": c.samples_per_s,
                "gpus_used": c.gpus_used,
                "bottleneck": c.bottleneck,
                "reason": c.reason,
                "notes": list(c.notes),
                "gate_wait_share": c.gate_wait_share,
                "ps_utilisation": c.ps_utilisation,
                "comm_share": c.comm_share,
                "run_samples_per_s": c.run_samples_per_s,
                "schedule": c.schedule,
                "samples_to_target": c.samples_to_target,
                "samples_source": c.samples_source,
                "time_to_target_s": c.time_to_target_s,
                "memory": [dataclasses.asdict(u) for u in c.memory],
                "plan": dataclasses.asdict(c.plan) if c.plan is not None else None,
            }
        )
    return {"best": top, "inputs": dict(inputs or {}), "candidates": rows}
