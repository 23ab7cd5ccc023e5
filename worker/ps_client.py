"""The PS client of one stage: register, push (acknowledged, retried), pull(wave) behind the WSP gate.

One DEALER socket per shard. Every request carries an id and is answered by the server; a request
without an answer within `retry_s` is sent again with the same id (safe: pushes are idempotent, pulls
and reads change nothing), and fails after `timeout_s` with an error that says whom it waited for.

With `curve` keys every socket is a CurveZMQ client: encrypted, and the PS knows which key it holds.

Requests are Calls (one request per shard) that complete as replies arrive, so several may be in flight
at once (hetpipe.worker.ps_agent overlaps pushes and pulls with compute); register/push/pull/status/read
are the blocking forms.

Surviving a shard's restart (docs/recovery.md): the client keeps a copy of its registration and every push
the shard has not put in a checkpoint yet (acks say how far: `keep_from`). A restarted shard does not know
the connection and answers `not_registered`: the client registers again (the reply says how many of its
waves the shard holds), resends the pushes from there in order, then everything still unanswered. Nothing
of this reaches the caller unless pushes it acknowledged are gone for good.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import zmq

from hetpipe.core.errors import HetpipeError
from hetpipe.core.protocol import wire
from hetpipe.core.protocol.keys import ClientKeys
from hetpipe.core.protocol.placement import keys_by_shard

__all__ = ["Call", "ClientSpec", "PSClient", "PSError", "PSTimeout", "Pulled"]

Request = tuple[str, dict[str, Any], Mapping[str, np.ndarray] | None]


class PSError(HetpipeError):
    """The server refused a request; `code` is its wire error code."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


class PSTimeout(HetpipeError):
    """No answer in time."""


@dataclass(frozen=True)
class Pulled:
    version: int  # t of W_t (exact) or c_global when served (latest)
    own_through: int  # own waves <= this are contained (max over shards is not needed: all agree)
    tensors: dict[str, np.ndarray]
    parked_s: float = 0.0  # how long the request waited at the PS for its gate (the longest shard)
    gaps: list[list[int]] = field(
        default_factory=list
    )  # [vw, from, to): waves a VW added nothing to (any shard)


_NOT_ASKED = wire.Message("none", {}, {})  # the reply slot of a shard a call does not go to


@dataclass
class Call:
    """One request per shard (or to some shards only), sent and waiting for every reply."""

    what: str
    frames: list[list[Any]]
    ids: list[int]
    gate: int = -1  # the wave whose gate a pull waits for (for the timeout message)
    replies: list[wire.Message | None] = field(default_factory=list)
    sent_at: list[float] = field(default_factory=list)
    started: float = field(default_factory=time.monotonic)
    error: HetpipeError | None = None
    wave: int = -1  # a push's wave
    background: str = ""  # "": the caller waits for it; else what the client itself sent it for

    @property
    def done(self) -> bool:
        return self.error is not None or all(r is not None for r in self.replies)

    def result(self) -> list[wire.Message]:
        if self.error is not None:
            raise self.error
        return [r for r in self.replies if r is not None]


@dataclass(frozen=True)
class ClientSpec:
    """The PSClient a stage's agent talks through (its constructor's arguments)."""

    endpoints: list[str]
    run: str
    vw: int
    stage: int
    num_vws: int
    num_stages: int
    placement: dict[str, int]
    timeout_s: float
    retry_s: float
    curve: ClientKeys | None = None
    wire_dtype: str = "float32"

    def fields(self) -> dict[str, Any]:
        """Its fields as plain values (the agent process gets them over its pipe, as msgpack)."""
        return asdict(self)  # the keys too, as a map

    @classmethod
    def of(cls, fields: Mapping[str, Any]) -> ClientSpec:
        """The spec `fields()` gave."""
        curve = fields["curve"]
        return cls(**{**fields, "curve": ClientKeys(**curve) if curve else None})

    def client(self) -> PSClient:
        return PSClient(
            self.endpoints,
            self.run,
            self.vw,
            self.stage,
            self.num_vws,
            self.num_stages,
            self.placement,
            timeout_s=self.timeout_s,
            retry_s=self.retry_s,
            curve=self.curve,
            wire_dtype=self.wire_dtype,
        )


class PSClient:
    """Talks to every shard for one stage of one virtual worker."""

    def __init__(
        self,
        endpoints: list[str],
        run: str,
        vw: int,
        stage: int,
        num_vws: int,
        num_stages: int,
        placement: Mapping[str, int],
        *,
        timeout_s: float = 60.0,
        retry_s: float = 2.0,
        curve: ClientKeys | None = None,
        wire_dtype: str = "float32",
    ) -> None:
        self.endpoints = endpoints
        self.pack = None if wire_dtype == "float32" else wire_dtype  # pushes' float32 weights go packed
        self.packed_keys: set[str] = set()  # the weights ("param" keys): buffers and ledgers go as they are
        self.run, self.vw, self.stage = run, vw, stage
        self.num_vws, self.num_stages = num_vws, num_stages
        self.placement = dict(placement)
        self.timeout_s, self.retry_s = timeout_s, retry_s
        self.curve = curve
        self._probing = False
        self._ids = iter(range(1, 2**62))
        self._ctx = zmq.Context()
        self.sockets: list[zmq.Socket] = []
        identity = f"{run}/vw{vw}/s{stage}/{os.getpid()}/{os.urandom(4).hex()}".encode()
        for endpoint in endpoints:
            sock = self._ctx.socket(zmq.DEALER)
            wire.configure_socket(sock, router=False)
            sock.setsockopt(zmq.ROUTING_ID, identity)
            if curve is not None:
                sock.curve_serverkey = curve.server_public
                sock.curve_publickey = curve.public
                sock.curve_secretkey = curve.secret
            sock.connect(endpoint)
            self.sockets.append(sock)
        self._open: dict[tuple[int, int], Call] = {}  # (shard, request id) -> the call waiting for it
        self.keys: list[str] = []
        # recovery from a shard's restart
        self._registration: list[
            tuple[dict[str, Any], dict[str, np.ndarray]]
        ] = []  # per shard: fields, copies
        self.keep_from = [0] * len(endpoints)  # per shard: pushes of earlier waves are in its checkpoint
        self.retained: dict[
            int, tuple[Mapping[str, np.ndarray], Call]
        ] = {}  # wave -> its push, until durable
        self._copy_on_retain: set[int] = (
            set()
        )  # waves whose arrays the caller will reuse (copy before keeping)
        self._rejoining: dict[int, int] = {}  # shard -> id of the registration sent to it again
        self._next_wave = 0  # pushes handed over so far (the next wave to push)
        self._heartbeat: Call | None = None
        self.fatal: HetpipeError | None = None  # a request the client sent by itself failed for good
        self.restarts_seen = 0

    @property
    def context(self) -> zmq.Context:
        return self._ctx

    def close(self) -> None:
        for sock in self.sockets:
            sock.close(linger=0)
        self._ctx.term()

    def __enter__(self) -> PSClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- requests -----------------------------------------------------------------------------------
    def _stage_fields(self) -> dict[str, Any]:
        return {"run": self.run, "vw": self.vw, "stage": self.stage}

    def _split(self, tensors: Mapping[str, np.ndarray]) -> list[dict[str, np.ndarray]]:
        try:
            parts = keys_by_shard(self.placement, list(tensors), len(self.sockets))
        except KeyError as exc:
            raise HetpipeError(
                f"key {exc} has no shard in the placement: place the whole model's keys"
            ) from None
        return [{k: tensors[k] for k in part} for part in parts]

    def register(
        self,
        tensors: Mapping[str, np.ndarray],
        want_weights: bool = True,
        kinds: Mapping[str, str] | None = None,
        num_waves: int = 0,
        start_wave: int = 0,
    ) -> dict[str, np.ndarray]:
        """Declare this stage's keys with their initial values and kinds ("param", "buffer", "ledger"; default
        param), the run's length (0: unknown) and the wave this stage starts at (> 0: its VW rejoined);
        returns the PS's W_0 for them. A copy of the registration is kept, to register again with a restarted
        shard."""
        self.keys = list(tensors)
        kinds = kinds or {}
        self.packed_keys = {k for k in tensors if kinds.get(k, "param") == "param"}
        requests: list[Request] = []
        self._registration = []
        for part in self._split(tensors):
            fields = {
                **self._stage_fields(),
                "num_vws": self.num_vws,
                "num_stages": self.num_stages,
                "want_weights": want_weights,
                "num_waves": num_waves,
                "start_wave": start_wave,
                "buffers": [k for k in part if kinds.get(k) == "buffer"],
                "ledgers": [k for k in part if kinds.get(k) == "ledger"],
            }
            requests.append(("register", fields, part))
            self._registration.append(
                ({**fields, "want_weights": False}, {k: np.array(v) for k, v in part.items()})
            )
        replies = self.wait(self.send(requests, what="register"))
        self._next_wave = max(start_wave, min(r.fields["pushed"] for r in replies))
        self.keep_from = [r.fields["keep_from"] for r in replies]
        out: dict[str, np.ndarray] = {}
        for reply in replies:
            out.update({k: v.to_array() for k, v in reply.tensors.items()})
        return out

    def send_push(self, wave: int, tensors: Mapping[str, np.ndarray], reused: bool = False) -> Call:
        """Send this stage's push of `wave` to every shard (complete it with wait or poll). It is kept until
        every shard has it in a checkpoint; `reused`: the caller will change the arrays once the call is done
        (they are copied first if they must be kept)."""
        fields = {**self._stage_fields(), "wave": wave}
        call = self.send(
            [("push", fields, part) for part in self._split(tensors)], what=f"push of wave {wave}", wave=wave
        )
        self._next_wave = max(self._next_wave, wave + 1)
        self.retained[wave] = (tensors, call)
        if reused:
            self._copy_on_retain.add(wave)
        return call

    def push(self, wave: int, tensors: Mapping[str, np.ndarray]) -> int:
        """Push this stage's update of `wave`; returns the smallest c_global seen."""
        return min(r.fields["c_global"] for r in self.wait(self.send_push(wave, tensors)))

    def send_heartbeat(self, progress: int) -> None:
        """Tell every shard this stage is alive and how many of its actions it has run (answered in the
        background; the previous heartbeat still unanswered: none is sent)."""
        if self._heartbeat is not None and not self._heartbeat.done:
            return
        fields = {**self._stage_fields(), "progress": progress}
        self._heartbeat = self.send(
            [("heartbeat", fields, None)] * len(self.sockets), what="heartbeat", background="heartbeat"
        )

    def send_pull(self, wave: int) -> Call:
        fields = {**self._stage_fields(), "wave": wave}
        return self.send([("pull", fields, None)] * len(self.sockets), what=f"pull of wave {wave}", gate=wave)

    @staticmethod
    def pulled(replies: Sequence[wire.Message], out: Mapping[str, np.ndarray] | None = None) -> Pulled:
        """The weights of a pull's replies, copied into `out` where it has the key (else views of the
        frames)."""
        tensors: dict[str, np.ndarray] = {}
        for reply in replies:
            for key, view in reply.tensors.items():
                if out is not None and key in out:
                    view.copy_into(out[key])
                    tensors[key] = out[key]
                else:
                    tensors[key] = view.to_array()
        gaps = sorted({tuple(g) for r in replies for g in r.fields["gaps"]})
        return Pulled(
            version=min(r.fields["version"] for r in replies),
            own_through=min(r.fields["own_through"] for r in replies),
            tensors=tensors,
            parked_s=max(r.fields["parked_ms"] for r in replies) / 1000,
            gaps=[list(g) for g in gaps],
        )

    def pull(self, wave: int, out: Mapping[str, np.ndarray] | None = None) -> Pulled:
        """Wait for the gate of `wave` and return the global weights (copied into `out` when given)."""
        return self.pulled(self.wait(self.send_pull(wave)), out)

    def status(self) -> list[dict[str, Any]]:
        call = self.send([("status", {"run": self.run}, None)] * len(self.sockets), what="status")
        return [r.fields["info"] for r in self.wait(call)]

    def read(self) -> dict[str, np.ndarray]:
        """Admin read: every key of every shard, at the newest complete version."""
        return self.snapshot()[1]

    def snapshot(self) -> tuple[int, dict[str, np.ndarray]]:
        """Admin read with its version: (the oldest shard's t of W_t, or c_global for latest; every key,
        copied)."""
        replies = self._read_replies()
        return (
            min(r.fields["version"] for r in replies),
            {k: np.array(v.to_array()) for r in replies for k, v in r.tensors.items()},
        )

    def read_each(self) -> tuple[list[dict[str, np.ndarray]], list[dict[str, Any]]]:
        """Admin read, shard by shard: the keys each holds (newest complete version) and its status then."""
        replies = self._read_replies()
        return (
            [{k: np.array(v.to_array()) for k, v in r.tensors.items()} for r in replies],
            [r.fields["info"] for r in replies],
        )

    def _read_replies(self) -> list[wire.Message]:
        return self.wait(self.send([("read", {"run": self.run}, None)] * len(self.sockets), what="read"))

    # ---- calls --------------------------------------------------------------------------------------
    def send(
        self, requests: list[Request | None], what: str, gate: int = -1, wave: int = -1, background: str = ""
    ) -> Call:
        """Send one request per shard (None: nothing to that shard); the returned Call completes as `poll`
        reads the replies."""
        frames: list[list[Any]] = []
        ids: list[int] = []
        for request in requests:
            if request is None:
                frames.append([])
                ids.append(-1)
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
        call = Call(
            what,
            frames,
            ids,
            gate,
            [None if r is not None else _NOT_ASKED for r in requests],
            [-1e9] * len(requests),
            wave=wave,
            background=background,
        )
        for shard, rid in enumerate(ids):
            if rid >= 0:
                self._open[(shard, rid)] = call
        self._resend(time.monotonic())
        return call

    def _resend(self, now: float) -> None:
        """Send what is due: new requests, and unanswered ones every retry_s; time out the old ones. A shard
        being registered again gets nothing else until it answers."""
        expired: list[Call] = []
        for (shard, rid), call in list(self._open.items()):
            if call.done or call in expired:
                continue
            if shard in self._rejoining and self._rejoining[shard] != rid:
                continue
            if now - call.started > self.timeout_s:
                expired.append(call)
            elif now - call.sent_at[shard] >= self.retry_s:
                # never block: a DEALER whose connection failed its handshake has nowhere to queue; an
                # unsent request is tried again after retry_s, and the timeout still counts
                with contextlib.suppress(zmq.Again):
                    self.sockets[shard].send_multipart(call.frames[shard], copy=False, flags=zmq.NOBLOCK)
                call.sent_at[shard] = now
        for (
            call
        ) in expired:  # closed first: the message below asks the PS for its status with a call of its own
            call.error = PSTimeout(f"{call.what} timed out")
            self._forget(call)
        for call in expired:
            call.error = PSTimeout(self._timeout_message(call.what, now - call.started, call.gate))
            self._background_failed(call)

    def _forget(self, call: Call) -> None:
        for shard, rid in enumerate(call.ids):
            if rid >= 0:
                self._open.pop((shard, rid), None)

    def poll(self, timeout_ms: int, extra: Sequence[zmq.Socket] = ()) -> list[zmq.Socket]:
        """Read every reply that arrives within timeout_ms into its Call; resend what is due. Returns which
        of `extra` (sockets the caller also waits on) became readable."""
        poller = zmq.Poller()
        for sock in (*self.sockets, *extra):
            poller.register(sock, zmq.POLLIN)
        ready = dict(poller.poll(timeout=timeout_ms))
        for shard, sock in enumerate(self.sockets):
            if sock in ready:
                self._read(shard, sock)
        self._resend(time.monotonic())
        if self.fatal is not None:
            raise self.fatal
        return [sock for sock in extra if sock in ready]

    def _read(self, shard: int, sock: zmq.Socket) -> None:
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
                if (
                    msg.fields["code"] == "not_registered"
                    and self._registration
                    and self._rejoining.get(shard) != msg.fields["id"]
                ):
                    self._rejoin(shard)  # the shard restarted: the call stays open and goes again afterwards
                    continue
                call.error = PSError(
                    msg.fields["code"], f"{call.what} refused by shard {shard}: {msg.fields['message']}"
                )
                self._forget(call)
                self._background_failed(call)
                continue
            call.replies[shard] = msg
            self._open.pop((shard, msg.fields["id"]), None)
            if msg.type in ("ack", "beat"):
                self._acknowledged(shard, msg.fields["keep_from"], call)
            elif msg.type == "registered" and self._rejoining.get(shard) == msg.fields["id"]:
                self._registered_again(shard, msg.fields["pushed"], msg.fields["keep_from"])

    # ---- recovery ---------------------------------------------------------------------------------------
    def wait_durable(self, timeout_s: float, progress: int = 0) -> bool:
        """Block until every shard has this stage's pushes in a checkpoint (a shard restarting now would lose
        none), asking with heartbeats; False after timeout_s. Immediate when the shards keep no
        checkpoints."""
        deadline = time.monotonic() + timeout_s
        while min(self.keep_from, default=0) < self._next_wave and self._registration:
            if time.monotonic() > deadline:
                return False
            self.send_heartbeat(progress)
            self.poll(int(self.retry_s * 1000 / 4) + 1)
        return True

    def _acknowledged(self, shard: int, keep_from: int, call: Call) -> None:
        """Drop the pushes every shard has in a checkpoint; copy one about to be kept whose arrays get
        reused."""
        self.keep_from[shard] = max(self.keep_from[shard], keep_from)
        oldest = min(self.keep_from)
        for wave in [w for w in self.retained if w < oldest]:
            del self.retained[wave]
            self._copy_on_retain.discard(wave)
        if call.done and call.wave in self._copy_on_retain:
            tensors, _ = self.retained[call.wave]
            self.retained[call.wave] = ({k: np.array(v) for k, v in tensors.items()}, call)
            self._copy_on_retain.discard(call.wave)

    def _rejoin(self, shard: int) -> None:
        """Register with a restarted shard again (once; other requests to it wait for the answer)."""
        if shard in self._rejoining:
            return
        self.restarts_seen += 1
        fields, part = self._registration[shard]
        requests: list[Request | None] = [None] * len(self.sockets)
        requests[shard] = ("register", fields, part)
        self._rejoining[shard] = -2  # nothing goes to the shard until the registration is on its way
        call = self.send(requests, what=f"registration with restarted shard {shard}", background="rejoin")
        self._rejoining[shard] = call.ids[shard]
        self._resend(time.monotonic())

    def _registered_again(self, shard: int, pushed: int, keep_from: int) -> None:
        """The restarted shard holds `pushed` of this stage's waves: resend the later ones it acknowledged
        before (in order), then let everything unanswered go again."""
        del self._rejoining[shard]
        self.keep_from[shard] = keep_from
        kept = sorted(self.retained)
        if pushed < self._next_wave and (not kept or kept[0] > pushed):
            self.fatal = PSError(
                "lost",
                (
                    f"shard {shard} restarted holding {pushed} waves of vw {self.vw} stage {self.stage}, "
                    f"but this stage pushed {self._next_wave} and kept only waves {kept[:1] + kept[-1:]}: "
                    "the shard's newest checkpoint is older than it said (corrupted?); the pushes in between "
                    "are gone. Restart the run with --resume"
                ),
            )
            return
        for wave in kept:
            tensors, call = self.retained[wave]
            if wave < pushed or (call.replies[shard] is None and not call.done):
                continue  # in the shard's state, or still open (it goes again below)
            requests: list[Request | None] = [None] * len(self.sockets)
            requests[shard] = ("push", {**self._stage_fields(), "wave": wave}, self._split(tensors)[shard])
            self.send(
                requests,
                what=f"push of wave {wave} again to restarted shard {shard}",
                wave=wave,
                background="resend",
            )
        for (s, _), call in self._open.items():
            if s == shard:
                call.sent_at[shard] = -1e9
        self._resend(time.monotonic())

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

    def _timeout_message(self, what: str, waited: float, gate: int) -> str:
        who = f"vw {self.vw} stage {self.stage}"
        text = f"{what} by {who} got no answer in {waited:.0f} s"
        if self._probing:  # the status probe below timed out itself: no probe of the probe
            return text
        try:
            saved, self.timeout_s, self._probing = self.timeout_s, min(5.0, self.retry_s * 2), True
            infos = self.status()
        except HetpipeError:
            refused = (
                f" Or it refuses this client's CURVE key ({self.curve.user}): both sides need the same "
                "[ps] keys_dir, and the shard logs every client it refuses."
                if self.curve
                else ""
            )
            return (
                f"{text}; the PS at {', '.join(self.endpoints)} does not answer either: "
                f"is it running?{refused}"
            )
        finally:
            self.timeout_s, self._probing = saved, False
        info = min(infos, key=lambda i: i["c_global"])
        slow = info.get("slowest_vw")
        if gate >= 0 and slow is not None:
            need = gate - info["staleness"] - 1
            return (
                f"{text}: waiting for vw {slow}, which completed {info['c_local'][slow]} waves "
                f"(c_global {info['c_global']}, wave {gate} needs {need}); is vw {slow} running?"
            )
        return f"{text}; the PS answers status (c_global {info['c_global']}), so the request itself stalls"
