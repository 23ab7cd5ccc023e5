"""The steady-state model of a candidate's wave time (docs/planning.md#search-at-scale): each VW's pipeline
alone (compute and transfers between stages), its gate cycle (its push and pull of the weights, with the PS
link shared by traffic, and the work the schedule does between a WAIT and the next PUSH), and the PS link's
seconds per wave (with node-local aggregation, a relayed group's one copy, and its node's inside link); and
the upper bound the search prunes with. VWs that are alike are counted, not repeated, so the model costs
O(kinds). The event simulator (simulate.py) decides among the finalists. Pure."""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

from hetpipe.core.pipeline.schedule import BACKWARD, FORWARD, PUSH, WAIT, get_schedule
from hetpipe.core.planning.partition import minibatch_time_s
from hetpipe.core.planning.plan import VwPlan
from hetpipe.core.planning.simulate import stage_param_bytes, stage_times

__all__ = [
    "Kind",
    "Relayed",
    "WaveModel",
    "compute_wave_s",
    "gate_points",
    "least_wave_s",
    "upper_bound",
    "wave_model",
]

Kind = tuple[VwPlan, int]  # a VW and how many VWs of the candidate are like it


@dataclass(frozen=True)
class Relayed:
    """A relayed group ([ps] node_aggregation, relays.py) as the model sees it: each of its VWs by the index
    of its kind in the kinds, its node's inside link in float32 bytes of weights per second, and how many
    groups of the candidate are like it. Its VWs' pushes and pulls cross that link; one copy of the weights
    crosses the PS link per wave for all of them."""

    members: tuple[int, ...]
    inside_bytes_per_s: float
    count: int = 1


@dataclass(frozen=True)
class WaveModel:
    """A candidate in steady state: every VW completes a wave every `wave_s` (WSP holds the fast ones to the
    slowest), the larger of the slowest VW's pipeline (`compute_s`), its gate cycle (`gate_s`) and the PS
    link's seconds per wave (`ps_s`)."""

    wave_s: float
    compute_s: float
    gate_s: float
    ps_s: float
    samples_per_wave: float
    inside_s: float = 0.0  # the busiest relay's node's inside link, seconds per wave (node aggregation)

    @property
    def samples_per_s(self) -> float:
        return self.samples_per_wave / self.wave_s if self.wave_s > 0 else 0.0

    @property
    def ps_utilisation(self) -> float:
        """The busier of the PS link and a relay's inside link."""
        return min(max(self.ps_s, self.inside_s) / self.wave_s, 1.0) if self.wave_s > 0 else 0.0


def compute_wave_s(vw: VwPlan, schedule: str, recompute: bool) -> float:
    """One wave of the VW alone: Nm x its steady time per minibatch (partition.minibatch_time_s)."""
    return vw.nm * minibatch_time_s(vw, schedule, recompute)


def _traffic(vw: VwPlan, pulls: bool) -> float:
    """Bytes a VW moves over the PS link per wave: its weights pushed, and pulled when it pulls."""
    return sum(stage_param_bytes(vw)) * (2 if pulls else 1)


def _ps_traffic(kinds: Sequence[Kind], pulls: bool, relays: Sequence[Relayed]) -> float:
    """Bytes every VW moves over the PS link per wave; a relayed group's VWs, one copy (the largest)."""
    total = sum(n * _traffic(vw, pulls) for vw, n in kinds)
    if relays:
        each = [_traffic(vw, pulls) for vw, _ in kinds]
        for group in relays:
            moved = [each[i] for i in group.members]
            total -= group.count * (sum(moved) - max(moved))
    return total


def _inside_s(kinds: Sequence[Kind], pulls: bool, relays: Sequence[Relayed]) -> float:
    """The busiest relay's node's inside link, seconds per wave: its VWs' pushes and pulls to and from it."""
    each = [_traffic(vw, pulls) for vw, _ in kinds] if relays else []
    return max(
        (sum(each[i] for i in group.members) / group.inside_bytes_per_s for group in relays), default=0.0
    )


def upper_bound(
    kinds: Sequence[Kind],
    batch: int,
    schedule: str,
    recompute: bool,
    pulls: bool,
    ps_bytes_per_s: float,
    relays: Sequence[Relayed] = (),
) -> float:
    """Samples/s no run of these VWs can beat: one wave of every VW over the larger of the slowest VW's
    pipeline alone and the PS link's (and relays' inside links') seconds per wave (wave_model adds the gate to
    these, so it is never above)."""
    samples = sum(n * vw.nm * vw.batch(batch) for vw, n in kinds)
    wave = least_wave_s(kinds, schedule, recompute, pulls, ps_bytes_per_s, relays)
    return samples / wave if wave > 0 else math.inf


def least_wave_s(
    kinds: Sequence[Kind],
    schedule: str,
    recompute: bool,
    pulls: bool,
    ps_bytes_per_s: float,
    relays: Sequence[Relayed] = (),
) -> float:
    """Seconds per wave no long run of these VWs can beat: WSP holds every VW to the slowest, which takes at
    least its pipeline alone, the PS link carries every VW's traffic of a wave (a relayed group's once), and a
    relay's node's inside link its VWs' traffic."""
    slowest = max(compute_wave_s(vw, schedule, recompute) for vw, _ in kinds)
    wave = max(slowest, _ps_traffic(kinds, pulls, relays) / ps_bytes_per_s)
    return max(wave, _inside_s(kinds, pulls, relays)) if relays else wave


def wave_model(
    kinds: Sequence[Kind],
    batch: int,
    schedule: str,
    recompute: bool,
    staleness: int,
    pulls: bool,
    ps_bytes_per_s: float,
    contention: float = 0.0,
    relays: Sequence[Relayed] = (),
) -> WaveModel:
    """The steady state of every VW of `kinds` under WSP with D = `staleness` (docs/planning.md).

    Per VW: its pipeline alone (compute_wave_s); with pulls, its gate cycle: WAIT c needs every VW's push of
    wave c - D - 2 landed and then its pull, and after it the stage works until its next PUSH, so the waves
    between those two pushes take at least the push, the pull and that work. A transfer's latency is its
    bytes over the PS link, plus `contention` x the other VWs' share of the link (0: alone on it, the
    estimate; 1: behind every other VW's transfers, the pessimistic figure the search prunes against). The
    PS link: every VW's traffic of one wave over its rate.

    `relays` (node aggregation): a relayed group's VWs move one copy of the weights over the PS link per wave,
    and their pushes and pulls cross their node's inside link (`inside_s`, the busiest); a relayed VW's
    transfer is its part over that link, shared by the group's, then the whole model's over the PS link."""
    total = _ps_traffic(kinds, pulls, relays)
    ps_s = total / ps_bytes_per_s
    inside_s = _inside_s(kinds, pulls, relays)
    via = _relayed_by_kind(kinds, pulls, relays)
    compute = gate = 0.0
    for i, (vw, n) in enumerate(kinds):
        compute = max(compute, compute_wave_s(vw, schedule, recompute))
        if pulls and total > 0:
            if _direct(via, i, n):
                gate = max(
                    gate, _gate_s(vw, schedule, recompute, staleness, ps_bytes_per_s, total, contention)
                )
            for relay in via.get(i, {}):
                gate = max(
                    gate,
                    _gate_s(vw, schedule, recompute, staleness, ps_bytes_per_s, total, contention, relay),
                )
    samples = sum(n * vw.nm * vw.batch(batch) for vw, n in kinds)
    return WaveModel(max(compute, gate, ps_s, inside_s), compute, gate, ps_s, samples, inside_s)


def _relayed_by_kind(
    kinds: Sequence[Kind], pulls: bool, relays: Sequence[Relayed]
) -> dict[int, dict[tuple[float, float], int]]:
    """Per kind index, its relayed VWs counted by (their group's traffic over the inside link, its rate)."""
    each = [_traffic(vw, pulls) for vw, _ in kinds] if relays else []
    out: dict[int, dict[tuple[float, float], int]] = {}
    for group in relays:
        key = (sum(each[i] for i in group.members), group.inside_bytes_per_s)
        for i in group.members:
            ways = out.setdefault(i, {})
            ways[key] = ways.get(key, 0) + group.count
    return out


def _direct(via: dict[int, dict[tuple[float, float], int]], i: int, n: int) -> bool:
    """Whether some VW of kind i talks to the PS itself (is in no relayed group)."""
    return sum(via.get(i, {}).values()) < n


def _gate_s(
    vw: VwPlan,
    schedule: str,
    recompute: bool,
    staleness: int,
    rate: float,
    total: float,
    contention: float,
    relay: tuple[float, float] | None = None,
) -> float:
    """The VW's gate cycle per wave: for each stage, (its push and pull at its share of the link + the work
    from its WAIT to its next PUSH, at the VW's pace) over the waves between the two pushes; the slowest.
    `relay`: (its group's traffic over the inside link, that link's bytes/s): WSP keeps the group's VWs in
    step, so the relay's push waits for every push of the group over that link, then the whole model crosses
    the PS link both ways, then the stage's pull crosses the inside link (behind the group's others with
    `contention` 1). With `contention` 1 the pull also queues behind the VW's (or its relay's) own next push:
    in a FIFO link the push of wave c - D - 1 may go first."""
    k = len(vw.stages)
    forward, backward = stage_times(vw)
    if recompute:
        backward = [b + f for f, b in zip(forward, backward, strict=True)]
    per_minibatch = minibatch_time_s(vw, schedule, recompute)
    own = _traffic(vw, True)
    weights = stage_param_bytes(vw)
    ahead = own / 2 / rate  # with contention: the VW's own next push, queued before the pull on the link
    out = 0.0
    for j, (n_forward, n_backward, periods) in enumerate(gate_points(schedule, k, vw.nm, staleness)):
        busy = forward[j] + backward[j]
        pace = max(per_minibatch / busy, 1.0) if busy > 0 else 1.0
        work = (n_forward * forward[j] + n_backward * backward[j]) * pace
        if own <= 0:
            latency = 0.0
        elif relay is None:
            latency = 2 * weights[j] / rate * (1 + contention * (total - own) / own) + contention * ahead
        else:
            group, inside = relay
            hop = (group / 2 + weights[j] + contention * (group / 2 - weights[j])) / inside
            latency = hop + own / rate * (1 + contention * (total - own) / own) + contention * ahead
        out = max(out, (latency + work) / periods)
    return out


@functools.lru_cache(maxsize=4096)
def gate_points(schedule: str, k: int, nm: int, staleness: int) -> tuple[tuple[int, int, int], ...]:
    """Per stage of the schedule's lists in steady state: (forwards, backwards) from a WAIT c to the stage's
    next PUSH p, and p - (c - D - 2): the waves between the push WAIT c needs and that next push."""
    waves = staleness + 6
    lists = get_schedule(schedule)(k, nm, waves, staleness)
    out = []
    for actions in lists.stages:
        waits = [i for i, a in enumerate(actions) if a.kind == WAIT]
        found = (0, 0, 1)
        for i in reversed(waits):
            c = actions[i].index
            nxt = next((m for m in range(i + 1, len(actions)) if actions[m].kind == PUSH), None)
            if nxt is None:
                continue
            between = actions[i + 1 : nxt]
            n_forward = sum(1 for a in between if a.kind == FORWARD)
            n_backward = sum(1 for a in between if a.kind == BACKWARD)
            found = (n_forward, n_backward, max(actions[nxt].index - (c - staleness - 2), 1))
            break
        out.append(found)
    return tuple(out)
