"""Who may talk to the PS as whom: the ZAP decision on a CURVE key, the rule binding a key to one virtual
worker, and a rate-limited log of refusals. Pure: bytes in, bytes and text out; the shard's loop does the I/O.

ZAP is ZeroMQ's authentication protocol (rfc.zeromq.org/spec/27): for every CURVE handshake libzmq asks the
handler bound at ZAP_ENDPOINT of the socket's context, with the client's address and its 32-byte public key;
the reply admits (200, with a User-Id that every message of that connection then carries) or refuses (400).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import zmq.utils.z85

from hetpipe.core.protocol.keys import ADMIN, vw_of_user

__all__ = [
    "ADMIN_REQUESTS",
    "VW_REQUESTS",
    "ZAP_DOMAIN",
    "ZAP_ENDPOINT",
    "HandshakeLimit",
    "RefusalLog",
    "ZapDecision",
    "refusal",
    "zap_decide",
]

ZAP_ENDPOINT = "inproc://zeromq.zap.01"
ZAP_DOMAIN = b"hetpipe"
# a VW's key, for that VW only (evict and rejoin: a VW's worker takes its own VW out after a failure, and
# back)
VW_REQUESTS = frozenset({"register", "push", "pull", "status", "heartbeat", "evict", "rejoin"})
ADMIN_REQUESTS = frozenset(
    {"status", "read", "evict"}
)  # the launcher's key: it reads, and evicts a failed VW


def refusal(user: str | None, msg_type: str, vw: int | None) -> str | None:
    """Why the client admitted as `user` may not send `msg_type` (claiming `vw`); None when it may.

    `user` None means no authentication (auth = "none"): everything is allowed, as before keys existed.
    """
    if user is None:
        return None
    if user == ADMIN:
        if msg_type in ADMIN_REQUESTS:
            return None
        *rest, last = sorted(ADMIN_REQUESTS)
        return f"the admin key may only {', '.join(rest)} and {last}, not {msg_type}"
    own = vw_of_user(user)
    if own is None:
        return f"key user {user!r} is neither a virtual worker nor admin"
    if msg_type not in VW_REQUESTS:
        return f"the key of vw {own} may not {msg_type}: that needs the admin key"
    if vw is not None and vw != own:
        return f"the key of vw {own} may act only as vw {own}, not as vw {vw}"
    return None


@dataclass(frozen=True)
class ZapDecision:
    """The reply frames for libzmq, and what the log needs to say about the client."""

    reply: list[bytes]
    user: str | None  # None: refused
    address: str
    key: str  # the client's public key in Z85 ("" when the request had none)
    reason: str


def _reply(request_id: bytes, code: bytes, text: str, user: str = "") -> list[bytes]:
    return [b"1.0", request_id, code, text.encode(), user.encode(), b""]


def zap_decide(request: Sequence[bytes], clients: Mapping[bytes, str]) -> ZapDecision:
    """Admit a CURVE client whose public key is one of `clients` (Z85 key -> user); refuse anything else.

    Request frames: version "1.0", request id, domain, address, routing id, mechanism, credentials...
    """
    frames = [bytes(f) for f in request]
    request_id = frames[1] if len(frames) > 1 else b""
    address = frames[3].decode("utf-8", "replace") if len(frames) > 3 else "?"
    if len(frames) < 6 or frames[0] != b"1.0":
        return ZapDecision(
            _reply(request_id, b"500", "malformed ZAP request"),
            None,
            address,
            "",
            f"a malformed ZAP request of {len(frames)} frames",
        )
    mechanism = frames[5]
    if mechanism != b"CURVE" or len(frames) != 7 or len(frames[6]) != 32:
        shown = mechanism.decode("ascii", "replace")[:20]
        return ZapDecision(
            _reply(request_id, b"400", "CURVE only"),
            None,
            address,
            "",
            f"a client using the {shown} mechanism instead of CURVE",
        )
    key = zmq.utils.z85.encode(frames[6])
    user = clients.get(key)
    if user is None:
        return ZapDecision(
            _reply(request_id, b"400", "unknown key"),
            None,
            address,
            key.decode(),
            "a CURVE key that is not one of this run's keys",
        )
    return ZapDecision(_reply(request_id, b"200", "OK", user), user, address, key.decode(), "admitted")


@dataclass
class RefusalLog:
    """Refusals to log: each distinct line once per `window_s`, at most `budget` distinct lines per window;
    repeats (a client retrying a bad handshake every 100 ms) and lines over the budget (a flood) are counted,
    and the counts logged once the window ended: by the next refusal, or by `flush`, which the shard's loop
    calls every turn (so a flood's summary appears when the flood ends). Bounded memory: at most `budget`
    lines kept."""

    budget: int = 20
    window_s: float = 60.0
    _start: float | None = None
    _repeats: dict[str, int] = field(default_factory=dict)  # line logged in this window -> repeats since
    _over_budget: int = 0

    def note(self, line: str, now: float) -> list[str]:
        """The lines to log for one refusal described by `line`, seen at time `now` (seconds)."""
        out = []
        if self._start is None or now - self._start >= self.window_s:
            if self._start is not None:
                out += self._summary(now - self._start)
            self._start, self._repeats, self._over_budget = now, {}, 0
        if line in self._repeats:
            self._repeats[line] += 1
        elif len(self._repeats) < self.budget:
            self._repeats[line] = 0
            out.append(line)
        else:
            self._over_budget += 1
        return out

    def flush(self, now: float) -> list[str]:
        """The summary of a window that has ended (counts not logged yet); [] while it runs or if none."""
        if self._start is None or now - self._start < self.window_s:
            return []
        out = self._summary(now - self._start)
        self._start, self._repeats, self._over_budget = None, {}, 0
        return out

    def _summary(self, elapsed: float) -> list[str]:
        out = [
            f"{line} (and {n} more time{'s' * (n > 1)} in the last {elapsed:.0f} s)"
            for line, n in self._repeats.items()
            if n
        ]
        if self._over_budget:
            out.append(f"{self._over_budget} more refusals were not logged in the last {elapsed:.0f} s")
        return out


@dataclass
class HandshakeLimit:
    """Failed handshakes per peer address (an unknown key, no CURVE, garbage): an address with `limit` of them
    in one window of `window_s` has every new connection closed before its handshake, for the rest of that
    window and the next one. A client with the run's key never fails a handshake, so it never counts; one on
    the same address as a flood waits (ZeroMQ reconnects) until the flood stops. Bounded memory: at most
    `max_addresses` windows kept, the oldest forgotten first."""

    limit: int = 20
    window_s: float = 1.0
    max_addresses: int = 4096
    _windows: dict[str, tuple[float, int]] = field(
        default_factory=dict
    )  # address -> (window start, failures)
    _blocked: dict[str, float] = field(default_factory=dict)  # address -> refused until

    def failed(self, address: str, now: float) -> str | None:
        """Count one failed handshake of `address`; a line to log when this one blocks the address."""
        start, count = self._windows.get(address, (now, 0))
        if now - start >= self.window_s:
            start, count = now, 0
        self._windows.pop(address, None)  # re-inserted last: the dict stays oldest first
        self._windows[address] = (start, count + 1)
        if len(self._windows) > self.max_addresses:
            del self._windows[next(iter(self._windows))]
        if count + 1 != self.limit:
            return None
        self._blocked[address] = start + 2 * self.window_s
        if len(self._blocked) > self.max_addresses:
            del self._blocked[next(iter(self._blocked))]
        return (
            f"closing new connections from {address} for {2 * self.window_s:.0f} s: {self.limit} failed "
            f"handshakes within {self.window_s:.0f} s (a flood, or a client with the wrong keys)"
        )

    def blocked(self, address: str, now: float) -> bool:
        """New connections from `address` are closed now."""
        until = self._blocked.get(address)
        if until is None:
            return False
        if now < until:
            return True
        del self._blocked[address]
        return False
