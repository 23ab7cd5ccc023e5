"""The groupings the fast search plans (docs/planning.md#search-at-scale), lazily: plan_candidates' own (one
common Nm, per-VW work, each with only its fastest 1, 2, ... VWs), each with its VWs counted by kind and built
only when asked, so that a 1,024-GPU cluster's thousands of groupings cost O(kinds) each. Pure."""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np

from hetpipe.core.planning.analytic import Kind
from hetpipe.core.planning.groupings import Fitted, Grouping, GroupingSearch
from hetpipe.core.planning.partition import minibatch_time_s
from hetpipe.core.planning.per_vw_work import KEEP_FEWER, PerVwWork, fewer_note, work_text
from hetpipe.core.planning.plan import VwPlan
from hetpipe.core.planning.relays import home_node, node_kinds, prefix_ps_bytes
from hetpipe.core.planning.wave_balance import TOLERANCE, WorkOption, _off

__all__ = ["Interner", "Shape", "kinds_of", "shapes"]

_FEWER_NOTE = (
    "only the {k} fastest of the policy's {n} VWs: WSP paces every VW by the slowest, each sends its own PS "
    "traffic, and fewer VWs may need fewer samples to target"
)


def _blank(vw: VwPlan) -> VwPlan:
    """The VW without its GPUs' names: what makes VWs alike for the model."""
    return dataclasses.replace(vw, stages=tuple(dataclasses.replace(s, gpu="") for s in vw.stages))


@dataclass
class Interner:
    """A kind id per distinct VW without GPU names, and a random 64-bit tag per distinct VW (its GPUs and its
    kind): the tags of a set of VWs, summed, name the set."""

    kinds: dict[VwPlan, int] = field(default_factory=dict)
    tags: dict[tuple[tuple[str, ...], int], int] = field(default_factory=dict)
    rng: random.Random = field(default_factory=lambda: random.Random(0))

    def kind(self, vw: VwPlan) -> int:
        return self.kinds.setdefault(_blank(vw), len(self.kinds))

    def tag(self, gpus: tuple[str, ...], kind: int) -> int:
        key = (gpus, kind)
        if key not in self.tags:
            self.tags[key] = self.rng.getrandbits(64)
        return self.tags[key]


@dataclass(frozen=True)
class Shape:
    """One grouping, lazily: its size, its VWs counted by kind (kind id, a VW of that kind, count), a key
    (equal keys, equal sets of VWs), how to build its VWs and notes, its VWs that node aggregation would
    relay: per node holding two or more wholly, their kind ids (relays.node_kinds), and the D it is sized for
    (None: planned at every D; per-VW work sizes each VW's wave for one D)."""

    k: int
    kinds: tuple[tuple[int, VwPlan, int], ...]
    key: tuple[int, int]
    build: Callable[[], Grouping]
    groups: Callable[[], dict[str, tuple[int, ...]]]
    staleness: int | None = None

    def grouping(self) -> Grouping:
        """The VWs (in the policy's order) and the notes, as plan_candidates' groupings."""
        return self.build()


def kinds_of(shape: Shape) -> list[Kind]:
    """The shape's kinds as (a VW of that kind, count), for analytic.py."""
    return [(vw, count) for _, vw, count in shape.kinds]


def _common_shapes(
    vws: Sequence[VwPlan], notes: Sequence[str], schedule: str, interner: Interner
) -> Iterator[Shape]:
    """The grouping (all its VWs), then its fastest 1, 2, ... (GroupingSearch.fewer), kinds counted."""
    n = len(vws)
    times = [minibatch_time_s(vw, schedule) for vw in vws]
    fastest = sorted(range(n), key=lambda i: times[i])
    kind = [interner.kind(vw) for vw in vws]
    tags = [interner.tag(vw.gpus, kind[i]) for i, vw in enumerate(vws)]
    counts: dict[int, int] = {}
    rep: dict[int, VwPlan] = {}
    tag = 0
    prefixes: dict[int, tuple[tuple[tuple[int, VwPlan, int], ...], int]] = {}
    for k, i in enumerate(fastest, start=1):
        counts[kind[i]] = counts.get(kind[i], 0) + 1
        rep.setdefault(kind[i], vws[i])
        tag = (tag + tags[i]) % 2**64
        prefixes[k] = (tuple((c, rep[c], counts[c]) for c in sorted(counts)), tag)

    def build(k: int) -> Callable[[], Grouping]:
        def grouping() -> Grouping:
            chosen = tuple(vws[i] for i in sorted(fastest[:k]))
            return chosen, tuple(notes) if k == n else (*notes, _FEWER_NOTE.format(k=k, n=n))

        return grouping

    relayed: list[dict[str, tuple[int, ...]]] = []  # per prefix, once asked: node aggregation's groups

    def groups(k: int) -> Callable[[], dict[str, tuple[int, ...]]]:
        def of_prefix() -> dict[str, tuple[int, ...]]:
            if not relayed:  # every prefix in one pass, each VW changing one node's group
                by_node: dict[str, tuple[int, ...]] = {}
                now: dict[str, tuple[int, ...]] = {}
                for i in fastest:
                    node = home_node(vws[i].gpus)
                    if node is not None:
                        by_node[node] = tuple(sorted((*by_node.get(node, ()), kind[i])))
                        if len(by_node[node]) > 1:
                            now = {**now, node: by_node[node]}
                    relayed.append(now)
            return relayed[k - 1]

        return of_prefix

    for k in [n, *range(1, n)]:
        kinds, tag_k = prefixes[k]
        yield Shape(k, kinds, (k, tag_k), build(k), groups(k))


def shapes(
    search: GroupingSearch,
    work: PerVwWork,
    policy: str,
    schedule: str,
    nm_max: int | None,
    interner: Interner,
    ds: Sequence[int] = (0,),
) -> Iterator[Shape] | str:
    """The shapes plan_candidates plans for one policy and schedule (without slower_but_fewer), in its
    order: the grouping at one common Nm and its fastest 1, 2, ...; then per-VW work for each D of `ds`. Or
    why the policy cannot run. Duplicates (the same VWs at the same D) are the caller's to skip, by
    Shape.key and Shape.staleness."""
    grouping = search.grouping(policy, nm_max, schedule)
    if isinstance(grouping, str):
        return grouping
    vws, notes = grouping

    def generate() -> Iterator[Shape]:
        yield from _common_shapes(vws, notes, schedule, interner)
        for d in ds:
            yield from _work_shapes(search, work, search.fit(policy, nm_max, schedule), interner, d)

    return generate()


# ---------------------------------------------------------------------------------------------- per-VW work


def _work_shapes(
    search: GroupingSearch, work: PerVwWork, fitted: Fitted | str, interner: Interner, staleness: int
) -> Iterator[Shape]:
    """PerVwWork.groupings at D = `staleness`, by kinds: for each n, the fastest n VWs each at the option
    wave_balance.balance chooses (the same choice, counted per kind), kept when within KEEP_FEWER of the best
    estimate; each built only when asked."""
    if isinstance(fitted, str) or not work.enabled:
        return
    for variant in fitted.for_work():
        yield from _variant_shapes(search, work, variant, interner, staleness)


def _variant_shapes(
    search: GroupingSearch, work: PerVwWork, fitted: Fitted, interner: Interner, staleness: int
) -> Iterator[Shape]:
    """_work_shapes for one set of VWs (Fitted.for_work)."""
    vws = [vw for *_, vw in fitted.vws]
    rule = fitted.rule
    times = [minibatch_time_s(vw, rule.schedule, rule.recompute) for vw in vws]
    fastest = sorted(range(len(vws)), key=lambda i: times[i])
    kind_key = [interner.kind(vw) for vw in vws]
    rep_of: dict[int, VwPlan] = {}
    counts: dict[int, int] = {}
    for i, vw in enumerate(vws):
        rep_of.setdefault(kind_key[i], vw)
        counts[kind_key[i]] = counts.get(kind_key[i], 0) + 1
    cache: dict = {}
    found: list[tuple[int, _Choice]] = []
    homes = [home_node(vw.gpus) for vw in vws] if work.node_aggregation else []
    # with node aggregation the PS's seconds depend on which nodes the fastest n VWs share
    one_pass = prefix_ps_bytes([vws[i] for i in fastest]) if work.node_aggregation else []
    for n in range(len(vws), 0, -1):
        ps_s = work.relayed_ps_s(one_pass[n - 1], n) if work.node_aggregation else None
        chosen = _balance_kinds(work, dict(counts), rep_of, fitted, cache, staleness, ps_s)
        if chosen is not None:
            found.append((n, chosen))
        gone = kind_key[fastest[n - 1]]  # the slowest of the n leaves for n - 1
        counts[gone] -= 1
        if not counts[gone]:
            del counts[gone]
    top = max((c.samples_per_s for _, c in found), default=0.0)
    every = found[0][1] if found and found[0][0] == len(vws) else None
    at: dict[
        tuple[int, WorkOption], tuple[int, VwPlan]
    ] = {}  # (kind, option) -> its kind at the option, a plan
    for n, chosen in found:
        if chosen.samples_per_s < KEEP_FEWER * top:
            continue
        kept = sorted(fastest[:n])
        counts: dict[int, int] = {}
        reps: dict[int, VwPlan] = {}
        tag = 0
        each: list[tuple[int, str | None]] = []
        for i in kept:
            key = (kind_key[i], chosen.option[kind_key[i]])
            if key not in at:
                plan = search.with_params(work.at(vws[i], key[1].nm, key[1].batch))
                at[key] = (interner.kind(plan), plan)
            kind, plan = at[key]
            counts[kind] = counts.get(kind, 0) + 1
            reps.setdefault(kind, plan)
            tag = (tag + interner.tag(vws[i].gpus, kind)) % 2**64
            if homes:
                each.append((kind, homes[i]))
        kinds = tuple((c, reps[c], counts[c]) for c in sorted(counts))
        groups = node_kinds(each)
        yield Shape(
            n,
            kinds,
            (n, tag),
            _work_builder(search, work, fitted, vws, kind_key, kept, chosen, every),
            lambda groups=groups: groups,
            staleness,
        )


def _work_builder(
    search: GroupingSearch,
    work: PerVwWork,
    fitted: Fitted,
    vws: Sequence[VwPlan],
    kind_key: Sequence[VwPlan],
    kept: Sequence[int],
    chosen: _Choice,
    every: _Choice | None,
) -> Callable[[], Grouping]:
    """How to build a per-VW work shape's VWs and notes (PerVwWork.groupings' and .notes'; `every`: the
    choice for all the VWs)."""

    def grouping() -> Grouping:
        plans = tuple(
            search.with_params(
                work.at(vws[i], chosen.option[kind_key[i]].nm, chosen.option[kind_key[i]].batch)
            )
            for i in kept
        )
        held = [
            f"memory: vw{v} would do {over.nm} x {over.batch} per wave, but {over.over}"
            for v, i in enumerate(kept)
            if (over := chosen.held.get(kind_key[i])) is not None
        ]
        note = (
            f"per-VW work (Nm x batch per VW): {work_text(plans, search.batch)}, so that every wave takes "
            f"about {chosen.wave_s:.3g} s"
        )
        fewer = every and (every.samples_per_s, every.wave_s, every.ps_s)
        extra = [fewer_note(len(kept), len(vws), fewer)] if len(kept) < len(vws) else []
        return plans, (*fitted.left_out, note, *held, *extra)

    return grouping


@dataclass(frozen=True)
class _Choice:
    option: dict  # kind key -> WorkOption
    wave_s: float
    samples_per_s: float
    held: dict  # kind key -> the larger WorkOption memory refused
    ps_s: float = 0.0  # the PS's seconds per wave


def _balance_kinds(
    work: PerVwWork,
    counts: dict[int, int],
    rep_of: dict[int, VwPlan],
    fitted: Fitted,
    cache: dict,
    staleness: int,
    ps_s: float | None = None,
) -> _Choice | None:
    """wave_balance.balance over VWs counted by kind (`counts`: kind id -> VWs; rep_of: a VW of each kind):
    the same choice, one option per kind, scored with numpy over the candidate wave times; ladders and the
    options each wave time picks are cached in `cache` per kind and per set of kinds. Memory as at D =
    `staleness`. `ps_s`: the PS's seconds per wave when the kinds do not tell it (node aggregation:
    PerVwWork.ps_s of the VWs)."""
    from hetpipe.core.planning.wave_balance import _Ladder

    n_vws = sum(counts.values())
    pulls = work.pulls(n_vws)
    rule = dataclasses.replace(fitted.rule, pulls=pulls, staleness=staleness)
    base = work.search.batch
    keys_list = sorted(counts)
    ladders: dict[int, _Ladder] = {}
    for key in keys_list:
        if (key, rule) not in cache:
            opts = work.options(rep_of[key], rule, fitted.cap)
            cache[(key, rule)] = cache.setdefault(("ladder", opts), _Ladder(opts, base))
        ladders[key] = cache[(key, rule)]
    if any(not ladder.times for ladder in ladders.values()):
        return None
    table_key = ("picks", tuple(keys_list), rule)
    if table_key not in cache:
        floor = max(ladder.times[0] for ladder in ladders.values())
        distinct = {id(ladder): ladder for ladder in ladders.values()}
        times = sorted({t for ladder in distinct.values() for t in ladder.times if t >= floor})
        picks = [[ladders[key].within(t) for key in keys_list] for t in times]
        samples = np.array([[o.samples for o in row] for row in picks], dtype=np.float64)
        waves = np.array([[o.wave_s for o in row] for row in picks], dtype=np.float64)
        offs = np.array([[_off(o, base) for o in row] for row in picks], dtype=np.float64)
        cache[table_key] = (picks, samples, waves.max(axis=1), offs)
    picks, samples, wave, offs = cache[table_key]
    n = np.array([counts[k] for k in keys_list], dtype=np.float64)
    if ps_s is None:
        ps_s = (
            sum(counts[k] * rep_of[k].param_bytes for k in keys_list)
            * (2 if pulls else 1)
            / work.ps_bytes_per_s
        )
    total = samples @ n
    span = np.maximum(wave, ps_s)
    rate = np.where(span > 0, total / np.where(span > 0, span, 1.0), np.inf)
    off = np.round(offs @ n, 9)
    top = rate.max()
    eligible = np.flatnonzero(rate >= top * (1 - TOLERANCE))
    r = int(min(eligible, key=lambda i: (off[i], wave[i], i)))
    option = dict(zip(keys_list, picks[r], strict=True))
    held = {}
    for key in keys_list:
        larger = ladders[key].held(float(wave[r]), option[key])
        if larger is not None:
            held[key] = larger
    return _Choice(option, float(wave[r]), float(rate[r]), held, float(ps_s))
