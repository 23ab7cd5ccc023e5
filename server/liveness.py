"""Which VWs a shard serves: heartbeats that stop, eviction, rejoin, and the run stopped by a failed VW
(docs/recovery.md, on_vw_failure). The WSP rules of eviction and rejoin live in hetpipe.core.wsp.state."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from hetpipe.core.wsp.state import ShardState, WspError
from hetpipe.server.pulls import refuse_parked

if TYPE_CHECKING:
    from hetpipe.server.shard import ShardServer, ShardSettings

__all__ = [
    "check_checkpoints",
    "check_heartbeats",
    "evict_vw",
    "fresh_beats",
    "rejoin_vw",
    "require_evict_policy",
    "stop_run",
]


def require_evict_policy(settings: ShardSettings, what: str) -> None:
    """Refuse `what` (an evict or a rejoin) unless the shard runs with on_vw_failure = "evict"."""
    if settings.on_vw_failure != "evict":
        raise WspError(
            "conflict",
            f'{what} refused: this shard runs with [ps] on_vw_failure = "stop" (a failed '
            'VW stops the run); with "evict" the others go on without it',
        )


def fresh_beats(state: ShardState) -> dict[tuple[int, int], tuple[float, int]]:
    """A heartbeat from every registered stage now: a restart gives every stage its full grace."""
    now = time.monotonic()
    return {sid: (now, 0) for sid in state.stage_keys}


def check_heartbeats(shard: ShardServer, now: float) -> None:
    """A registered stage of a live VW that has not finished and sent nothing for hung_after_s fails its
    VW."""
    limit = shard.settings.hung_after_s
    state = shard.state
    if limit <= 0 or shard.failed is not None or state.num_vws is None:
        return
    waves = state.num_waves
    for sid in sorted(state.stage_keys):
        vw = sid[0]
        if not state.live(vw) or (waves is not None and state.pushed[sid] >= waves):
            continue
        last = shard.beats.get(sid, (now, 0))[0]
        shard.beats.setdefault(sid, (now, 0))
        if now - last <= limit:
            continue
        why = f"vw {vw} stage {sid[1]} sent no heartbeat for {now - last:.0f} s (dead or hung)"
        if shard.settings.on_vw_failure == "evict":
            evict_vw(shard, vw, why)
        else:
            stop_run(shard, why)
        return


def check_checkpoints(shard: ShardServer) -> None:
    """CHECKPOINT_FAILURES_FATAL periodic checkpoints failed in a row: a crash of this shard could no longer
    be recovered, so the run stops (stage requests are refused with the reason, and the stages stop)."""
    writer = shard.checkpoints.writer
    if writer is None or not writer.health.fatal or shard.failed is not None:
        return
    health = writer.health
    shard.failed = (
        f"shard {shard.settings.shard}: {health.in_a_row} checkpoints in a row failed (last: "
        f"{health.last_error}), so a crash of this shard could not be recovered: free disk space or file "
        "descriptors (ulimit -n), then continue with `hetpipe train --resume RUN_DIR`"
    )
    shard.say(shard.failed)
    refuse_parked(shard, "vw_failed", shard.failed)


def stop_run(shard: ShardServer, why: str) -> None:
    """on_vw_failure = "stop": the run failed; its parked pulls are refused, and stage requests from now."""
    shard.failed = f'{why}; [ps] on_vw_failure = "stop" ends the run ("evict" would go on without it)'
    shard.say(shard.failed)
    refuse_parked(shard, "vw_failed", shard.failed)


def evict_vw(shard: ShardServer, vw: int, why: str) -> int:
    """Take VW `vw` out of the live set (its half waves dropped), answer its parked pulls, forget its
    connections; checkpointed before anyone hears of it. Returns the wave boundary it left at."""
    state = shard.state
    was_live = state.num_vws is not None and 0 <= vw < state.num_vws and state.live(vw)
    boundary, advanced = state.evict(vw)
    if not was_live:
        return boundary
    refuse_parked(shard, "evicted", f"vw {vw} was evicted ({why})", vw=vw)
    for sid in [sid for sid in shard.identities if sid[0] == vw]:
        shard.evicted_identities[shard.identities.pop(sid)] = vw
    shard.say(
        f"evicted vw {vw} at wave {boundary} ({why}); live VWs now "
        f"{state.live_vws()}, c_global {state.c_global}"
    )
    if shard.settings.recoverable:
        shard.checkpoint(reason=f"vw {vw} evicted")
    if advanced:
        shard.clock_advanced()
    return boundary


def rejoin_vw(shard: ShardServer, vw: int, start: int) -> None:
    """Take VW `vw` back in from wave `start`: its stages register again, each with a full heartbeat grace;
    checkpointed before it hears of it."""
    state = shard.state
    was_live = state.live(vw) if state.num_vws else True
    state.rejoin(vw, start)
    now = time.monotonic()
    for sid in [sid for sid in state.stage_keys if sid[0] == vw]:
        shard.identities.pop(sid, None)
        shard.beats[sid] = (now, 0)
    if not was_live:
        shard.say(f"vw {vw} rejoins at wave {start} (c_global {state.c_global})")
        if shard.settings.recoverable:
            shard.checkpoint(reason=f"vw {vw} rejoined")
