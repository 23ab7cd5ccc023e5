"""The shard's answer to each request type, and REQUEST_HANDLERS: the one table from request type to handler
(docs/ps-protocol.md, Message types). A handler replies, or raises the error the client is answered with."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from hetpipe.core.protocol import wire
from hetpipe.core.wsp.state import WspError
from hetpipe.server.admission import check_finite, check_owner
from hetpipe.server.liveness import evict_vw, rejoin_vw, require_evict_policy
from hetpipe.server.pulls import serve_pull

if TYPE_CHECKING:
    from hetpipe.server.shard import ShardServer

__all__ = ["REQUEST_HANDLERS", "STAGE_REQUESTS", "Handler"]

Handler = Callable[["ShardServer", bytes, wire.Message], None]  # (shard, the connection's identity, request)


def admit_registration(shard: ShardServer, identity: bytes, msg: wire.Message) -> dict[str, Any]:
    """A `register` request's checks and its record in the state (a shard's, or a node relay's), the
    connection noted as the stage's and its heartbeat clock started; returns the stage's W_0 values."""
    f = msg.fields
    sid = (f["vw"], f["stage"])
    check_finite(msg, f"register of vw {sid[0]} stage {sid[1]}")
    kinds = {**dict.fromkeys(f["buffers"], "buffer"), **dict.fromkeys(f["ledgers"], "ledger")}
    values = shard.state.register(
        f["vw"],
        f["stage"],
        f["num_vws"],
        f["num_stages"],
        msg.tensors,
        kinds,
        f["num_waves"] or None,
        f["start_wave"],
        tuple(f["vw_weights"]),
        tuple(f["members"]),
        spans=tuple((start, end) for start, end in f["vw_spans"]),
    )
    shard.identities[sid] = identity
    shard.beats[sid] = (time.monotonic(), shard.beats.get(sid, (0.0, 0))[1])
    return values


def register_stage(shard: ShardServer, identity: bytes, msg: wire.Message) -> None:
    """`register`: a stage's keys with their initial values (the first registration of a key sets W_0)."""
    f = msg.fields
    sid = (f["vw"], f["stage"])
    owner = shard.identities.get(sid)
    if owner is not None and owner != identity:
        raise WspError(
            "conflict", f"vw {sid[0]} stage {sid[1]} is already registered from another connection"
        )
    state = shard.state
    again = sid in state.stage_keys
    values = admit_registration(shard, identity, msg)
    if again and owner is None:
        shard.say(f"vw {sid[0]} stage {sid[1]} registered again (it holds {state.pushed[sid]} of its waves)")
    tensors = _differing(values, msg.tensors) if f["want_weights"] else {}
    fields = {
        "id": f["id"],
        "c_global": state.c_global,
        "pushed": state.pushed[sid],
        "keep_from": shard.keep_from(sid),
        "ckpt_from": shard.ckpt_from(),
    }
    shard.send(identity, wire.encode("registered", fields, tensors), lent=tensors)


def _differing(initial: dict[str, Any], sent: Mapping[str, Any]) -> dict[str, Any]:
    """W_0 of the keys whose values the stage sent differ from it, bit for bit: the stage keeps its own for
    the rest. Stages built from the run's seed send W_0 itself, and sending it back costs what sending it did
    (over a slow link, a minute for a few MB)."""
    out = {}
    for key, value in initial.items():
        mine = sent.get(key)
        if mine is None or getattr(mine, "packed", False) or not _same_bits(value, mine.to_array()):
            out[key] = value
    return out


def _same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and a.tobytes() == b.tobytes()


def apply_push(shard: ShardServer, identity: bytes, msg: wire.Message) -> None:
    """`push`: a stage's contribution to a wave; acknowledged, then the clock's consequences if it moved."""
    f = msg.fields
    check_owner(shard, identity, f["vw"], f["stage"])
    check_finite(msg, f"push of vw {f['vw']} stage {f['stage']} wave {f['wave']}")
    result = shard.state.push(f["vw"], f["stage"], f["wave"], msg.tensors)
    sid = (f["vw"], f["stage"])
    ack = {
        "id": f["id"],
        "wave": f["wave"],
        "applied": result.applied,
        "c_global": result.c_global,
        "keep_from": shard.keep_from(sid),
        "ckpt_from": shard.ckpt_from(),
    }
    shard.send(identity, wire.encode("ack", ack))
    if result.clock_advanced:
        shard.clock_advanced()


def note_heartbeat(shard: ShardServer, identity: bytes, msg: wire.Message) -> None:
    """`heartbeat`: the stage is alive, with its progress; answered with the clock and `keep_from`."""
    f = msg.fields
    check_owner(shard, identity, f["vw"], f["stage"])
    shard.state.stage_keys_of(f["vw"], f["stage"])  # "evicted" once its VW is out
    sid = (f["vw"], f["stage"])
    shard.beats[sid] = (time.monotonic(), f["progress"])
    beat = {
        "id": f["id"],
        "c_global": shard.state.c_global,
        "keep_from": shard.keep_from(sid),
        "ckpt_from": shard.ckpt_from(),
    }
    shard.send(identity, wire.encode("beat", beat))


def report_status(shard: ShardServer, identity: bytes, msg: wire.Message) -> None:
    """`status`: the shard's status_info."""
    info = shard.status_info()
    shard.send(identity, wire.encode("status_reply", {"id": msg.fields["id"], "info": info}))


def read_weights(shard: ShardServer, identity: bytes, msg: wire.Message) -> None:
    """`read`: every key at the newest complete version (exact) or the running weights (latest)."""
    result = shard.state.read()
    fields = {"id": msg.fields["id"], "version": result.version, "info": shard.status_info()}
    shard.send(identity, wire.encode("snapshot", fields, result.tensors), lent=result.tensors)


def evict_on_request(shard: ShardServer, identity: bytes, msg: wire.Message) -> None:
    """`evict`: take a VW out (on_vw_failure = "evict" only); answered with the wave it left at."""
    f = msg.fields
    require_evict_policy(shard.settings, f"evict of vw {f['vw']}")
    at = evict_vw(shard, f["vw"], "on request")
    shard.send(identity, wire.encode("evicted", {"id": f["id"], "vw": f["vw"], "at_wave": at}))


def accept_rejoin(shard: ShardServer, identity: bytes, msg: wire.Message) -> None:
    """`rejoin`: take a VW back in from a wave boundary (on_vw_failure = "evict" only)."""
    f = msg.fields
    vw, start = f["vw"], f["start_wave"]
    require_evict_policy(shard.settings, f"rejoin of vw {vw}")
    rejoin_vw(shard, vw, start)
    shard.send(identity, wire.encode("rejoined", {"id": f["id"], "vw": vw, "start_wave": start}))


REQUEST_HANDLERS: dict[str, Handler] = {
    "register": register_stage,
    "push": apply_push,
    "pull": serve_pull,
    "status": report_status,
    "read": read_weights,
    "heartbeat": note_heartbeat,
    "evict": evict_on_request,
    "rejoin": accept_rejoin,
}
STAGE_REQUESTS = frozenset({"register", "push", "pull", "heartbeat"})  # refused once the run failed ("stop")
assert set(REQUEST_HANDLERS) <= wire.MESSAGE_TYPES and STAGE_REQUESTS.issubset(REQUEST_HANDLERS)
