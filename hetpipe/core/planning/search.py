"""The planner's fast search (docs/planning.md#search-at-scale): plan_candidates' groupings, alike VWs counted
by kind, each D predicted by the steady-state model (analytic.py) unless its upper bound says it cannot win;
the top N kept, the rest counted; the finalists run by the event simulator, which decides. Anytime: with a
budget it stops and returns the best so far. Pure but the clock."""

from __future__ import annotations

import dataclasses
import heapq
import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from hetpipe.core.config.schema import ClusterConfig, GpuRef
from hetpipe.core.errors import HetpipeError
from hetpipe.core.pipeline.schedule import get_schedule
from hetpipe.core.planning.analytic import Relayed, WaveModel, upper_bound, wave_model
from hetpipe.core.planning.baselines import allreduce, baseline_bounds, sync_pipeline
from hetpipe.core.planning.candidates import Candidate, gpu_uses, slowest_stage_text
from hetpipe.core.planning.capacity import plan_bounds, standalone_rates
from hetpipe.core.planning.groupings import GroupingSearch, pipelines_by_node
from hetpipe.core.planning.kinds import vw_kind
from hetpipe.core.planning.memory import MemoryRule
from hetpipe.core.planning.partition import least_bottleneck, minibatch_time_s
from hetpipe.core.planning.per_vw_work import PerVwWork
from hetpipe.core.planning.plan import Plan
from hetpipe.core.planning.planner import (
    D_VALUES,
    _candidate,
    _d_values,
    _policies,
    _Prediction,
    _schedules,
    tie_broken,
)
from hetpipe.core.planning.profile import ModelProfile
from hetpipe.core.planning.profile_sources import check_profiles
from hetpipe.core.planning.relays import ps_bytes_per_wave
from hetpipe.core.planning.search_shapes import Interner, Shape, kinds_of, shapes
from hetpipe.core.planning.wave_balance import fine_batches
from hetpipe.core.wsp.aggregation import get_aggregation, needs_pulls

__all__ = [
    "FINAL_MARGIN",
    "MAX_FINALISTS",
    "WINDOW",
    "MODEL_NOTE",
    "TOP_N",
    "SearchResult",
    "search_candidates",
]

# The pruning and the finalists, against the best pessimistic estimate (contention 1) less FINAL_MARGIN: a
# candidate whose upper bound x WINDOW is below it is skipped; the others are finalists, simulated as far as
# SIM_STAGES (all VWs' stages summed over the finalists) goes, the highest estimates first, smaller D on ties.
# WINDOW: rounding only. A prediction's wave time is at least analytic.least_wave_s (planner._predict), so no
# candidate's predicted samples/s is above its upper bound.
FINAL_MARGIN = 0.05
WINDOW = 1 + 1e-9
MAX_FINALISTS = 12  # beyond this many, only finalists of at most SMALL stages
SMALL = 8
SIM_STAGES = 600
TOP_N = 40  # candidates kept for the table, JSON and --explain; the rest are counted
SIM_MAX_STAGES = 256  # a finalist with more stages (all VWs) than this keeps the model's prediction
MEMORY_ROWS = 5  # candidates a stage's memory refuses at their D, shown with the reason; the rest counted
MODEL_NOTE = "predicted by the steady-state model (docs/planning.md#search-at-scale), not simulated"


@dataclass(frozen=True)
class SearchResult:
    """What the search kept: the candidates to show (enumeration order, then the baselines) and the counts."""

    candidates: list[Candidate]
    planned: int  # groupings x D the model predicted
    skipped: int  # left out by their upper bound: could not come within FINAL_MARGIN of the best
    infeasible: int  # a stage's memory at that D, or a policy that cannot run
    not_shown: int  # planned but not among the top N
    simulated: int  # finalists the event simulator ran
    skipped_policies: int  # policy x schedule left out whole: its VWs' pipelines together cannot win
    complete: bool  # False when the budget ran out first
    elapsed_s: float

    def counts(self, waves: int) -> str:
        """What the search counted, in one line (`hetpipe plan`'s header: "candidates: " + this)."""
        return (
            f"{self.planned + self.skipped + self.infeasible}: {self.planned} predicted by the steady-state "
            f"model ({self.simulated} of them simulated for {waves} waves), {self.skipped} skipped by their "
            f"upper bound, {self.infeasible} that do not fit"
            + (
                f"; {self.skipped_policies} policy x schedule searches skipped whole by their bound"
                if self.skipped_policies
                else ""
            )
            + ("" if self.complete else "; the --budget ran out: the best plan found so far")
        )

    def footer(self, waves: int) -> str:
        """What the table leaves out, in one line: the counts, and how many candidates are shown."""
        shown = sum(1 for c in self.candidates if c.plan is not None)
        return f"candidates: {self.counts(waves)}; {shown} shown, {self.not_shown} more not shown"


@dataclass(frozen=True)
class _Entry:
    seq: int
    policy: str
    schedule: str
    shape: Shape
    d: int
    model: WaveModel
    bound: float


@dataclass(frozen=True)
class _Context:
    """What every grouping of a search is predicted with."""

    search: GroupingSearch
    how: _Prediction
    ds: list[int]
    batch: int
    aggregation: object
    ps_rate: float
    top: int


@dataclass
class _Tally:
    """The search so far: the `top` best estimates (a heap), the candidates shown as not fitting, counts."""

    heap: list[tuple[float, int, _Entry]] = dataclasses.field(default_factory=list)
    shown_infeasible: list[tuple[int, Candidate]] = dataclasses.field(default_factory=list)
    memory_over: dict[tuple[int, MemoryRule], bool] = dataclasses.field(default_factory=dict)
    best_est: float = 0.0
    planned: int = 0
    skipped: int = 0
    infeasible: int = 0
    shapes_seen: int = 0
    skipped_policies: int = 0
    seq: int = 0
    complete: bool = True


def search_candidates(
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
    top: int = TOP_N,
    budget_s: float | None = None,
    progress: Callable[[str], None] | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> SearchResult:
    """plan_candidates' search (its arguments, without slower_but_fewer and ps_network) at scale: the same
    groupings and D values, each predicted by analytic.wave_model unless its upper_bound is below the best
    estimate so far less FINAL_MARGIN (counted as skipped); the `top` best kept; those within FINAL_MARGIN of
    the best (at most MAX_FINALISTS) simulated as plan_candidates does, so `best` picks among simulated
    figures. `budget_s`: stop enumerating after that many seconds and return the best found so far;
    `progress` gets a line about once a second."""
    started = clock()
    check_profiles(config, profiles_by_type)
    search = GroupingSearch(config, profiles_by_type, link_gbps or config.network.link_gbps, reserve_bytes)
    rates = standalone_rates(config, profiles_by_type)
    how = _Prediction.of(config, waves, ps_gbps, None, rates, search.link)
    ps_rate = how.ps_bytes_per_s
    ctx = _Context(
        search,
        how,
        _d_values(d_values, config.wsp.staleness, waves),
        config.train.batch_size,
        get_aggregation(config.ps.aggregation),
        ps_rate,
        top,
    )
    work = PerVwWork(search, ps_rate)
    interner = Interner()
    tally = _Tally()
    last_report = started
    for schedule in _schedules(config, schedules):
        recompute = config.train.recompute and get_schedule(schedule).recompute
        for policy in _policies(config, policies):
            if tally.best_est > 0 and _policy_bound(search, policy, schedule) * WINDOW < tally.best_est:
                tally.skipped_policies += 1  # no grouping of its VWs can come within FINAL_MARGIN of the best
                continue
            found = shapes(search, work, policy, schedule, nm_max, interner, ctx.ds)
            if isinstance(found, str):
                tally.seq += 1
                tally.infeasible += 1
                tally.shown_infeasible.append(
                    (tally.seq, Candidate(policy, None, None, 0.0, reason=found, schedule=schedule))
                )
                continue
            seen: dict[tuple[int, int], set[int]] = {}  # each set of VWs: the D values it was planned at
            for shape in found:
                if budget_s is not None and clock() - started > budget_s:
                    tally.complete = False
                    break
                if progress is not None and clock() - last_report >= 1.0:
                    last_report = clock()
                    progress(
                        f"plan: {tally.shapes_seen} groupings, {tally.planned} predicted, {tally.skipped} "
                        f"skipped, best {tally.best_est:.4g} samples/s so far "
                        f"({last_report - started:.0f} s; {schedule} {policy})"
                    )
                done = seen.setdefault(shape.key, set())
                ds = [d for d in (ctx.ds if shape.staleness is None else (shape.staleness,)) if d not in done]
                if ds:
                    done.update(ds)
                    _visit(ctx, tally, policy, schedule, recompute, shape, ds)
            if not tally.complete:
                break
        if not tally.complete:
            break
    return _result(ctx, tally, rates, baselines, clock() - started)


def _visit(
    ctx: _Context, tally: _Tally, policy: str, schedule: str, recompute: bool, shape: Shape, ds: Sequence[int]
) -> None:
    """Predict one grouping at each D of `ds` (each skipped when its bound cannot come near the best so far,
    or counted when a stage's memory refuses it), keeping the `top` best estimates."""
    search = ctx.search
    tally.shapes_seen += 1
    kinds = kinds_of(shape)
    pulls = needs_pulls(shape.k, ctx.aggregation)
    relays = _relayed(ctx.how, shape)
    bound = upper_bound(kinds, ctx.batch, schedule, recompute, pulls, ctx.ps_rate, relays)
    for d in ds:
        tally.seq += 1
        if bound * WINDOW < tally.best_est:
            tally.skipped += 1
            continue
        rule = search.rule(schedule, d, shape.k)
        if _over(search, shape, rule, tally.memory_over):
            tally.infeasible += 1
            if len(tally.shown_infeasible) < MEMORY_ROWS:
                cand = _candidate(search, policy, schedule, shape.grouping(), d, ctx.how)
                tally.shown_infeasible.append((tally.seq, cand))
            continue
        model = wave_model(kinds, ctx.batch, schedule, recompute, d, pulls, ctx.ps_rate, relays=relays)
        floor = wave_model(
            kinds, ctx.batch, schedule, recompute, d, pulls, ctx.ps_rate, contention=1.0, relays=relays
        )
        tally.planned += 1
        tally.best_est = max(tally.best_est, floor.samples_per_s * (1 - FINAL_MARGIN))
        entry = _Entry(tally.seq, policy, schedule, shape, d, model, bound)
        heapq.heappush(tally.heap, (model.samples_per_s, -tally.seq, entry))
        if len(tally.heap) > ctx.top:
            heapq.heappop(tally.heap)


def _relayed(how: _Prediction, shape: Shape) -> tuple[Relayed, ...]:
    """The shape's relayed groups for the model, each VW as the index of its kind in the shape's kinds, alike
    groups counted once (none unless [ps] node_aggregation)."""
    if not how.node_aggregation:
        return ()
    index = {kind_id: i for i, (kind_id, _, _) in enumerate(shape.kinds)}
    counted: dict[tuple[tuple[int, ...], float], int] = {}
    for node, kinds in shape.groups().items():
        key = (tuple(index[k] for k in kinds), how.inside_gbps.get(node, math.inf) * 1e9 / 8)
        counted[key] = counted.get(key, 0) + 1
    return tuple(Relayed(members, rate, n) for (members, rate), n in counted.items())


def _finalists(entries: list[_Entry], best_est: float) -> set[int]:
    """The kept candidates to simulate: those whose bound could still reach the best, the highest estimates
    first (smaller D on ties), within SIM_STAGES stages in all and MAX_FINALISTS (more when small)."""
    chosen: set[int] = set()
    stages_left = SIM_STAGES
    for e in sorted(
        (e for e in entries if e.bound * WINDOW >= best_est),
        key=lambda e: (-e.model.samples_per_s, e.d, e.seq),
    ):
        stages = sum(n * len(vw.stages) for _, vw, n in e.shape.kinds)
        if stages <= min(stages_left, SIM_MAX_STAGES) and (len(chosen) < MAX_FINALISTS or stages <= SMALL):
            chosen.add(e.seq)
            stages_left -= stages
    return chosen


def _result(
    ctx: _Context, tally: _Tally, rates: Mapping[str, float], baselines: bool, elapsed: float
) -> SearchResult:
    """The kept candidates in search order, the finalists simulated and the others as the model predicts
    them, with the baselines and the counts."""
    search = ctx.search
    entries = [e for _, _, e in tally.heap]
    chosen = _finalists(entries, tally.best_est)
    kept: list[tuple[int, Candidate]] = list(tally.shown_infeasible)
    simulated = 0
    for e in entries:
        if e.seq in chosen:
            kept.append((e.seq, _candidate(search, e.policy, e.schedule, e.shape.grouping(), e.d, ctx.how)))
            simulated += 1
        else:
            kept.append((e.seq, _modelled(search, e, ctx.how)))
    kept.sort(key=lambda item: item[0])
    out = [c for _, c in kept]
    if baselines:
        out += [baseline_bounds(c, rates) for c in (allreduce(search), sync_pipeline(search))]
    capacity = sum(rates.values())
    return SearchResult(
        [dataclasses.replace(c, capacity=capacity) for c in tie_broken(out, search, ctx.how, SIM_MAX_STAGES)],
        tally.planned,
        tally.skipped,
        tally.infeasible,
        tally.planned - len(entries),
        simulated,
        tally.skipped_policies,
        tally.complete,
        elapsed,
    )


def _policy_bound(search: GroupingSearch, policy: str, schedule: str) -> float:
    """Samples/s no grouping of the policy's VWs under `schedule` can beat: each VW at its least bottleneck
    (partition.least_bottleneck: any order and split at Nm 1), summed, over the VWs at one common Nm or over
    per-VW work's (a VW short of memory at the config's batch bound at the smallest of fine_batches, where
    it holds the most splits: GroupingSearch._fit); math.inf for explicit VWs and when the policy cannot
    allocate (its own candidate says why)."""
    from hetpipe.core.planning.cluster import allocate

    if policy == "explicit":
        return math.inf
    try:
        groups = allocate(search.config, policy)
    except HetpipeError:
        return math.inf
    rule = search.rule(schedule, search.config.wsp.staleness, len(groups))
    smallest = (fine_batches(search.batch) or (search.batch,))[0]

    def least(refs: list[GpuRef], batch: int = search.batch) -> float:
        gpus = [search.gpu(ref) for ref in refs]
        # the bound sees the rule only through what each stage keeps at Nm 1 (partition._memories), which
        # the searched schedules share: one solve serves them all
        at_one = rule.with_nm(1)
        keeps = tuple(at_one.keeping(j, len(gpus)) for j in range(len(gpus)))
        key = ("least", vw_kind(gpus) if search.node_blind else tuple(gpus), keeps, batch)
        if key not in search.solved:
            profiles = {t: search.profile(t, batch) for t in {g[1] for g in gpus}}
            try:
                found = least_bottleneck(profiles, gpus, search.link, rule=rule, reserve_bytes=search.reserve)
                search.solved[key] = found * search.batch / batch  # type: ignore[assignment]
            except HetpipeError:  # more GPUs than layers, or no memory: left out (its note says why)
                search.solved[key] = math.inf  # type: ignore[assignment]
        found = search.solved[key]
        return found if isinstance(found, float) else math.inf

    def rate(times: Sequence[float]) -> float:
        return sum(search.batch / t for t in times if t < math.inf)

    def pipelined(alone: list[GpuRef]) -> list[float]:  # dp: a pipeline per node (GroupingSearch._fit)
        pipes = pipelines_by_node(alone, lambda refs: least(refs) < math.inf) if policy == "dp" else []
        return [least(refs) for refs in pipes]

    times = [least(refs) for refs in groups]
    short = [refs for refs, t in zip(groups, times, strict=True) if t == math.inf]
    common = rate(times) + rate(pipelined([refs[0] for refs in short]))
    small = [least(refs, smallest) for refs in short]
    still = [refs[0] for refs, t in zip(short, small, strict=True) if t == math.inf]
    return max(common, rate(times) + rate(small) + rate(pipelined(still)))


def _over(
    search: GroupingSearch,
    shape: Shape,
    rule: MemoryRule,
    cache: dict[tuple[int, MemoryRule], bool],
) -> bool:
    """Whether a stage of some kind of the shape needs more memory at `rule` (its D) than its GPU has."""
    for kind_id, vw, _ in shape.kinds:
        key = (kind_id, rule)
        if key not in cache:
            cache[key] = any(
                m > s.memory_limit_bytes for m, s in zip(search.stage_bytes(vw, rule), vw.stages, strict=True)
            )
        if cache[key]:
            return True
    return False


def _modelled(search: GroupingSearch, e: _Entry, how: _Prediction) -> Candidate:
    """A candidate predicted by the model alone: its plan with each D's memory, as _candidate builds it."""
    config = search.config
    vws, notes = e.shape.grouping()
    rule = search.rule(e.schedule, e.d, len(vws))
    sized = tuple(search.with_memory(vw, rule) for vw in vws)
    plan = Plan(
        e.policy,
        search.any_profile.model,
        config.train.batch_size,
        e.d,
        sized,
        placement=config.ps.placement,
        schedule=e.schedule,
        recompute=config.train.recompute and get_schedule(e.schedule).recompute,
        aggregation=config.ps.aggregation,
        mitigation=config.train.mitigation,
    )
    m = e.model
    slow = max(
        range(len(sized)),
        key=lambda v: sized[v].nm * minibatch_time_s(sized[v], plan.schedule, plan.recompute),
    )
    bottleneck = slowest_stage_text(sized[slow], slow, "vw")
    if m.ps_utilisation > 0.9:
        bottleneck = f"PS link ({m.ps_utilisation:.0%} busy); then {bottleneck}"
    pulls = needs_pulls(len(sized), get_aggregation(config.ps.aggregation))
    relays = how.relays(plan)
    moved = ps_bytes_per_wave(sized, relays, pulls)
    link = "PS"
    if relays and m.inside_s > m.ps_s:  # a relay's node's inside link is the busiest
        busiest = max(relays, key=lambda r: sum(sized[v].param_bytes for v in r.vws) / r.inside_gbps)
        link = f"{busiest.node} loopback"
    ps = how.ps_figures(m.ps_utilisation, link, moved, m.wave_s, plan, relays)
    notes = (*notes, MODEL_NOTE)
    bounds = plan_bounds(plan, m.samples_per_s, how.rates, notes, ps, how.link) if how.link else ()
    gate = max(m.gate_s - m.compute_s, 0.0) / m.wave_s if m.wave_s > 0 and not math.isinf(m.wave_s) else 0.0
    return Candidate(
        e.policy,
        e.d,
        plan,
        m.samples_per_s,
        tuple(u for vw in sized for u in gpu_uses(vw)),
        bottleneck,
        notes=notes,
        nm=max(vw.nm for vw in sized),
        gate_wait_share=gate,
        ps_utilisation=m.ps_utilisation,
        run_samples_per_s=m.samples_per_s,
        schedule=e.schedule,
        bounds=bounds,
        node_aggregation=how.node_aggregation,
        relayed=tuple(r.vws for r in relays),
    )
