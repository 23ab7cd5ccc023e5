"""Pulls on a shard: answered at once when their gate is open, else parked (one per stage) until a clock opens
the gate, or refused when their VW is evicted or the run stops. Weights leave by zero-copy sends."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from hetpipe.core.protocol import wire
from hetpipe.core.wsp.state import PullResult, WspError
from hetpipe.server.admission import check_owner

if TYPE_CHECKING:
    from hetpipe.server.shard import ShardServer

__all__ = ["Parked", "answer_opened_pulls", "answer_pull", "refuse_parked", "serve_pull"]


@dataclass
class Parked:
    """A pull waiting for its gate: whom to answer, and since when it waits."""

    identity: bytes
    request_id: int
    vw: int
    stage: int
    wave: int
    known: int = -1  # [train] autofreeze: the newest movement record the puller has (-1: none)
    records_only: bool = False  # and it wants no weights
    since: float = field(default_factory=time.monotonic)


def serve_pull(shard: ShardServer, identity: bytes, msg: wire.Message) -> None:
    """`pull`: the weights now if the wave's gate is open, else park it (replacing the stage's older one)."""
    f = msg.fields
    check_owner(shard, identity, f["vw"], f["stage"])
    known, records_only = f.get("known", -1), f.get("records_only", False)
    parked = Parked(identity, f["id"], f["vw"], f["stage"], f["wave"], known, records_only)
    if shard.state.gate_open(f["wave"]):
        answer_pull(shard, parked)
        return
    sid = (f["vw"], f["stage"])
    before = shard.parked.get(sid)
    if before is not None and (before.identity, before.request_id) == (identity, f["id"]):
        return  # a retry: it keeps its place and its waiting time
    if before is not None:
        # a stage waits for one pull at a time, so an older one was abandoned (and parking every one would
        # grow memory without bound): answer it, so that nothing waits for it forever
        message = f"pull of wave {before.wave} replaced by pull {f['id']} of wave {f['wave']}"
        shard.send(before.identity, wire.error_frames(before.request_id, "conflict", message))
    shard.parked[sid] = parked


def answer_pull(shard: ShardServer, p: Parked) -> None:
    """Send the weights of the pull (packed to the wire dtype where set), or the state's refusal."""
    try:
        result: PullResult = shard.state.pull(p.vw, p.stage, p.wave, p.known, p.records_only)
    except WspError as exc:
        shard.send(p.identity, wire.error_frames(p.request_id, exc.code, str(exc)))
        return
    parked_ms = int(1000 * (time.monotonic() - p.since))
    fields = {
        "id": p.request_id,
        "wave": p.wave,
        "version": result.version,
        "own_through": result.own_through,
        "parked_ms": parked_ms,
        "gaps": shard.state.gaps(),
    }
    if result.movement is not None:
        fields["movement"] = result.movement
    wire_dtype = shard.settings.wire_dtype
    pack = None if wire_dtype == "float32" else wire_dtype
    packed = {k for k in result.tensors if shard.state.kinds[k] == "param"} if pack else set()
    # packed weights go in new arrays; what goes as it is (all of it, unpacked) is the state's, lent to
    # the send
    shard.send(
        p.identity,
        wire.encode("weights", fields, result.tensors, pack=pack, pack_only=packed),
        lent={k: v for k, v in result.tensors.items() if k not in packed},
    )


def answer_opened_pulls(shard: ShardServer) -> None:
    """After a clock: answer every parked pull whose gate is now open, oldest wave first."""
    opened = [p for p in shard.parked.values() if shard.state.gate_open(p.wave)]
    now = time.monotonic()
    for p in sorted(opened, key=lambda p: (p.wave, p.vw, p.stage)):
        del shard.parked[(p.vw, p.stage)]
        shard.traffic.pull_wait_s += now - p.since
        answer_pull(shard, p)


def refuse_parked(shard: ShardServer, code: str, message: str, vw: int | None = None) -> None:
    """Answer the parked pulls of VW `vw` (None: all of them) with an error: their gate will not open."""
    for sid in [sid for sid in shard.parked if vw is None or sid[0] == vw]:
        p = shard.parked.pop(sid)
        shard.send(p.identity, wire.error_frames(p.request_id, code, message))
