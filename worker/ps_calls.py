"""Calls to the PS shards: requests sent, resent under their id (after retry_s, then twice as long each
time), timed out, answered.

A call that moves many bytes (a register with W_0, a pull of the weights, a push) over a slow link is given
time for them: timeout_s plus its bytes at the link's rate. Where the sockets report their connections
(ShardSocketList.monitors), such a call is not resent while its connection stays up (ZeroMQ delivers it or
the connection drops): it goes again when the connection comes back. Once timeout_s has passed the
shard is asked for its status over a fresh connection (on the call's own connection the answer would queue
behind the bytes still arriving): an answering PS is alive and the call waits out its bytes; a silent one
fails the call at once."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import zmq

from hetpipe.core.errors import HetpipeError
from hetpipe.core.protocol import wire

__all__ = [
    "BULK_BYTES",
    "SLOWEST_LINK_BYTES_PER_S",
    "NOT_ASKED",
    "Call",
    "PSError",
    "PSTimeout",
    "ReplyWatcher",
    "Request",
    "ShardCalls",
]

Request = tuple[str, dict[str, Any], Mapping[str, np.ndarray] | None]  # (type, fields, tensors) to one shard


class PSError(HetpipeError):
    """The server refused a request; `code` is its wire error code."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


class PSTimeout(HetpipeError):
    """No answer in time."""


BULK_BYTES = 64 << 10  # a call moving more than this waits for its bytes beyond timeout_s
BACKOFF_DOUBLINGS = 3  # each resend of a request waits twice the one before, up to 8 x the first wait
SLOWEST_LINK_BYTES_PER_S = 125_000.0  # 1 Mbit/s: the rate assumed when the client is told none
NOT_ASKED = wire.Message("none", {}, {})  # the reply slot of a shard a call does not go to


@dataclass
class Call:
    """One request per shard (or to some shards only), sent and waiting for every reply."""

    what: str
    frames: list[list[Any]]
    ids: list[int]
    gate: int = -1  # the wave whose gate a pull waits for (for the timeout message)
    replies: list[wire.Message | None] = field(default_factory=list)
    sent_at: list[float] = field(default_factory=list)
    sends: list[int] = field(default_factory=list)  # per shard: times the request went out
    started: float = field(default_factory=time.monotonic)
    error: HetpipeError | None = None
    wave: int = -1  # a push's wave
    background: str = ""  # "": the caller waits for it; else what the client itself sent it for
    moved: list[int] = field(default_factory=list)  # per shard: bytes of the request and the reply expected
    probed: dict[str, Any] | None = None  # the status a shard it waits for gave on a fresh connection
    unsent: set[int] = field(default_factory=set)  # shards its last try did not reach (or must go again)

    def go_again(self, shard: int) -> None:
        """Send the request to `shard` again at the next ShardCalls.send_due, whatever its wait."""
        self.sent_at[shard] = -1e9
        self.unsent.add(shard)

    @property
    def done(self) -> bool:
        return self.error is not None or all(r is not None for r in self.replies)

    def result(self) -> list[wire.Message]:
        if self.error is not None:
            raise self.error
        return [r for r in self.replies if r is not None]


class ReplyWatcher(Protocol):
    """What a client does beside completing its calls (worker/ps_recovery.py: surviving a shard's restart)."""

    def holds_back(self, shard: int, rid: int) -> bool:
        """True: request `rid` must not go to `shard` now."""
        ...

    def refused(self, calls: ShardCalls, shard: int, msg: wire.Message) -> bool:
        """`shard` answered with an error; True: the watcher dealt with it, and the call stays open."""
        ...

    def answered(self, calls: ShardCalls, shard: int, msg: wire.Message, call: Call) -> None:
        """`shard` answered `call` (stored in it already)."""
        ...


class ShardCalls:
    """Sends calls over one socket per shard and completes them (docs/ps-protocol.md#request-ids-and-retries):
    request ids, resends after `retry_s` and twice as long each time, the timeout after `timeout_s` (worded
    by `describe_timeout(what, waited, gate)`), replies matched by (shard, id). A request the client sent by
    itself that fails for good becomes `fatal`, which `poll` raises.

    What the requests say is the client's business (worker/ps_client.py); what a reply means beside
    completing its call is the `watcher`'s (worker/ps_recovery.py: surviving a shard's restart)."""

    def __init__(
        self,
        sockets: list[zmq.Socket],
        timeout_s: float,
        retry_s: float,
        pack: str | None,
        watcher: ReplyWatcher,
        describe_timeout: Callable[[str, float, int], str],
    ) -> None:
        self.sockets = sockets
        self.timeout_s, self.retry_s = timeout_s, retry_s
        self.pack = pack  # pushes' float32 weights go packed
        self.packed_keys: set[str] = set()  # the weights ("param" keys): buffers and ledgers go as they are
        self.watcher, self.describe_timeout = watcher, describe_timeout
        self.fatal: HetpipeError | None = None  # a request the client sent by itself failed for good
        self.link_bytes_per_s: float | None = None  # the link's rate (None: SLOWEST_LINK_BYTES_PER_S)
        self.run = ""  # the run the requests name (for the status probe)
        self.held_bytes = [0] * len(sockets)  # per shard: bytes of the keys registered there (a pull's reply)
        self._ids = iter(range(1, 2**62))
        self._open: dict[tuple[int, int], Call] = {}  # (shard, request id) -> the call waiting for it

    def send(
        self, requests: list[Request | None], what: str, gate: int = -1, wave: int = -1, background: str = ""
    ) -> Call:
        """Send one request per shard (None: nothing to that shard); the returned Call completes as `poll`
        reads the replies."""
        frames: list[list[Any]] = []
        ids: list[int] = []
        moved: list[int] = []
        for shard, request in enumerate(requests):
            if request is None:
                frames.append([])
                ids.append(-1)
                moved.append(0)
                continue
            msg_type, fields, tensors = request
            rid = next(self._ids)
            ids.append(rid)
            frames.append(
                wire.encode(
                    msg_type,
                    {"id": rid, **fields},
                    tensors,
                    pack=self.pack if msg_type == "push" else None,
                    pack_only=self.packed_keys,
                )
            )
            moved.append(self._bytes_moved(shard, msg_type, fields, frames[-1]))
            self.run = fields.get("run", self.run)
        call = Call(
            what,
            frames,
            ids,
            gate,
            [None if r is not None else NOT_ASKED for r in requests],
            [-1e9] * len(requests),
            [0] * len(requests),
            wave=wave,
            background=background,
            moved=moved,
        )
        for shard, rid in enumerate(ids):
            if rid >= 0:
                self._open[(shard, rid)] = call
        self.send_due(time.monotonic())
        return call

    def send_due(self, now: float) -> None:
        """Send what is due: new requests, and unanswered ones every retry_s; time out the old ones. Nothing
        goes to a shard the watcher holds back."""
        expired: list[Call] = []
        for (shard, rid), call in list(self._open.items()):
            if call.done or call in expired:
                continue
            if self.watcher.holds_back(shard, rid):
                continue
            if now - call.started > self.timeout_s and self._expired(call, shard, now - call.started):
                expired.append(call)
            elif now - call.sent_at[shard] >= self._resend_s(call, shard):
                # never block: a DEALER whose connection failed its handshake has nowhere to queue; an
                # unsent request is tried again after retry_s, and the timeout still counts
                try:
                    self.sockets[shard].send_multipart(call.frames[shard], copy=False, flags=zmq.NOBLOCK)
                    call.unsent.discard(shard)
                except zmq.Again:
                    call.unsent.add(shard)
                call.sent_at[shard] = now
                call.sends[shard] += 1
        # closed first: the message below asks the PS for its status with a call of its own
        for call in expired:
            call.error = PSTimeout(f"{call.what} timed out")
            self._forget(call)
        for call in expired:
            waited = now - call.started
            if call.probed is not None and not _parked(call.probed, call.gate):
                call.error = PSTimeout(self._slow_link_message(call, waited))
            else:
                call.error = PSTimeout(self.describe_timeout(call.what, waited, call.gate))
            self._background_failed(call)

    # ---- slow links ---------------------------------------------------------------------------------
    def _bytes_moved(self, shard: int, msg_type: str, fields: dict[str, Any], frames: list[Any]) -> int:
        """Bytes a request to `shard` moves: its own, and those its reply is expected to bring."""
        sent = sum(len(memoryview(f)) for f in frames)
        if msg_type == "register":
            self.held_bytes[shard] = sent
            return 2 * sent if fields.get("want_weights") else sent
        return sent + (self.held_bytes[shard] if msg_type == "pull" else 0)

    def _resend_s(self, call: Call, shard: int) -> float:
        """How long after its last send a request to `shard` goes again: retry_s or its bytes' time, whichever
        is longer, doubled at each resend up to BACKOFF_DOUBLINGS times. On a link slower than the client was
        told, a resent request queues behind the bytes of the first and is sent twice (each a push's or a
        pull's whole payload): the doubling bounds what that costs a congested link. A bulk request that went
        out over a watched connection waits for the connection to come back instead (never, while it
        stays up: the timeout still counts)."""
        sent = call.sends[shard] > 0 and shard not in call.unsent
        if sent and self.watched and call.moved[shard] >= BULK_BYTES:
            return math.inf
        doublings = min(max(call.sends[shard] - 1, 0), BACKOFF_DOUBLINGS)
        return max(self.retry_s, self._link_s(call.moved[shard])) * 2**doublings

    def _link_s(self, nbytes: int) -> float:
        """Seconds `nbytes` take over the link (0 below BULK_BYTES)."""
        if nbytes < BULK_BYTES:
            return 0.0
        return nbytes / (self.link_bytes_per_s or SLOWEST_LINK_BYTES_PER_S)

    def _expired(self, call: Call, shard: int, waited: float) -> bool:
        """Past timeout_s: a call still moving bytes waits for them while the shard answers a fresh connection
        (asked once); a silent shard, or one whose time is up, ends it."""
        allowance = self.timeout_s + self._link_s(call.moved[shard])
        if allowance <= self.timeout_s or waited > allowance:
            return True
        if call.probed is None:
            probe = getattr(self.sockets, "probe", None)  # ShardSocketList's (worker/ps_sockets.py)
            call.probed = probe and probe(shard, self.run, min(5.0, max(1.0, 2 * self.retry_s)))
            return call.probed is None or _parked(call.probed, call.gate)
        return False

    def _slow_link_message(self, call: Call, waited: float) -> str:
        """Why a call the PS is alive for timed out: its bytes have not all arrived."""
        mb = max(call.moved) / 1e6
        rate = self.link_bytes_per_s or SLOWEST_LINK_BYTES_PER_S
        who = getattr(self.watcher, "who", "")
        by = f" by {who}" if who else ""
        return (
            f"{call.what}{by} got no complete answer in {waited:.0f} s, though the PS answers status on a "
            f"fresh connection (it is running): its {mb:.2f} MB (request and reply) are still crossing a slow"
            f" link, or the request stalls. The wait allowed [ps] timeout_s = {self.timeout_s:g} s plus those"
            f" bytes at {rate * 8 / 1e6:g} Mbit/s: raise [ps] timeout_s, or check the link"
        )

    @property
    def monitors(self) -> list[zmq.Socket]:
        """The sockets' monitors of their connections' drops and handshakes (ShardSocketList.monitors)."""
        return getattr(self.sockets, "monitors", [])

    @property
    def watched(self) -> bool:
        """Whether the sockets report their connections (bulk requests then wait for a drop to go again)."""
        return bool(self.monitors)

    def resend_to(self, shard: int) -> None:
        """Let every open request to `shard` go again at the next `send_due`."""
        for (s, _), call in self._open.items():
            if s == shard:
                call.go_again(shard)

    def _forget(self, call: Call) -> None:
        for shard, rid in enumerate(call.ids):
            if rid >= 0:
                self._open.pop((shard, rid), None)

    def poll(self, timeout_ms: int, extra: Sequence[zmq.Socket] = ()) -> list[zmq.Socket]:
        """Read every reply that arrives within timeout_ms into its Call; resend what is due. Returns which
        of `extra` (sockets the caller also waits on) became readable."""
        poller = zmq.Poller()
        monitors = self.monitors
        for sock in (*self.sockets, *monitors, *extra):
            poller.register(sock, zmq.POLLIN)
        ready = dict(poller.poll(timeout=timeout_ms))
        for shard, sock in enumerate(self.sockets):
            if sock in ready:
                self._read(shard, sock)
        if monitors:
            for shard in self.sockets.reconnected(ready):  # type: ignore[attr-defined]
                self.resend_to(shard)
        self.send_due(time.monotonic())
        if self.fatal is not None:
            raise self.fatal
        return [sock for sock in extra if sock in ready]

    def _read(self, shard: int, sock: zmq.Socket) -> None:
        """Take every reply waiting on `sock` into the call it answers."""
        while True:
            try:
                raw = sock.recv_multipart(copy=False, flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            msg = self._decode(raw, shard)
            call = self._open.get((shard, msg.fields.get("id")))
            if call is None or call.replies[shard] is not None:
                continue  # an answer to an earlier try of an earlier request
            if msg.type == "error":
                if self.watcher.refused(self, shard, msg) or self._behind(shard, call, msg):
                    continue
                call.error = PSError(
                    msg.fields["code"], f"{call.what} refused by shard {shard}: {msg.fields['message']}"
                )
                self._forget(call)
                self._background_failed(call)
                continue
            call.replies[shard] = msg
            self._open.pop((shard, msg.fields["id"]), None)
            self.watcher.answered(self, shard, msg, call)

    def _behind(self, shard: int, call: Call, msg: wire.Message) -> bool:
        """A push refused as out of order while an earlier push to the same shard is open: it overtook that
        one after a dropped connection (the earlier went again behind it). The earlier ones go again now, this
        one after them (retry_s later), and the call stays open; False otherwise."""
        if msg.fields.get("code") != "out_of_order" or call.wave < 0:
            return False
        earlier = [
            c
            for (s, _), c in self._open.items()
            if s == shard and c is not call and 0 <= c.wave < call.wave and c.replies[shard] is None
        ]
        for c in earlier:
            c.go_again(shard)
        if earlier:
            call.sent_at[shard] = time.monotonic()
            call.unsent.add(shard)
        return bool(earlier)

    def _background_failed(self, call: Call) -> None:
        """A request the client sent by itself failed: a heartbeat matters only when it says the VW is out."""
        if not call.background or call.error is None:
            return
        code = getattr(call.error, "code", "")
        if call.background == "heartbeat" and code not in ("evicted", "vw_failed"):
            return
        self.fatal = call.error

    def wait(self, call: Call) -> list[wire.Message]:
        """Block until `call` completes; its replies, one per shard (or its error)."""
        while not call.done:
            self.poll(int(self.retry_s * 1000 / 4) + 1)
        return call.result()

    def _decode(self, raw: list[zmq.Frame], shard: int) -> wire.Message:
        try:
            return wire.decode(raw)
        except wire.WireError as exc:
            raise PSError(exc.code, f"shard {shard} sent an invalid reply: {exc}") from None


def _parked(info: dict[str, Any], gate: int) -> bool:
    """The shard's status says a pull of wave `gate` waits for its gate (not for bytes)."""
    if gate < 0 or "c_global" not in info:
        return False
    return info["c_global"] < gate - info.get("staleness", 0) - 1
