"""The cluster's capacity, every GPU's standalone rate summed, and what holds a candidate below it: GPUs left
out, pipelines, wave imbalance, the PS's link, a node's link (docs/planning.md#capacity). Pure."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from hetpipe.core.config.schema import ClusterConfig
from hetpipe.core.planning.memory import format_bytes
from hetpipe.core.planning.partition import minibatch_time_s
from hetpipe.core.planning.plan import Plan, VwPlan
from hetpipe.core.planning.profile import ModelProfile
from hetpipe.core.planning.relays import Relay

__all__ = ["CAPACITY_TARGET", "PsFigures", "left_out_bound", "plan_bounds", "standalone_rates"]

CAPACITY_TARGET = 0.9  # below this share of the capacity, a candidate names what bounds it
_SMALL = 0.01  # a loss under 1% of the capacity is not named


def standalone_rates(config: ClusterConfig, profiles: Mapping[str, ModelProfile]) -> dict[str, float]:
    """Every GPU of the cluster ("n0:1") with its standalone rate: the config's batch / the whole model's
    forward + backward on its type (ModelProfile.step_s), samples/s. Their sum is the capacity."""
    batch = config.train.batch_size
    return {str(ref): batch / profiles[config.gpu(ref).name].step_s for ref in config.all_gpus()}


@dataclass(frozen=True)
class PsFigures:
    """The PS's side of a simulated plan: each shard's link, the busiest link and its busy share, the bytes
    every VW's pushes and pulls of one wave move over the PS's links, and the simulated slowest wave. With
    node aggregation, a relayed group's bytes count once there, and each relay's own bytes over its node's
    inside link (its VWs' pushes and pulls) come beside it."""

    gbps: float
    shards: int
    utilisation: float
    link: str  # "PS" (one link for all shards), or a node's ("n1 egress", a relay's "n1 loopback")
    bytes_per_wave: float
    wave_s: float
    relays: tuple[Relay, ...] = ()
    relay_bytes_per_wave: tuple[float, ...] = ()  # over each relay's node's inside link


def plan_bounds(
    plan: Plan,
    samples_per_s: float,
    rates: Mapping[str, float],
    notes: Sequence[str],
    ps: PsFigures,
    link_gbps: Callable[[str, str], float],
) -> tuple[str, ...]:
    """What holds `plan` (predicted at `samples_per_s`) below CAPACITY_TARGET of the capacity, largest loss
    first, each with its figure; () when it is not below. The losses chain: capacity -> the GPUs used (left
    out) -> each VW alone (pipelines: uneven stages, transfers) -> every VW at the slowest's wave (wave
    imbalance) -> the prediction (the PS's link, gates)."""
    capacity = sum(rates.values())
    if not capacity or samples_per_s >= CAPACITY_TARGET * capacity:
        return ()
    found: list[tuple[float, str]] = []
    used = {g for vw in plan.vws for g in vw.gpus}
    left = left_out_bound([g for g in rates if g not in used], rates, notes)
    if left:
        found.append(left)
    alone = [vw.batch(plan.batch_size) / _minibatch_s(vw, plan) for vw in plan.vws]
    found += _pipeline_bounds(plan, alone, rates, capacity, link_gbps)
    waves = [vw.nm * _minibatch_s(vw, plan) for vw in plan.vws]
    paced = sum(vw.nm * vw.batch(plan.batch_size) for vw in plan.vws) / max(waves)
    if sum(alone) - paced > _SMALL * capacity:
        found.append(_imbalance((sum(alone) - paced) / capacity, waves, notes))
    rest = (paced - samples_per_s) / capacity
    if ps.utilisation >= 0.85 or rest > _SMALL:
        found.append((max(rest, 0.0), _ps_text(ps, rest, len(plan.vws))))
    found.sort(key=lambda f: -f[0])
    return tuple(text for _, text in found)


def left_out_bound(
    idle: Sequence[str], rates: Mapping[str, float], notes: Sequence[str]
) -> tuple[float, str] | None:
    """The GPUs a candidate leaves idle, their share of the capacity, and the notes that say why."""
    if not idle:
        return None
    capacity = sum(rates.values())
    loss = sum(rates[g] for g in idle) / capacity
    why = [note for note in notes if "left out" in note or "cannot hold" in note or "fastest" in note]
    because = f"; {'; '.join(why)}" if why else ""
    return (
        loss,
        f"idle GPUs ({loss:.0%} of capacity): {len(idle)} of {len(rates)} left out ({', '.join(idle)})"
        + because,
    )


def _imbalance(loss: float, waves: Sequence[float], notes: Sequence[str]) -> tuple[float, str]:
    """The wave imbalance: the slowest VW's wave against the fastest's; memory, when it held VWs back from
    more work per wave (per_vw_work's `memory:` notes)."""
    slow, fast = waves.index(max(waves)), waves.index(min(waves))
    held = [note.removeprefix("memory: ") for note in notes if note.startswith("memory:")]
    head = "memory, as wave imbalance" if held else "wave imbalance"
    return (
        loss,
        f"{head} ({loss:.0%} of capacity): the slowest VW's wave takes {waves[slow]:.3g} s (vw{slow}), the "
        f"fastest's {waves[fast]:.3g} s (vw{fast}); "
        + (f"memory holds VWs back: {'; '.join(held)}" if held else "the others wait for it"),
    )


def _minibatch_s(vw: VwPlan, plan: Plan) -> float:
    return minibatch_time_s(vw, plan.schedule, plan.recompute)


def _pipeline_bounds(
    plan: Plan,
    alone: Sequence[float],
    rates: Mapping[str, float],
    capacity: float,
    link_gbps: Callable[[str, str], float],
) -> list[tuple[float, str]]:
    """Each VW alone against its GPUs' standalone rates (stages of unequal time, a pipe that does not fill,
    transfers), named in the VW that loses most: its slowest stage against an even split, its transfers and
    their link, its fullest GPU when memory may have fixed the split."""
    own = [sum(rates[g] for g in vw.gpus) for vw in plan.vws]
    loss = (sum(own) - sum(alone)) / capacity
    if loss <= _SMALL:
        return []
    v = max(range(len(plan.vws)), key=lambda i: own[i] - alone[i])
    vw = plan.vws[v]
    j = max(range(len(vw.stages)), key=lambda i: vw.stages[i].time_s)
    s = vw.stages[j]
    share = (s.recv_s + s.send_s) / s.time_s if s.time_s else 0.0
    full = max(vw.stages, key=lambda st: st.memory_bytes / max(st.memory_limit_bytes, 1))
    fullness = full.memory_bytes / max(full.memory_limit_bytes, 1)
    text = (
        f"pipelines ({loss:.0%} of capacity): the VWs alone reach {sum(alone):.4g} samples/s, "
        f"{sum(alone) / sum(own):.0%} of their GPUs' {sum(own):.4g}; most lost in vw{v} ({alone[v]:.4g} of "
        f"{own[v]:.4g}): its slowest stage, {s.gpu} {s.gpu_type} layers {s.start}-{s.stop - 1}, takes "
        f"{s.time_s:.3g} s per minibatch ({share:.0%} transfers) where an even split over its GPUs would "
        f"take {vw.batch(plan.batch_size) / own[v]:.3g} s"
        + (f"; memory may fix the split ({full.gpu} {fullness:.0%} full)" if fullness >= 0.85 else "")
    )
    out = [(loss, text)]
    if share >= 0.1:
        peers = [vw.gpus[i] for i in (j - 1, j + 1) if 0 <= i < len(vw.stages)]
        slowest = min(peers, key=lambda p: link_gbps(s.gpu, p))
        out.append(
            (
                loss * share,
                f"a link between GPUs: vw{v} stage {j} ({s.gpu}) spends {share:.0%} of its time on "
                f"transfers, {s.gpu}-{slowest} at {link_gbps(s.gpu, slowest):g} Gbit/s",
            )
        )
    return out


def _ps_text(ps: PsFigures, loss: float, num_vws: int) -> str:
    """The PS's link (or the busiest node link it crosses) with its figures; "gate waits" first when the link
    is under 85% busy, so the rest is more the gates' than the link's."""
    where = (
        f"the PS link ({ps.shards} shard{'s' if ps.shards > 1 else ''} x {ps.gbps:g} Gbit/s)"
        if ps.link in ("", "PS")
        else f"the PS traffic's busiest link, {ps.link} (a node's link)"
    )
    if ps.utilisation < 0.85:
        where = f"gate waits and {where}"
    moves = (
        f"{num_vws} VW{'s' if num_vws > 1 else ''} move{'' if num_vws > 1 else 's'} "
        f"{format_bytes(int(ps.bytes_per_wave))} per wave (pushes and pulls)"
    )
    if ps.relays:
        moves = _relayed_moves(ps, num_vws)
    return (
        f"{where} ({max(loss, 0.0):.0%} of capacity): {ps.utilisation:.0%} busy; {moves}, "
        f"a wave takes {ps.wave_s:.3g} s"
    )


def _relayed_moves(ps: PsFigures, num_vws: int) -> str:
    """The bytes of a wave as node aggregation moves them: over the busiest link when it is a relay's node's
    inside link, else over the PS's links, a relayed group's once."""
    for relay, nbytes in zip(ps.relays, ps.relay_bytes_per_wave, strict=True):
        if ps.link == f"{relay.node} loopback":
            return (
                f"{len(relay.vws)} VWs move {format_bytes(int(nbytes))} per wave over it to and from "
                f"{relay.node}'s relay (pushes and pulls; node aggregation)"
            )
    grouped = sum(len(relay.vws) for relay in ps.relays)
    relays = f"{len(ps.relays)} relays push and pull" if len(ps.relays) > 1 else "1 relay pushes and pulls"
    return (
        f"{num_vws} VWs move {format_bytes(int(ps.bytes_per_wave))} per wave over the PS's links (pushes and "
        f"pulls; node aggregation: {relays} one copy each for {grouped} of them)"
    )
