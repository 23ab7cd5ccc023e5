"""The checks a shard runs on a request before its state sees it: the CURVE key's rights, the connection a
stage registered from, finite tensors. Each refuses by raising the error the client is answered with."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import zmq

from hetpipe.core.protocol import wire
from hetpipe.core.protocol.access import RefusalLog, refusal
from hetpipe.core.wsp.state import WspError

if TYPE_CHECKING:
    from hetpipe.server.shard import ShardServer

__all__ = ["check_access", "check_finite", "check_owner", "frame_property"]


def check_access(
    header: zmq.Frame, msg: wire.Message, refusals: RefusalLog, say: Callable[[str], None]
) -> None:
    """The key this connection was admitted with (its ZAP User-Id) must be allowed to act as the request's
    VW."""
    user = frame_property(header, "User-Id")  # "" (no rights) if it was not admitted through the ZAP handler
    vw = msg.fields.get("vw")
    why = refusal(user, msg.type, vw)
    if why is None:
        return
    claim = f" claiming vw {vw} stage {msg.fields.get('stage')}" if vw is not None else ""
    line = f"refused {msg.type}{claim} from key {user!r} at {frame_property(header, 'Peer-Address')}: {why}"
    for text in refusals.note(line, time.monotonic()):
        say(text)
    raise wire.WireError(
        "forbidden", f"{msg.type}{claim} refused: {why}; each VW's stages must use that VW's key"
    )


def check_finite(msg: wire.Message, what: str) -> None:
    """Refuse NaN and inf before the state sees them: one poisoned update would spread to every VW."""
    for key, view in msg.tensors.items():
        if not view.all_finite():
            nans, infs = view.non_finite_counts()
            raise wire.WireError(
                "non_finite",
                f"{what}: tensor {key!r} holds {nans} NaN and {infs} inf values; the PS refuses "
                'non-finite tensors (a diverged loss? lower train.lr, or set train.on_nan = "skip")',
            )


def check_owner(shard: ShardServer, identity: bytes, vw: int, stage: int) -> None:
    """The request must come from the connection (vw, stage) registered from, and its VW must be in."""
    if identity in shard.evicted_identities:
        gone = shard.evicted_identities[identity]
        raise WspError(
            "evicted",
            f"vw {gone} was evicted: its stages must stop (`hetpipe worker --vw {gone}` "
            "rejoins it at the next wave boundary)",
        )
    owner = shard.identities.get((vw, stage))
    if owner is None or owner != identity:
        raise WspError(
            "not_registered",
            f"vw {vw} stage {stage} is not registered from this connection: register first",
        )


def frame_property(frame: zmq.Frame, name: str) -> str:
    """A ZeroMQ message property ("User-Id", "Peer-Address"), "" when the connection has none."""
    try:
        return frame.get(name)
    except zmq.ZMQError:
        return ""
