"""Partitioning one virtual worker (docs/planning.md#partitioner): contiguous split, GPU order and Nm. Pure,
no torch.

Stage j runs layers [start, stop) on GPU j. Its time per minibatch is its layers' forward + backward on
that GPU's type plus its boundary transfers (bytes / link bandwidth): receiving the input activation and
the output gradient, sending the output activation and the input gradient; the model input (stage 0) and
the last stage's output cross no link. Its memory is hetpipe.core.planning.memory's model; it must fit the
GPU's memory minus `reserve_bytes`. The split minimises the slowest stage time, then the peak memory use (the
largest stage memory as a fraction of its GPU's usable memory), exactly, by dynamic programming over
(stage, first layer) on numpy tables: O(k n^2) per (order, Nm).
"""

from __future__ import annotations

import functools
import itertools
import math
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from hetpipe.core.errors import HetpipeError, UsageError
from hetpipe.core.pipeline.schedule import (
    DEFAULT_SCHEDULE,
    Schedule,
    flushing_schedule,
    get_schedule,
    simulate,
    validate,
)
from hetpipe.core.planning.memory import WSP, MemoryRule, format_bytes, stage_memory_terms
from hetpipe.core.planning.plan import StagePlan, VwPlan
from hetpipe.core.planning.profile import ModelProfile

__all__ = [
    "Gpu",
    "best_order_and_nm",
    "least_bottleneck",
    "minibatch_time_s",
    "partition",
    "round_trip_bound",
]

Gpu = tuple[str, str, int]  # (GPU reference "node:index", GPU type, memory in bytes)
_TIE = 1e-9  # relative: stage times this close count as equal for the memory tie-break


# ---------------------------------------------------------------------------------------------- public


def partition(
    profiles: Sequence[ModelProfile],
    gpus: Sequence[Gpu],
    link_gbps: Sequence[float],
    nm: int,
    *,
    rule: MemoryRule = WSP,
    reserve_bytes: int = 0,
    fixed_split: Sequence[int] | None = None,
) -> VwPlan:
    """The best contiguous split of the model over `gpus` in this order (profiles[j]: the model on gpus[j]'s
    type; link_gbps[j]: Gbit/s between gpus[j] and gpus[j+1]); `rule` says what each stage keeps (its nm is
    replaced by `nm`).

    `fixed_split` (layers per stage) replaces the search, still checked against memory. HetpipeError when
    no split fits (naming the GPU, what it needs in the best case and what it has) or the fixed one does not.
    """
    problem = _Problem.build(profiles, gpus, link_gbps, reserve_bytes)
    _check_nm(nm, "nm")
    rule = rule.with_nm(nm)
    if fixed_split is not None:
        split = problem.check_split(fixed_split)
        vw = problem.plan(split, rule)
        over = [s for s in vw.stages if s.memory_bytes > s.memory_limit_bytes]
        if over:
            j = vw.stages.index(over[0])
            raise HetpipeError(
                problem.overflow_message(j, split, rule, f"the fixed split {list(split)}")
                + ": move layers off that stage, lower batch_size, lower nm, or add GPUs to the VW"
            )
        return vw
    found = problem.solve(rule)
    if found is None:
        raise HetpipeError(problem.infeasible_message(rule))
    return problem.plan(found.split, rule)


def best_order_and_nm(
    profiles: Mapping[str, ModelProfile],
    gpus: Sequence[Gpu],
    link_gbps: Callable[[str, str], float],
    nm_max: int,
    *,
    rule: MemoryRule = WSP,
    reserve_bytes: int = 0,
    max_orders: int = 720,
) -> VwPlan:
    """Partition `gpus` choosing also their order inside the VW and Nm in 1..nm_max.

    `profiles` maps GPU type -> the model's profile on it; `link_gbps(a, b)` the Gbit/s between two GPUs.
    Orders: the distinct permutations of the GPUs, GPUs with the same type, memory and node being
    interchangeable (so `link_gbps` must depend only on the nodes), tried large-memory-first; with more
    than `max_orders` of them only two heuristic orders (memory-descending, and nodes kept together).

    Choice, per order: the split for every Nm, scored by minibatch_time_s under rule.schedule - the
    bottleneck when Nm >= k and the schedule never drains, else its simulated steady state (computed only
    when it could win). The order keeps the *largest* Nm with its best time (docs/planning.md#partitioner: the
    largest that fits; a larger Nm is never bought with a slower split). Across orders: least time, then lower
    peak memory use, then smaller Nm, then the earlier order. So Nm < k is chosen only when no Nm >= k does
    as well, typically because nothing with Nm >= k fits or nm_max < k.
    """
    _check_nm(nm_max, "nm_max")
    if not gpus:
        raise UsageError("a virtual worker needs at least one GPU")
    missing = sorted({t for _, t, _ in gpus} - set(profiles))
    if missing:
        raise UsageError(
            f"no profile for GPU type(s) {', '.join(missing)}: profile the model on them "
            f"(hetpipe.compute.profiler.cached_profile) or derive one (derive_profile)"
        )
    tables: dict[int, _Tables] = {}
    best: tuple[tuple[float, float, int, int], _Problem, _Solution] | None = None
    closest: tuple[float, _Problem] | None = None
    for index, order in enumerate(_orders(gpus, max_orders)):
        links = [_link(link_gbps, a[0], b[0]) for a, b in itertools.pairwise(order)]
        problem = _Problem.build([profiles[t] for _, t, _ in order], order, links, reserve_bytes, tables)
        chosen = _best_nm(problem, rule, nm_max, best[0][0] if best is not None else math.inf)
        if chosen is None:
            if best is not None:  # this order cannot win; `closest` only matters when no order fits
                continue
            worst = problem.least_overcommit(rule.with_nm(1))[0]
            if closest is None or worst < closest[0]:
                closest = (worst, problem)
            continue
        (time_s, neg_nm, peak), found = chosen
        rank = (time_s, peak, -neg_nm, index)
        if best is None or rank < best[0]:
            best = (rank, problem, found)
    if best is None:
        assert closest is not None
        raise HetpipeError(closest[1].infeasible_message(rule.with_nm(1), orders_tried=True))
    (_, _, nm, _), problem, found = best
    return problem.plan(found.split, rule.with_nm(nm))


_Chosen = tuple[tuple[float, int, float], "_Solution"]  # ((time per minibatch, -Nm, peak), split)


def _best_nm(problem: _Problem, rule: MemoryRule, nm_max: int, to_beat: float) -> _Chosen | None:
    """One order's best Nm in 1..nm_max by (time, -Nm, peak) and its split; None when nothing fits or nothing
    can beat `to_beat` (the best order's time so far: what could not win is not computed).

    A pipe that fills (Nm >= k) and never drains takes the bottleneck: _filled bisects for it. The other Nm
    take the simulated steady time, computed only when its lower bound (round_trip) could win. The bound's
    split-free floor, the least work of a split that could win over Nm, rises as Nm falls and ends the walk
    down once it cannot.
    """
    k = len(problem.gpus)
    chosen: _Chosen | None = None
    top = nm_max
    if k <= nm_max and not get_schedule(rule.schedule).drains:
        filled = _filled(problem, rule, k, nm_max, to_beat)
        if filled is not None:
            nm, found = filled
            chosen = ((found.bottleneck, -nm, found.peak), found)
        top = k - 1
    bar = min(to_beat, chosen[0][0] if chosen is not None else math.inf)
    work = problem.least_total_under(bar)
    for nm in range(top, 0, -1):
        floor = work * 0.98 * (1 - 1e-6) / nm  # <= round_trip at this Nm of a split that could win
        if floor > to_beat or (chosen is not None and floor >= chosen[0][0]):
            break
        found = problem.solve(rule.with_nm(nm))
        if found is None:
            continue
        lower = problem.round_trip(found.split, rule.with_nm(nm))
        if lower > to_beat or (chosen is not None and lower >= chosen[0][0]):
            continue
        key = (problem.steady_time(found.split, rule.with_nm(nm)), -nm, found.peak)
        if chosen is None or key < chosen[0]:
            chosen = (key, found)
            if key[0] < bar:
                bar = key[0]
                work = problem.least_total_under(bar)
    return chosen


def _filled(
    problem: _Problem, rule: MemoryRule, k: int, nm_max: int, to_beat: float
) -> tuple[int, _Solution] | None:
    """The largest Nm in k..nm_max whose split has the least bottleneck of that range, and the split; None
    when nothing fits at Nm = k (or Nm = k when its bottleneck is over `to_beat`: no Nm of the range can
    win). By bisection: a stage's memory only grows with Nm (test_partition), so the splits that fit only
    shrink and the least bottleneck only rises."""
    least = problem.solve(rule.with_nm(k))
    if least is None:
        return None
    lo, hi, found = k, nm_max if least.bottleneck <= to_beat else k, least
    while lo < hi:
        mid = (lo + hi + 1) // 2
        at = problem.solve(rule.with_nm(mid))
        if at is not None and at.bottleneck == least.bottleneck:
            lo, found = mid, at
        else:
            hi = mid - 1
    return lo, found


def least_bottleneck(
    profiles: Mapping[str, ModelProfile],
    gpus: Sequence[Gpu],
    link_gbps: Callable[[str, str], float],
    *,
    rule: MemoryRule = WSP,
    reserve_bytes: int = 0,
    max_orders: int = 720,
    in_order: bool = False,
) -> float:
    """The least bottleneck (slowest stage's time per minibatch) of any split of `gpus` at Nm 1 (the least
    memory, so the most splits fit) in any order best_order_and_nm tries (only this one with `in_order`):
    no split, order or Nm of these GPUs runs a minibatch faster, whatever the schedule. math.inf when none
    fits."""
    orders = [tuple(gpus)] if in_order else _orders(gpus, max_orders)
    tables: dict[int, _Tables] = {}
    out = math.inf
    for order in orders:
        links = [_link(link_gbps, a[0], b[0]) for a, b in itertools.pairwise(order)]
        problem = _Problem.build([profiles[t] for _, t, _ in order], order, links, reserve_bytes, tables)
        found = problem.solve(rule.with_nm(1))
        if found is not None:
            out = min(out, found.bottleneck)
    return out


def round_trip_bound(vw: VwPlan, schedule: str = DEFAULT_SCHEDULE, recompute: bool = False) -> float:
    """A lower bound on minibatch_time_s: the bottleneck stage; a minibatch's round trip through every stage
    over the Nm minibatches a VW keeps in flight at most (every schedule keeps at most Nm); and for a
    schedule that flushes every wave, each stage j's Nm minibatches plus the trip to it and back from it,
    per minibatch. Less 2% on the last two: the steady time is measured over a few waves (_steady), which
    can come out under them by a fraction of a percent."""
    forward = [s.forward_s + (s.recv_s + s.send_s) / 2 for s in vw.stages]
    backward = [s.backward_s + (s.recv_s + s.send_s) / 2 for s in vw.stages]
    if recompute:
        backward = [b + f for f, b in zip(forward, backward, strict=True)]
    both = [f + b for f, b in zip(forward, backward, strict=True)]
    return _round_trip(both, vw.nm, get_schedule(schedule).drains)


def _round_trip(both: Sequence[float], nm: int, drains: bool) -> float:
    """round_trip_bound from each stage's forward + backward per minibatch."""
    bound = sum(both) / nm
    if drains:
        before = list(itertools.accumulate(both, initial=0.0))
        bound = max(bound, max((before[j] + nm * both[j]) / nm for j in range(len(both))))
    return max(max(both) * (1 - 1e-9), bound * 0.98)


def minibatch_time_s(vw: VwPlan, schedule: str = DEFAULT_SCHEDULE, recompute: bool = False) -> float:
    """Steady-state time per minibatch of one VW: the bottleneck stage when the schedule never drains and
    Nm >= k (batch / this is its throughput), else the schedule simulated with the stages' times (a pipe that
    cannot fill, or one that flushes every wave; a recomputing backward runs the forward again)."""
    if vw.nm >= len(vw.stages) and not get_schedule(schedule).drains and not recompute:
        return vw.bottleneck_s
    forward = [s.forward_s + s.recv_s / 2 + s.send_s / 2 for s in vw.stages]
    backward = [s.backward_s + s.recv_s / 2 + s.send_s / 2 for s in vw.stages]
    if recompute:
        backward = [b + f for f, b in zip(forward, backward, strict=True)]
    return _steady(tuple(forward), tuple(backward), vw.nm, schedule)


# ---------------------------------------------------------------------------------------------- tables


@dataclass(frozen=True)
class _Tables:
    """One profile as (start, stop) tables over prefix sums; entries with stop <= start are unused."""

    compute: np.ndarray  # forward + backward seconds of layers [s, e)
    act_in: np.ndarray  # (n,) bytes entering layer s: model input for s = 0, else output of layer s - 1
    weights: np.ndarray  # (n+1, n+1) param bytes of [s, e)
    optimizer: np.ndarray  # optimizer state of [s, e)
    working: np.ndarray  # the largest working memory of a layer of [s, e)
    saved: np.ndarray  # saved activations of [s, e), per minibatch
    inputs: np.ndarray  # the input buffer of a stage starting at s, per minibatch
    outputs: np.ndarray  # the output of a stage ending at e, per minibatch

    @classmethod
    def of(cls, profile: ModelProfile) -> _Tables:
        layers = profile.layers
        n = len(layers)

        def span(values: Sequence[float], dtype: type) -> np.ndarray:
            prefix = np.concatenate(([0], np.cumsum(np.asarray(values, dtype=dtype))))
            return prefix[None, :] - prefix[:, None]

        compute = span([layer.forward_s + layer.backward_s for layer in layers], np.float64)
        weights = span([layer.param_bytes for layer in layers], np.int64)
        optimizer = span([layer.optimizer_bytes for layer in layers], np.int64)
        saved = span([layer.saved_bytes for layer in layers], np.int64)
        working = np.zeros((n + 1, n + 1), dtype=np.int64)
        for s in range(n):
            working[s, s + 1 :] = np.maximum.accumulate([layer.working_bytes for layer in layers[s:]])
        act_in = np.asarray(
            [profile.input_bytes] + [layer.output_bytes for layer in layers[:-1]], dtype=np.int64
        )
        inputs = np.broadcast_to(np.append(act_in, 0)[:, None], (n + 1, n + 1))
        act_out = np.asarray([0] + [layer.output_bytes for layer in layers], dtype=np.int64)
        outputs = np.broadcast_to(act_out[None, :], (n + 1, n + 1))
        return cls(compute, act_in, weights, optimizer, working, saved, inputs, outputs)


def _stack(tables: Sequence[_Tables]) -> dict[str, np.ndarray]:
    """The memory tables of every position, stacked: prefix sums (k, n+1) for the spans (weights, optimizer,
    saved), per first layer (inputs) and last layer (outputs) (k, n+1), working (k, n+1, n+1)."""
    stack = functools.partial(np.stack, dtype=np.float64)  # exact: bytes are integers far below 2**53
    rows = {
        name: stack([getattr(t, name)[0] for t in tables])
        for name in ("weights", "optimizer", "saved", "outputs")
    }
    rows["inputs"] = stack([t.inputs[:, 0] for t in tables])
    rows["working"] = stack([t.working for t in tables])
    return rows


def _memories(t: dict[str, np.ndarray], rule: MemoryRule, out: np.ndarray | None) -> np.ndarray:
    """_Problem.memories from the stacked tables (_stack)."""
    k = t["working"].shape[0]
    keeps = [rule.keeping(j, k) for j in range(k)]

    def per_stage(counts: Sequence[int]) -> np.ndarray:
        return np.asarray(counts, dtype=np.float64)[:, None]

    # weights, gradients, stashed copies, update sums, the update baseline, the push staging copy
    copies = per_stage([2 + x.stashed + x.update_sums + int(x.baseline) + int(x.push_staging) for x in keeps])
    spans = (
        copies * t["weights"]
        + per_stage([int(x.optimizer) for x in keeps]) * t["optimizer"]
        + per_stage([x.saved for x in keeps]) * t["saved"]
    )  # prefix sums: [s, e) is spans[e] - spans[s]
    # inputs kept per minibatch in flight, and (but on stage 0) input gradients sent back (P2P window)
    inputs = per_stage([x.in_flight + (rule.nm + 1 if j > 0 else 0) for j, x in enumerate(keeps)])
    # (but on the last stage) outputs kept as backward roots, and the output gradient received
    outputs = per_stage([x.in_flight + 1 if j < k - 1 else 0 for j, x in enumerate(keeps)])
    out = np.empty_like(t["working"]) if out is None else out
    np.subtract(spans[:, None, :], spans[:, :, None], out=out)
    out += t["working"]
    out += (inputs * t["inputs"])[:, :, None]
    out += (outputs * t["outputs"])[:, None, :]
    return out


@dataclass(frozen=True)
class _Solution:
    split: tuple[int, ...]
    bottleneck: float
    peak: float  # largest stage memory / usable memory


@dataclass(frozen=True)
class _Problem:
    """One VW in one GPU order: the profile tables per position, link rates, usable memory."""

    profiles: tuple[ModelProfile, ...]
    gpus: tuple[Gpu, ...]
    links: tuple[float, ...]  # Gbit/s
    caps: tuple[int, ...]  # usable bytes per GPU
    reserve: int
    tables: tuple[_Tables, ...]

    @classmethod
    def build(
        cls,
        profiles: Sequence[ModelProfile],
        gpus: Sequence[Gpu],
        link_gbps: Sequence[float],
        reserve_bytes: int,
        cache: dict[int, _Tables] | None = None,
    ) -> _Problem:
        k = len(gpus)
        if k == 0:
            raise UsageError("a virtual worker needs at least one GPU")
        if len(profiles) != k:
            raise UsageError(
                f"{len(profiles)} profiles for {k} GPUs: give one profile per GPU, in stage order"
            )
        if len(link_gbps) != k - 1:
            raise UsageError(
                f"{len(link_gbps)} link bandwidths for {k} GPUs: give k - 1 = {k - 1}, "
                "one between each pair of consecutive GPUs"
            )
        for j, rate in enumerate(link_gbps):
            if not (rate > 0 and math.isfinite(rate)):
                raise UsageError(
                    f"link_gbps[{j}] (between {gpus[j][0]} and {gpus[j + 1][0]}) must be a finite "
                    f"number > 0, got {rate!r}"
                )
        if reserve_bytes < 0:
            raise UsageError(f"reserve_bytes must be >= 0, got {reserve_bytes}")
        first = profiles[0]
        for j, p in enumerate(profiles):
            if (p.model, p.batch_size, p.num_layers) != (first.model, first.batch_size, first.num_layers):
                raise UsageError(
                    f"profile {j} is {p.model} at batch {p.batch_size} with {p.num_layers} layers, "
                    f"profile 0 is {first.model} at batch {first.batch_size} with {first.num_layers}: "
                    "profile the same model at the same batch size on every GPU type"
                )
        n = first.num_layers
        if n < k:
            raise UsageError(
                f"cannot split {first.model}'s {n} layers over {k} GPUs: each stage needs at least "
                f"one layer; use at most {n} GPUs in this virtual worker"
            )
        cache = {} if cache is None else cache
        for p in profiles:
            if id(p) not in cache:
                cache[id(p)] = _Tables.of(p)
        tables = tuple(cache[id(p)] for p in profiles)
        caps = tuple(int(mem) - reserve_bytes for _, _, mem in gpus)
        return cls(
            tuple(profiles), tuple(gpus), tuple(float(r) for r in link_gbps), caps, reserve_bytes, tables
        )

    # -- tables per position

    @functools.cached_property
    def times(self) -> list[np.ndarray]:
        """stage_time of every position (independent of Nm, so computed once)."""
        return [self.stage_time(j) for j in range(len(self.gpus))]

    @functools.cached_property
    def stacked_times(self) -> np.ndarray:
        """`times` as one array (k, n+1, n+1)."""
        return np.stack(self.times)

    @functools.cached_property
    def _caps(self) -> np.ndarray:
        """Usable bytes per position, shaped to divide the stacked tables (k, 1, 1)."""
        return np.asarray(self.caps, dtype=np.float64)[:, None, None]

    def least_total_under(self, bar: float) -> float:
        """The least sum of stage times over the splits whose every stage takes at most `bar` (plus rounding),
        memory aside (inf when none): the round trip of a split at Nm is at least its sum over Nm, and one
        with a slower stage has a round trip over `bar` at any Nm."""
        times = self.stacked_times
        return self._min_max(times, times <= bar * (1 + 1e-6), np.add)[0]

    def _rate(self, link: int) -> float:
        """Bytes per second of link `link` (between GPU link and link + 1)."""
        return self.links[link] * 1e9 / 8

    def stage_time(self, j: int) -> np.ndarray:
        """Seconds per minibatch of layers [s, e) at position j: compute plus boundary transfers."""
        t = self.tables[j]
        time = t.compute.copy()
        # boundary[i]: the activation entering layer i (= the output of layer i - 1) one way plus its
        # gradient back; 0 at i = n, where the model output stays on the last stage
        boundary = 2 * np.append(t.act_in, 0).astype(np.float64)
        if j > 0:  # in at s
            time += (boundary / self._rate(j - 1))[:, None]
        if j < len(self.gpus) - 1:  # out at e
            time += (boundary / self._rate(j))[None, :]
        return time

    @functools.cached_property
    def _stacked(self) -> dict[str, np.ndarray]:
        return _stack(self.tables)

    def memories(self, rule: MemoryRule, out: np.ndarray | None = None) -> np.ndarray:
        """stage_memory_terms(...).total of every [s, e) at every position j, as tables (k, n+1, n+1), in
        `out` when given (solve's scratch: a new array this large costs more than the sums)."""
        return _memories(self._stacked, rule, out)

    # -- the dynamic programme

    def _min_max(
        self,
        values: np.ndarray,
        allowed: np.ndarray,
        combine: np.ufunc = np.maximum,
        scratch: np.ndarray | None = None,
    ) -> tuple[float, list[np.ndarray]]:
        """min over splits of max_j values[j][s_j, e_j] (or their sum, with combine=np.add), stages restricted
        to `allowed` (both (k, n+1, n+1)); argmins per stage. `scratch`: an array like `values` to use."""
        n = values.shape[1] - 1
        masked = np.empty_like(values) if scratch is None else scratch
        masked.fill(np.inf)
        np.copyto(masked, values, where=allowed & self._upper)
        after = np.full(n + 1, np.inf)
        after[n] = -np.inf if combine is np.maximum else 0.0  # no layers left after the last stage
        choices = []
        rows = np.arange(n + 1)
        for j in range(len(self.gpus) - 1, -1, -1):
            cand = combine(masked[j], after[None, :])
            choice = cand.argmin(axis=1)
            choices.append(choice)
            after = cand[rows, choice]
        return float(after[0]), choices[::-1]

    @functools.cached_property
    def _upper(self) -> np.ndarray:
        """Where stop > start: the spans that are stages."""
        return ~np.tri(self.tables[0].compute.shape[0], dtype=bool)

    @functools.cached_property
    def _scratch(self) -> tuple[np.ndarray, np.ndarray]:
        """Two float arrays like the stacked tables, reused by solve."""
        return np.empty_like(self.stacked_times), np.empty_like(self.stacked_times)

    @staticmethod
    def _walk(choices: Sequence[np.ndarray]) -> tuple[int, ...]:
        split, s = [], 0
        for choice in choices:
            e = int(choice[s])
            split.append(e - s)
            s = e
        return tuple(split)

    def solve(self, rule: MemoryRule) -> _Solution | None:
        """The split with the least bottleneck, then the least peak memory use; None when nothing fits."""
        times, caps = self.stacked_times, self._caps
        mems, masked = self._scratch
        self.memories(rule, out=mems)
        fits = mems <= caps
        bottleneck, _ = self._min_max(times, fits, scratch=masked)
        if math.isinf(bottleneck):
            return None
        limit = bottleneck * (1 + _TIE)  # equal up to rounding (prefix sums vs plain sums)
        use = np.divide(mems, caps, out=mems)
        peak, choices = self._min_max(use, fits & (times <= limit), scratch=masked)
        return _Solution(self._walk(choices), bottleneck, peak)

    def least_overcommit(self, rule: MemoryRule) -> tuple[float, tuple[int, ...]]:
        """The split whose fullest GPU is least full (memory / usable memory, may exceed 1), ignoring time."""
        use = self.memories(rule) / np.maximum(self._caps, 1)
        worst, choices = self._min_max(use, np.ones_like(use, dtype=bool))
        return worst, self._walk(choices)

    # -- results

    def check_split(self, split: Sequence[int]) -> tuple[int, ...]:
        n, k = self.profiles[0].num_layers, len(self.gpus)
        if (
            len(split) != k
            or any(isinstance(c, bool) or not isinstance(c, int) or c < 1 for c in split)
            or sum(split) != n
        ):
            raise UsageError(
                f"fixed split {list(split)} does not fit {self.profiles[0].model}: give {k} layer "
                f"counts (one per GPU), each >= 1, summing to its {n} layers"
            )
        return tuple(split)

    def stage_plan(self, j: int, start: int, stop: int, rule: MemoryRule) -> StagePlan:
        profile = self.profiles[j]
        layers = profile.layers[start:stop]
        act_in = profile.input_bytes if start == 0 else profile.layers[start - 1].output_bytes
        recv = send = 0.0
        if j > 0:  # activation in, input gradient back
            recv += act_in / self._rate(j - 1)
            send += act_in / self._rate(j - 1)
        if j < len(self.gpus) - 1:  # activation out, output gradient in
            out = layers[-1].output_bytes
            send += out / self._rate(j)
            recv += out / self._rate(j)
        memory = stage_memory_terms(layers, j, len(self.gpus), rule, input_bytes=act_in).total
        ref, gpu_type, _ = self.gpus[j]
        return StagePlan(
            gpu=ref,
            gpu_type=gpu_type,
            start=start,
            stop=stop,
            forward_s=sum(layer.forward_s for layer in layers),
            backward_s=sum(layer.backward_s for layer in layers),
            recv_s=recv,
            send_s=send,
            memory_bytes=memory,
            memory_limit_bytes=self.caps[j],
        )

    def plan(self, split: Sequence[int], rule: MemoryRule) -> VwPlan:
        bounds = [0, *itertools.accumulate(split)]
        stages = tuple(self.stage_plan(j, s, e, rule) for j, (s, e) in enumerate(itertools.pairwise(bounds)))
        return VwPlan(
            stages=stages, nm=rule.nm, param_bytes=sum(layer.param_bytes for layer in self.profiles[0].layers)
        )

    def round_trip(self, split: Sequence[int], rule: MemoryRule) -> float:
        """round_trip_bound of the split, from the time tables (the plan only with a recomputing backward)."""
        if rule.recompute:
            return round_trip_bound(self.plan(split, rule), rule.schedule, True)
        bounds = [0, *itertools.accumulate(split)]
        both = [float(self.times[j][s, e]) for j, (s, e) in enumerate(itertools.pairwise(bounds))]
        return _round_trip(both, rule.nm, get_schedule(rule.schedule).drains)

    def steady_time(self, split: Sequence[int], rule: MemoryRule) -> float:
        return minibatch_time_s(self.plan(split, rule), rule.schedule, rule.recompute)

    # -- messages

    def _where(self, j: int) -> str:
        ref, gpu_type, mem = self.gpus[j]
        reserve = f" minus a reserve of {format_bytes(self.reserve)}" if self.reserve else ""
        return f"stage {j} on GPU {ref} ({gpu_type}, {format_bytes(mem)}{reserve})"

    def overflow_message(self, j: int, split: Sequence[int], rule: MemoryRule, which: str) -> str:
        start = sum(split[:j])
        stop = start + split[j]
        profile = self.profiles[j]
        act_in = profile.input_bytes if start == 0 else profile.layers[start - 1].output_bytes
        terms = stage_memory_terms(profile.layers[start:stop], j, len(self.gpus), rule, input_bytes=act_in)
        layers = f"layer {start}" if stop - start == 1 else f"layers {start}-{stop - 1}"
        return (
            f"{profile.model} at batch {profile.batch_size}, nm={rule.nm}: with {which}, "
            f"{self._where(j)} needs "
            f"{format_bytes(terms.total)} for {layers} but has {format_bytes(max(self.caps[j], 0))} usable "
            f"({terms.describe()})"
        )

    def infeasible_message(self, rule: MemoryRule, *, orders_tried: bool = False) -> str:
        _, split = self.least_overcommit(rule)
        k = len(self.gpus)
        mems = self.memories(rule)
        usage = [mems[j][sum(split[:j]), sum(split[: j + 1])] for j in range(k)]
        j = max(range(k), key=lambda i: usage[i] / max(self.caps[i], 1))
        which = (
            f"the best case (the split {list(split)}, which needs the least memory, "
            f"in the best order of the GPUs, with nm=1)"
            if orders_tried
            else f"the best case (the split {list(split)}, which needs the least memory)"
        )
        fix = (
            "lower batch_size, lower nm, or add GPUs to the VW"
            if rule.nm > 1
            else "lower batch_size or add GPUs to the VW"
        )
        if rule.weight_stashing and rule.nm > 1 and get_schedule(rule.schedule).stashing == "optional":
            fix += (
                " (or turn weight_stashing off, or use a flushing schedule such as "
                f'"{flushing_schedule().name}")'
            )
        return (
            f"no split of {self.profiles[0].model} over virtual worker {', '.join(g[0] for g in self.gpus)} "
            f"fits: {self.overflow_message(j, split, rule, which)}\n  {fix}"
        )


# ---------------------------------------------------------------------------------------------- helpers


def _check_nm(nm: int, what: str) -> None:
    if isinstance(nm, bool) or not isinstance(nm, int) or nm < 1:
        raise UsageError(f"{what} must be an integer >= 1, got {nm!r}")


def _link(link_gbps: Callable[[str, str], float], a: str, b: str) -> float:
    rate = link_gbps(a, b)
    if not (rate > 0 and math.isfinite(rate)):
        raise UsageError(
            f"link bandwidth between {a} and {b} must be a finite number > 0 Gbit/s, got {rate!r}"
        )
    return float(rate)


def _orders(gpus: Sequence[Gpu], max_orders: int) -> Iterator[tuple[Gpu, ...]]:
    """Distinct orders of `gpus` (same type, memory and node = interchangeable), large memory first."""

    def key(g: Gpu) -> tuple[int, str, str]:
        return (-g[2], g[1], g[0].rsplit(":", 1)[0])

    groups: dict[tuple[int, str, str], list[Gpu]] = {}
    for g in sorted(gpus, key=key):
        groups.setdefault(key(g), []).append(g)
    counts = Counter({kind: len(members) for kind, members in groups.items()})
    total = math.factorial(len(gpus))
    for c in counts.values():
        total //= math.factorial(c)
    if total <= max_orders:
        kinds = _multiset_permutations(list(groups), counts, len(gpus))
    else:
        by_memory = [key(g) for g in sorted(gpus, key=key)]
        node_best: dict[str, tuple[int, str]] = {}
        for g in gpus:
            node = g[0].rsplit(":", 1)[0]
            node_best[node] = min(node_best.get(node, (-g[2], node)), (-g[2], node))
        by_node = [key(g) for g in sorted(gpus, key=lambda g: (node_best[g[0].rsplit(":", 1)[0]], key(g)))]
        kinds = iter([by_memory] if by_node == by_memory else [by_memory, by_node])
    for kind_order in kinds:
        taken: Counter[tuple[int, str, str]] = Counter()
        order = []
        for kind in kind_order:
            order.append(groups[kind][taken[kind]])
            taken[kind] += 1
        yield tuple(order)


def _multiset_permutations(kinds: list, counts: Counter, length: int) -> Iterator[list]:
    """Distinct permutations in lexicographic order of `kinds` (already sorted)."""
    if length == 0:
        yield []
        return
    for kind in kinds:
        if counts[kind]:
            counts[kind] -= 1
            for rest in _multiset_permutations(kinds, counts, length - 1):
                yield [kind, *rest]
            counts[kind] += 1


@functools.lru_cache(maxsize=4096)
def _steady(
    forward: tuple[float, ...], backward: tuple[float, ...], nm: int, schedule: str = DEFAULT_SCHEDULE
) -> float:
    """Steady-state time per minibatch of a schedule: the makespan growth from w to 2w waves, with
    w * nm >= 2k + 2nm minibatches, past the fill (checked against much longer runs when written)."""
    k = len(forward)
    fwd = [max(f, 1e-12) for f in forward]  # simulate wants times > 0
    bwd = [max(b, 1e-12) for b in backward]
    waves = -(-2 * k // nm) + 2

    def makespan(w: int) -> float:
        return simulate(_checked(schedule, k, nm, w), fwd, bwd, check=False).makespan  # D = w: never waits

    if get_schedule(schedule).drains:  # waves never overlap: one wave's makespan is the period (to 1e-14)
        return makespan(1) / nm
    return (makespan(2 * waves) - makespan(waves)) / (waves * nm)


@functools.lru_cache(maxsize=1024)
def _checked(schedule: str, k: int, nm: int, waves: int) -> Schedule:
    """The schedule's lists for one VW (D = waves), validated once: _steady runs them many times with other
    times, and the check (what pipeline.schedule.simulate does first on every run) would cost more than the
    run."""
    lists = get_schedule(schedule)(k, nm, waves, waves)
    validate(lists)
    return lists
