"""The HetPipe side of the planner's search: the cluster's GPUs as the partitioner sees them, and for an
allocation policy and a schedule its virtual workers, each at its own best GPU order, split and Nm (`fit`; the
per-VW work of hetpipe.core.planning.per_vw_work starts there) or at one common Nm (`grouping`), the variants
with fewer or slower VWs, and each VW's memory under a candidate's D at its own Nm and batch. Pure."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from hetpipe.core.config.schema import ClusterConfig, GpuRef
from hetpipe.core.errors import HetpipeError, UsageError
from hetpipe.core.pipeline.schedule import DEFAULT_SCHEDULE, get_schedule
from hetpipe.core.planning.candidates import first_line
from hetpipe.core.planning.kinds import links_node_blind, order_kind, rename, rename_in_order, vw_kind
from hetpipe.core.planning.memory import MemoryRule, stage_memory_terms
from hetpipe.core.planning.partition import Gpu, best_order_and_nm, minibatch_time_s, partition
from hetpipe.core.planning.plan import VwPlan
from hetpipe.core.planning.profile import ModelProfile
from hetpipe.core.planning.wave_balance import largest_fine_batch

__all__ = ["Fitted", "Grouping", "GroupingSearch", "gpu_list", "pipelines_by_node"]

Grouping = tuple[tuple[VwPlan, ...], tuple[str, ...]]  # the VWs of a policy, and notes on what was left out
# a VW that holds the model: its index in the policy, its GPUs in stage order, a fixed split or None, its plan
FittedVw = tuple[int, list[Gpu], "Sequence[int] | None", VwPlan]
_GIB = 2**30


@dataclass(frozen=True)
class Fitted:
    """A policy's VWs that hold the model, each at its own best order, split and Nm; notes on those left out;
    the memory rule they were split under and the Nm cap."""

    vws: tuple[FittedVw, ...]
    left_out: tuple[str, ...]
    rule: MemoryRule
    cap: int
    # per-VW work's other VWs and notes: GPUs that hold the model alone only at a smaller minibatch as VWs of
    # their own (at the config's batch they are left out, or pipelined by dp)
    work_vws: tuple[FittedVw, ...] | None = None
    work_left_out: tuple[str, ...] = ()

    def for_work(self) -> tuple[Fitted, ...]:
        """The sets of VWs per-VW work plans: these, and where some GPUs hold the model alone only at a
        smaller minibatch, the same with those GPUs as VWs of their own."""
        if self.work_vws is None:
            return (self,)
        alone = dataclasses.replace(self, vws=self.work_vws, left_out=self.work_left_out, work_vws=None)
        return (self, alone)


class GroupingSearch:
    """The cluster's GPUs as the partitioner sees them, and the per-policy groupings of them into VWs."""

    def __init__(
        self,
        config: ClusterConfig,
        profiles: Mapping[str, ModelProfile],
        link: Callable[[str, str], float],
        reserve: int,
        frozen: int = 0,
    ) -> None:
        """`frozen` > 0: a re-plan's search, the model's first `frozen` layers frozen from the start
        (`profiles` already say so: freeze_gain.frozen_profiles)."""
        self.config, self.profiles, self.link, self.reserve = config, profiles, link, reserve
        self.frozen = frozen
        self.batch = config.train.batch_size
        self.any_profile = profiles[
            config.nodes[0].gpus[0]
        ]  # the model's layers and sizes (same on every type)
        self.solved: dict[tuple, VwPlan | HetpipeError] = {}
        self.fitted: dict[tuple, Fitted | str] = {}
        self.at_batch: dict[tuple[str, int], ModelProfile] = {}
        self.splits: dict[tuple, VwPlan | HetpipeError] = {}
        self._node_blind: bool | None = None

    @property
    def node_blind(self) -> bool:
        """Whether the links depend only on two GPUs sharing a node (kinds.links_node_blind): then VWs of one
        kind are partitioned once (kinds.vw_kind)."""
        if self._node_blind is None:
            by_node = [[f"{node.name}:{i}" for i in range(len(node.gpus))] for node in self.config.nodes]
            self._node_blind = links_node_blind(self.link, by_node)
        return self._node_blind

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
            recompute=self.config.train.recompute and get_schedule(schedule).recompute,
        )

    def split(
        self, gpus: Sequence[Gpu], nm: int, rule: MemoryRule, fixed: Sequence[int] | None = None
    ) -> VwPlan:
        """The partitioner's split of `gpus` in this order at `nm` under `rule` (or `fixed`, checked), with
        this cluster's profiles, links and memory reserve. Solved once per order_kind when the links are
        node-blind."""
        if not self.node_blind:
            return self._split(gpus, nm, rule, fixed)
        key = (order_kind(gpus), nm, rule, None if fixed is None else tuple(fixed))
        if key not in self.splits:
            try:
                self.splits[key] = self._split(gpus, nm, rule, fixed)
            except HetpipeError as exc:
                self.splits[key] = exc
        found = self.splits[key]
        if isinstance(found, HetpipeError):
            raise found
        return rename_in_order(found, gpus)

    def _split(self, gpus: Sequence[Gpu], nm: int, rule: MemoryRule, fixed: Sequence[int] | None) -> VwPlan:
        profiles = [self.profiles[g[1]] for g in gpus]
        return partition(
            profiles, gpus, self.links_of(gpus), nm, rule=rule, reserve_bytes=self.reserve, fixed_split=fixed
        )

    def profile(self, gpu_type: str, batch: int) -> ModelProfile:
        """The model on `gpu_type` at minibatch size `batch`: the planner's profile, rescaled by proportion
        (ModelProfile.at_batch) when the batch is another than the config's; cached."""
        if batch == self.batch:
            return self.profiles[gpu_type]
        key = (gpu_type, batch)
        if key not in self.at_batch:
            self.at_batch[key] = self.profiles[gpu_type].at_batch(batch)
        return self.at_batch[key]

    def stage_bytes(self, vw: VwPlan, rule: MemoryRule) -> list[int]:
        """Each stage's peak memory under `rule` at the VW's Nm and its own minibatch size."""
        k = len(vw.stages)
        out = []
        for j, s in enumerate(vw.stages):
            profile = self.profile(s.gpu_type, vw.batch(self.batch))
            act_in = profile.input_bytes if s.start == 0 else profile.layers[s.start - 1].output_bytes
            memory = stage_memory_terms(
                profile.layers[s.start : s.stop], j, k, rule.with_nm(vw.nm), input_bytes=act_in
            )
            out.append(memory.total)
        return out

    def with_memory(self, vw: VwPlan, rule: MemoryRule) -> VwPlan:
        """The VW's stages with their memory recomputed under `rule` (its D sets how many update sums a stage
        keeps) at the VW's Nm and minibatch size, so every candidate shows the peak memory of its own D."""
        stages = tuple(
            dataclasses.replace(s, memory_bytes=m)
            for s, m in zip(vw.stages, self.stage_bytes(vw, rule), strict=True)
        )
        return dataclasses.replace(vw, stages=stages)

    def fit(self, policy: str, nm_max: int | None, schedule: str = DEFAULT_SCHEDULE) -> Fitted | str:
        """The VWs of `policy` under `schedule` that hold the model, each at its own best GPU order, split and
        Nm (up to the schedule's cap), with notes on those left out; or why the policy cannot run. Cached."""
        key = (policy, nm_max, schedule)
        if key not in self.fitted:
            self.fitted[key] = self._fit(policy, nm_max, schedule)
        return self.fitted[key]

    def _fit(self, policy: str, nm_max: int | None, schedule: str) -> Fitted | str:
        from hetpipe.core.planning.cluster import allocate

        try:
            groups = allocate(self.config, policy)
        except UsageError as exc:
            return str(exc)
        rule = self.rule(schedule, self.config.wsp.staleness, len(groups))
        listed = self.config.virtual_workers if policy == "explicit" else None
        deepest = max(len(g) for g in groups)
        cap = nm_max if nm_max is not None else get_schedule(schedule).nm_cap(self.config.wsp.nm, deepest)
        fitted: list[FittedVw] = []
        left_out: list[str] = []
        alone: list[GpuRef] = []  # dp: GPUs that cannot hold the model alone
        # VWs that hold it only at a smaller minibatch, and that batch
        smaller: list[tuple[FittedVw, int]] = []
        for v, refs in enumerate(groups):
            gpus = [self.gpu(ref) for ref in refs]
            split = listed[v].layers if listed else None
            try:
                vw = self.fixed_order(gpus, cap, split, rule) if listed else self.best_order(gpus, cap, rule)
            except HetpipeError as exc:  # UsageError included: more GPUs than layers
                left_out.append(f"vw{v} ({gpu_list(gpus)}) left out: {first_line(exc)}")
                alone += refs if policy == "dp" else []
                found = None if listed else at_smaller_batch(self, gpus, cap, rule)
                if found is not None:
                    vw, batch = found
                    smaller.append((as_fitted(v, gpus, None, vw), batch))
                continue
            fitted.append(as_fitted(v, gpus, split, vw))

        def holds(refs: list[GpuRef]) -> bool:  # best_order solves once per kind of VW: asking again is free
            try:
                self.best_order([self.gpu(ref) for ref in refs], cap, rule)
            except HetpipeError:
                return False
            return True

        fitted_alone, unpipelined = list(fitted), list(left_out)
        pipes, left_out = pipelined_vws(
            self, pipelines_by_node(alone, holds), len(groups), cap, rule, left_out
        )
        fitted += pipes
        if not fitted:  # per-VW work needs one VW at the config's batch to start from (grouping)
            return "no virtual worker of this policy can hold the model:\n    " + "\n    ".join(left_out)
        work = alone_at_smaller_batch(
            self, fitted_alone, unpipelined, smaller, alone, holds, len(groups), cap, rule
        )
        return Fitted(tuple(fitted), tuple(left_out), rule, cap, *work)

    def grouping(self, policy: str, nm_max: int | None, schedule: str = DEFAULT_SCHEDULE) -> Grouping | str:
        """The VWs of `policy` at one common Nm under `schedule`, with notes; or why the policy cannot run."""
        fitted = self.fit(policy, nm_max, schedule)
        if isinstance(fitted, str):
            return fitted
        rule = fitted.rule
        chosen: tuple[tuple[float, int], tuple[VwPlan, ...], list[str]] | None = None
        for nm in sorted({vw.nm for *_, vw in fitted.vws}):
            vws, dropped = [], []
            for v, gpus, split, vw in fitted.vws:
                if vw.nm == nm:
                    vws.append(vw)
                    continue
                try:
                    vws.append(self.split(gpus, nm, rule, split))
                except HetpipeError as exc:
                    dropped.append(
                        f"vw{v} ({gpu_list(gpus)}) left out: the others at nm={nm} without it predict "
                        f"more than with it at its nm={vw.nm}, and at nm={nm} {first_line(exc)}"
                    )
            if not vws:
                continue
            slowest = max(minibatch_time_s(vw, schedule, rule.recompute) for vw in vws)
            score = (len(vws) * self.batch / slowest, nm)
            if chosen is None or score > chosen[0]:
                chosen = (score, tuple(vws), dropped)
        assert chosen is not None  # the smallest chosen nm always fits every VW that chose a larger one
        _, vws, dropped = chosen
        return tuple(self.with_params(vw) for vw in vws), (*fitted.left_out, *dropped)

    def slower_but_fewer(self, grouping: Grouping, policy: str, schedule: str) -> list[Grouping]:
        """`grouping`, then the policy's groupings at every smaller Nm cap, then each of these with only its
        fastest 1, 2, ... VWs (plan_candidates' slower_but_fewer); each distinct set of VWs once."""
        out = [grouping]
        for cap in range(grouping[0][0].nm - 1, 0, -1):
            found = self.grouping(policy, cap, schedule)  # cap < the chosen Nm <= nm_max
            if not isinstance(found, str):
                out.append(found)
        return self.fewer(out, schedule)

    def fewer(self, groupings: list[Grouping], schedule: str) -> list[Grouping]:
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
        distinct: list[Grouping] = []
        for vws, notes in out:
            if all(vws != seen for seen, _ in distinct):
                distinct.append((vws, notes))
        return distinct

    def best_order(self, gpus: list[Gpu], cap: int, rule: MemoryRule) -> VwPlan:
        """best_order_and_nm, solved once per kind of VW: VWs whose GPUs have the same types, memories and
        nodes (ED and HD make several) get the same plan with their own GPU names; with node-blind links, VWs
        of one kinds.vw_kind, whatever their nodes."""
        blind = self.node_blind
        kind = vw_kind(gpus) if blind else tuple(sorted((g[1], g[2], g[0].rsplit(":", 1)[0]) for g in gpus))
        key = (kind, cap, rule)
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
        if blind:
            return rename(found, gpus, self.reserve)
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
        found, error = None, None

        def time_of(vw: VwPlan) -> float:
            return minibatch_time_s(vw, rule.schedule, rule.recompute)

        for nm in range(cap, 0, -1):
            try:
                vw = self.split(gpus, nm, rule, split)
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


def pipelined_vws(
    search: GroupingSearch,
    groups: Sequence[list[GpuRef]],
    first: int,
    cap: int,
    rule: MemoryRule,
    left_out: list[str],
) -> tuple[list[FittedVw], list[str]]:
    """dp's pipelines of GPUs that hold the model only together (numbered from `first`) as fitted VWs,
    and `left_out` without their GPUs' notes and with one saying they were pipelined."""
    fitted: list[FittedVw] = []
    pipelined: list[str] = []
    left_out = list(left_out)
    for v, refs in enumerate(groups, start=first):
        gpus = [search.gpu(ref) for ref in refs]
        try:
            vw = search.best_order(gpus, cap, rule)
        except HetpipeError as exc:  # a remainder the last group took made it another kind
            left_out.append(f"vw{v} ({gpu_list(gpus)}, pipelined) left out: {first_line(exc)}")
            continue
        names = {str(ref) for ref in refs}
        left_out = [note for note in left_out if not any(f"({n} " in note for n in names)]
        pipelined.append(f"vw{v} ({gpu_list(gpus)})")
        fitted.append(as_fitted(v, gpus, None, vw))
    if pipelined:
        left_out.append(f"GPUs that hold the model only together, pipelined: {'; '.join(pipelined)}")
    return fitted, left_out


def as_fitted(v: int, gpus: Sequence[Gpu], split: Sequence[int] | None, vw: VwPlan) -> FittedVw:
    """VW v of the policy as Fitted keeps it: its GPUs in the stage order of its plan `vw`."""
    return (v, [next(g for g in gpus if g[0] == ref) for ref in vw.gpus], split, vw)


def alone_at_smaller_batch(
    search: GroupingSearch,
    fitted: Sequence[FittedVw],
    left_out: Sequence[str],
    smaller: Sequence[tuple[FittedVw, int]],
    alone: Sequence[GpuRef],
    holds: Callable[[list[GpuRef]], bool],
    first: int,
    cap: int,
    rule: MemoryRule,
) -> tuple[tuple[FittedVw, ...] | None, tuple[str, ...]]:
    """Per-VW work's other VWs and notes (Fitted.work_vws; None when `smaller` is empty): the VWs that hold
    the model at the config's batch (`fitted`, their notes `left_out`), those that hold it only at a smaller
    one each alone (`smaller`, each with its batch), and dp's pipelines of the GPUs `alone` that hold it at
    no batch alone."""
    if not smaller:
        return None, ()
    names = {g[0] for (_, gpus, _, _), _ in smaller for g in gpus}
    rest = [ref for ref in alone if str(ref) not in names]
    notes = [n for n in left_out if not any(f"({name} " in n for name in names)]
    pipes, notes = pipelined_vws(search, pipelines_by_node(rest, holds), first, cap, rule, notes)
    vws = tuple(sorted([*fitted, *(f for f, _ in smaller), *pipes], key=lambda f: f[0]))
    return vws, (*notes, smaller_note(smaller))


def at_smaller_batch(
    search: GroupingSearch, gpus: list[Gpu], cap: int, rule: MemoryRule
) -> tuple[VwPlan, int] | None:
    """The VW of `gpus` at the largest minibatch of fine_batches that it holds (its best order, split and
    Nm there), with its times scaled back to the config's batch, as per-VW work expects; and that batch.
    None when none holds it. The batch is searched once per kind of VW."""
    kind = tuple(sorted((g[1], g[2], g[0].rsplit(":", 1)[0]) for g in gpus))
    key = ("smaller", kind, cap, rule)
    if key not in search.solved:
        search.solved[key] = largest_fine_batch(
            search.batch, lambda b: _split_at(search, gpus, cap, rule, b) is not None
        )
    batch = search.solved[key]
    vw = _split_at(search, gpus, cap, rule, batch) if batch else None
    return None if vw is None else (vw.times_scaled(search.batch / batch), batch)


def _split_at(
    search: GroupingSearch, gpus: list[Gpu], cap: int, rule: MemoryRule, batch: int
) -> VwPlan | None:
    """best_order_and_nm of `gpus` with the profiles at minibatch size `batch`; None when none fits."""
    profiles = {t: search.profile(t, batch) for t in {g[1] for g in gpus}}
    try:
        return best_order_and_nm(profiles, gpus, search.link, cap, rule=rule, reserve_bytes=search.reserve)
    except HetpipeError:
        return None


def pipelines_by_node(alone: Sequence[GpuRef], holds: Callable[[list[GpuRef]], bool]) -> list[list[GpuRef]]:
    """Policy dp's GPUs that cannot hold the model alone (in the order given), as pipeline VWs inside each
    node, so that they add replicas instead of idling: the fewest k of a node's such GPUs that `holds` the
    model, the node's cut into groups of k (the last takes the remainder). A node where not even all of them
    together hold it gives none (its GPUs stay left out)."""
    by_node: dict[str, list[GpuRef]] = {}
    for ref in alone:
        by_node.setdefault(ref.node, []).append(ref)
    out: list[list[GpuRef]] = []
    for refs in by_node.values():
        k = next((k for k in range(2, len(refs) + 1) if holds(refs[:k])), 0)
        if k:
            cut = [refs[i : i + k] for i in range(0, len(refs) - len(refs) % k, k)]
            cut[-1] += refs[len(cut) * k :]
            out += cut
    return out


def smaller_note(smaller: Sequence[tuple[FittedVw, int]]) -> str:
    """One line on the VWs that hold the model only at a smaller minibatch: `GPUs that hold the model only at
    a smaller minibatch, each its own VW: vw8-11 (rtx-2060) at 24 or less`, runs of VWs alike folded."""
    runs: list[tuple[list[int], str, int]] = []
    for (v, gpus, _, _), batch in sorted(smaller, key=lambda s: s[0][0]):
        types = "+".join(g[1] for g in gpus)
        if runs and runs[-1][1:] == (types, batch) and runs[-1][0][-1] == v - 1:
            runs[-1][0].append(v)
        else:
            runs.append(([v], types, batch))
    parts = [
        f"vw{vs[0]}{f'-{vs[-1]}' if len(vs) > 1 else ''} ({types}) at {batch} or less"
        for vs, types, batch in runs
    ]
    return f"GPUs that hold the model only at a smaller minibatch, each its own VW: {'; '.join(parts)}"


def gpu_list(gpus: Sequence[Gpu]) -> str:
    """`n0:0 titan-v, n0:1 rtx-2060`."""
    return ", ".join(f"{g[0]} {g[1]}" for g in gpus)
