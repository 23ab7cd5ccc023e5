"""The planner's per-VW work (docs/planning.md#per-vw-work): the VWs of a grouping each at its own Nm and
minibatch size, from the options its split allows (hetpipe.core.planning.wave_balance chooses), as the VwPlans
the simulator runs; with only the fastest 1, 2, ... VWs too. Pure."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from hetpipe.core.planning.groupings import Fitted, Grouping, GroupingSearch
from hetpipe.core.planning.memory import MemoryRule, format_bytes
from hetpipe.core.planning.partition import minibatch_time_s
from hetpipe.core.planning.plan import VwPlan
from hetpipe.core.planning.ps_chain import gate_bound_s, wave_phases_s
from hetpipe.core.planning.relays import plan_relays, prefix_ps_bytes
from hetpipe.core.planning.simulate import PsNetwork
from hetpipe.core.planning.wave_balance import Balance, WorkOption, balance, batch_ladder, largest_fine_batch
from hetpipe.core.wsp.aggregation import get_aggregation, needs_pulls

__all__ = ["KEEP_FEWER", "PerVwWork", "fewer_note", "nm_cap", "work_text"]

KEEP_FEWER = 0.9  # only the fastest VWs: planned when the estimate is within 10% of the best one's


class PerVwWork:
    """Per-VW work for the groupings of one GroupingSearch; the PS's links carry `ps_bytes_per_s` in all."""

    def __init__(
        self, search: GroupingSearch, ps_bytes_per_s: float, network: PsNetwork | None = None
    ) -> None:
        self.search, self.ps_bytes_per_s, self.network = search, ps_bytes_per_s, network
        self.options_of: dict[tuple, tuple[WorkOption, ...]] = {}
        rule = get_aggregation(search.config.ps.aggregation)
        self.pulls = lambda n: needs_pulls(n, rule)
        # the "average" mitigation shares a VW's own updates at 1 / n: the runtime refuses unequal work then
        self.enabled = "average" not in search.config.train.mitigations
        self.node_aggregation = search.config.ps.node_aggregation

    def options(self, vw: VwPlan, rule: MemoryRule, cap: int) -> tuple[WorkOption, ...]:
        """Every (Nm, batch) the VW may run with its split: each batch of batch_ladder, Nm its own, or from
        its depth (a full pipe) to the cap (nm_cap: more at a smaller batch). A wave's time is scaled from the
        config's batch by proportion (as ModelProfile.at_batch scales every time, transfers included); memory
        by the memory model."""
        kind = tuple((s.gpu_type, s.start, s.stop, s.time_s, s.memory_limit_bytes) for s in vw.stages)
        key = (kind, rule, cap)
        if key not in self.options_of:
            base = self.search.batch
            out = []
            batches = self.batches(vw, rule)
            most = nm_cap(cap, batches[0], base)
            for nm in sorted({vw.nm, *range(len(vw.stages), most + 1)}):
                per_minibatch = minibatch_time_s(
                    dataclasses.replace(vw, nm=nm), rule.schedule, rule.recompute
                )
                for batch in batches:
                    if nm > max(vw.nm, nm_cap(cap, batch, base)):
                        continue
                    sized = self.at(vw, nm, batch)
                    needs = self.search.stage_bytes(sized, rule)
                    over = "; ".join(
                        f"{s.gpu} ({s.gpu_type}) needs {format_bytes(m)} of "
                        f"{format_bytes(s.memory_limit_bytes)}"
                        for s, m in zip(sized.stages, needs, strict=True)
                        if m > s.memory_limit_bytes
                    )
                    out.append(WorkOption(nm, batch, nm * per_minibatch * batch / base, over))
            self.options_of[key] = tuple(out)
        return self.options_of[key]

    def batches(self, vw: VwPlan, rule: MemoryRule) -> tuple[int, ...]:
        """batch_ladder; for a VW that does not hold the model at the config's batch, also the largest of
        fine_batches it holds (at its depth's Nm), so that a GPU just short of memory runs all it can."""
        base, depth = self.search.batch, len(vw.stages)
        ladder = batch_ladder(base)
        if self.holds(vw, depth, base, rule):
            return ladder
        held = largest_fine_batch(base, lambda b: self.holds(vw, depth, b, rule))
        return tuple(sorted({*ladder, held})) if held else ladder

    def holds(self, vw: VwPlan, nm: int, batch: int, rule: MemoryRule) -> bool:
        """Whether every stage of the VW fits its GPU at `nm` and minibatch size `batch`."""
        sized = self.at(vw, nm, batch)
        needs = self.search.stage_bytes(sized, rule)
        return all(m <= s.memory_limit_bytes for s, m in zip(sized.stages, needs, strict=True))

    def at(self, vw: VwPlan, nm: int, batch: int) -> VwPlan:
        """The VW at `nm` and minibatch size `batch`: each stage time x batch / the config's batch."""
        base = self.search.batch
        scaled = vw.times_scaled(batch / base)
        return dataclasses.replace(scaled, nm=nm, batch_size=0 if batch == base else batch)

    def ps_s(self, vws: Sequence[VwPlan], staleness: int = 0) -> float:
        """The PS's seconds per wave: each VW pushes its weights every wave, and pulls them when it must; with
        [ps] node_aggregation a relayed group's once for all its VWs (relays.ps_bytes_per_wave). Over a
        PsNetwork's node links, the wave's pushes and then its pulls spread over the D + 1 waves the gate
        leaves them, each phase no longer than a wave (ps_chain.gate_bound_s): a shorter wave waits at the
        gate, so per-VW work makes waves no shorter. Over one PS link both directions share it, whatever D."""
        if self.network is not None:
            inside = self.network.inside_gbps
            relays = plan_relays([vw.gpus for vw in vws], self.node_aggregation, lambda n: inside[n])
            phases = wave_phases_s(vws, self.network, relays, self.pulls(len(vws)), self.ps_bytes_per_s)
            return gate_bound_s(phases, staleness)
        if self.node_aggregation:
            return self.relayed_ps_s(prefix_ps_bytes(vws)[-1], len(vws))
        return sum(vw.param_bytes * (2 if self.pulls(len(vws)) else 1) for vw in vws) / self.ps_bytes_per_s

    def relayed_ps_s(self, one_pass: int, n: int) -> float:
        """The PS's seconds per wave of `n` VWs whose pushes (or pulls) move `one_pass` bytes over it
        (relays.prefix_ps_bytes)."""
        return one_pass * (2 if self.pulls(n) else 1) / self.ps_bytes_per_s

    def balanced(self, vws: Sequence[VwPlan], fitted: Fitted, staleness: int = 0) -> Balance | None:
        """wave_balance.balance over these VWs' options, under the memory rule of this many VWs at D =
        `staleness` (a stage keeps D + 2 update sums), with the PS's seconds per wave at that D."""
        rule = dataclasses.replace(fitted.rule, pulls=self.pulls(len(vws)), staleness=staleness)
        options = [self.options(vw, rule, fitted.cap) for vw in vws]
        return balance(options, self.ps_s(vws, staleness), self.search.batch)

    def groupings(self, fitted: Fitted | str, staleness: int = 0) -> list[Grouping]:
        """The policy's VWs at per-VW work for D = `staleness`, then only its fastest 1, 2, ... at theirs,
        each kept when its estimate is within KEEP_FEWER of the best one's; none when the policy can't run."""
        if isinstance(fitted, str) or not self.enabled:
            return []
        return [g for variant in fitted.for_work() for g in self._groupings(variant, staleness)]

    def _groupings(self, fitted: Fitted, staleness: int) -> list[Grouping]:
        vws = [vw for *_, vw in fitted.vws]
        rule = fitted.rule
        fastest = sorted(vws, key=lambda vw: minibatch_time_s(vw, rule.schedule, rule.recompute))
        found: list[tuple[Balance, list[VwPlan]]] = []
        for n in range(len(vws), 0, -1):
            kept = [vw for vw in vws if any(vw is f for f in fastest[:n])]
            chosen = self.balanced(kept, fitted, staleness)
            if chosen is not None:
                found.append((chosen, kept))
        top = max((b.samples_per_s for b, _ in found), default=0.0)
        every = found[0][0] if found and len(found[0][1]) == len(vws) else None
        out = []
        for chosen, kept in found:
            if chosen.samples_per_s < KEEP_FEWER * top:
                continue
            plans = tuple(
                self.search.with_params(self.at(vw, o.nm, o.batch))
                for vw, o in zip(kept, chosen.work, strict=True)
            )
            out.append((plans, (*fitted.left_out, *self.notes(chosen, plans, len(vws), every))))
        return out

    def notes(
        self, chosen: Balance, vws: Sequence[VwPlan], of: int, every: Balance | None = None
    ) -> list[str]:
        """What per-VW work chose, the VWs memory held back, and the VWs left out (with what all `of` would
        make: `every`, their Balance)."""
        notes = [
            f"per-VW work (Nm x batch per VW): {work_text(vws, self.search.batch)}, so that every wave takes "
            f"about {chosen.wave_s:.3g} s"
        ]
        notes += [
            f"memory: vw{v} would do {option.nm} x {option.batch} per wave, but {option.over}"
            for v, option in chosen.held
        ]
        if len(vws) < of:
            notes.append(fewer_note(len(vws), of, every and (every.samples_per_s, every.wave_s, every.ps_s)))
        return notes


def fewer_note(k: int, n: int, every: tuple[float, float, float] | None) -> str:
    """The note of a per-VW work grouping of only the fastest `k` of `n` VWs; `every`: (samples/s, slowest
    wave, the PS's seconds per wave) of all n at per-VW work by the estimate, which says what they cost."""
    note = f"only the {k} fastest of the policy's {n} VWs, at per-VW work"
    if every is None:
        return note
    rate, wave, ps_s = every
    bound = (
        f"the PS's links {ps_s:.3g} s a wave against {wave:.3g} s of compute"
        if ps_s > wave
        else f"the slowest VW's wave {wave:.3g} s"
    )
    return f"{note} (all {n}: about {rate:.4g} samples/s by the estimate, bound by {bound})"


def nm_cap(cap: int, batch: int, base: int) -> int:
    """The most minibatches of `batch` samples a VW's wave may hold under the Nm cap `cap`, which counts
    minibatches of the config's `base`: at a smaller batch as many more as make up the same samples."""
    return max(cap, cap * base // batch)


def work_text(vws: Sequence[VwPlan], base_batch: int) -> str:
    """`4x32, 4x64, 2x32`: each VW's Nm x minibatch size."""
    return ", ".join(f"{vw.nm}x{vw.batch(base_batch)}" for vw in vws)
