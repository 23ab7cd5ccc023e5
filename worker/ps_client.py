"""The PS client of one stage: register, push (acknowledged, retried), pull(wave) behind the WSP gate.

One DEALER socket per shard. Every request carries an id and is answered by the server; a request
without an answer within `retry_s` is sent again with the same id (safe: pushes are idempotent, pulls
and reads change nothing), and fails after `timeout_s` with an error that says whom it waited for.

With `curve` keys every socket is a CurveZMQ client: encrypted, and the PS knows which key it holds.

Requests are Calls (one request per shard) that complete as replies arrive, so several may be in flight
at once (hetpipe.worker.ps_agent overlaps pushes and pulls with compute); register/push/pull/status/read
are the blocking forms.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import zmq

from hetpipe.core import wire
from hetpipe.core.errors import HetpipeError
from hetpipe.core.keys import ClientKeys
from hetpipe.core.placement import keys_by_shard

__all__ = ["Call", "PSClient", "PSError", "PSTimeout", "Pulled"]

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


@dataclass
class Call:
    """One request per shard, sent and waiting for every reply."""

    what: str
    frames: list[list[Any]]
    ids: list[int]
    gate: int = -1  # the wave whose gate a pull waits for (for the timeout message)
    replies: list[wire.Message | None] = field(default_factory=list)
    sent_at: list[float] = field(default_factory=list)
    started: float = field(default_factory=time.monotonic)
    error: HetpipeError | None = None

    @property
    def done(self) -> bool:
        return self.error is not None or all(r is not None for r in self.replies)

    def result(self) -> list[wire.Message]:
        if self.error is not None:
            raise self.error
        return [r for r in self.replies if r is not None]


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
    ) -> None:
        self.endpoints = endpoints
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
            raise HetpipeError(f"key {exc} has no shard in the placement: place the whole model's keys") from None
        return [{k: tensors[k] for k in part} for part in parts]

    def register(self, tensors: Mapping[str, np.ndarray], want_weights: bool = True,
                 kinds: Mapping[str, str] | None = None, num_waves: int = 0) -> dict[str, np.ndarray]:
        """Declare this stage's keys with their initial values and kinds ("param", "buffer", "ledger"; default
        param) and the run's length (0: unknown); returns the PS's W_0 for them."""
        self.keys = list(tensors)
        kinds = kinds or {}
        requests: list[Request] = []
        for part in self._split(tensors):
            fields = {**self._stage_fields(), "num_vws": self.num_vws, "num_stages": self.num_stages,
                      "want_weights": want_weights, "num_waves": num_waves,
                      "buffers": [k for k in part if kinds.get(k) == "buffer"],
                      "ledgers": [k for k in part if kinds.get(k) == "ledger"]}
            requests.append(("register", fields, part))
        replies = self.wait(self.send(requests, what="register"))
        out: dict[str, np.ndarray] = {}
        for reply in replies:
            out.update({k: v.to_array() for k, v in reply.tensors.items()})
        return out

    def send_push(self, wave: int, tensors: Mapping[str, np.ndarray]) -> Call:
        """Send this stage's push of `wave` to every shard (complete it with wait or poll)."""
        fields = {**self._stage_fields(), "wave": wave}
        return self.send([("push", fields, part) for part in self._split(tensors)], what=f"push of wave {wave}")

    def push(self, wave: int, tensors: Mapping[str, np.ndarray]) -> int:
        """Push this stage's update of `wave`; returns the smallest c_global seen."""
        return min(r.fields["c_global"] for r in self.wait(self.send_push(wave, tensors)))

    def send_pull(self, wave: int) -> Call:
        fields = {**self._stage_fields(), "wave": wave}
        return self.send([("pull", fields, None)] * len(self.sockets), what=f"pull of wave {wave}", gate=wave)

    @staticmethod
    def pulled(replies: Sequence[wire.Message], out: Mapping[str, np.ndarray] | None = None) -> Pulled:
        """The weights of a pull's replies, copied into `out` where it has the key (else views of the frames)."""
        tensors: dict[str, np.ndarray] = {}
        for reply in replies:
            for key, view in reply.tensors.items():
                if out is not None and key in out:
                    view.copy_into(out[key])
                    tensors[key] = out[key]
                else:
                    tensors[key] = view.to_array()
        return Pulled(version=min(r.fields["version"] for r in replies),
                      own_through=min(r.fields["own_through"] for r in replies), tensors=tensors,
                      parked_s=max(r.fields["parked_ms"] for r in replies) / 1000)

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
        """Admin read with its version: (the oldest shard's t of W_t, or c_global for latest; every key, copied)."""
        replies = self.wait(self.send([("read", {"run": self.run}, None)] * len(self.sockets), what="read"))
        return (min(r.fields["version"] for r in replies),
                {k: np.array(v.to_array()) for r in replies for k, v in r.tensors.items()})

    # ---- calls --------------------------------------------------------------------------------------
    def send(self, requests: list[Request], what: str, gate: int = -1) -> Call:
        """Send one request per shard; the returned Call completes as `poll` reads the replies."""
        frames, ids = [], []
        for msg_type, fields, tensors in requests:
            rid = next(self._ids)
            ids.append(rid)
            frames.append(wire.encode(msg_type, {"id": rid, **fields}, tensors))
        call = Call(what, frames, ids, gate, [None] * len(requests), [-1e9] * len(requests))
        for shard, rid in enumerate(ids):
            self._open[(shard, rid)] = call
        self._resend(time.monotonic())
        return call

    def _resend(self, now: float) -> None:
        """Send what is due: new requests, and unanswered ones every retry_s; time out the old ones."""
        expired: list[Call] = []
        for (shard, _), call in list(self._open.items()):
            if call.done or call in expired:
                continue
            if now - call.started > self.timeout_s:
                expired.append(call)
            elif now - call.sent_at[shard] >= self.retry_s:
                # never block: a DEALER whose connection failed its handshake has nowhere to queue; an
                # unsent request is tried again after retry_s, and the timeout still counts
                with contextlib.suppress(zmq.Again):
                    self.sockets[shard].send_multipart(call.frames[shard], copy=False, flags=zmq.NOBLOCK)
                call.sent_at[shard] = now
        for call in expired:  # closed first: the message below asks the PS for its status with a call of its own
            call.error = PSTimeout(f"{call.what} timed out")
            self._forget(call)
        for call in expired:
            call.error = PSTimeout(self._timeout_message(call.what, now - call.started, call.gate))

    def _forget(self, call: Call) -> None:
        for shard, rid in enumerate(call.ids):
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
                call.error = PSError(msg.fields["code"], f"{call.what} refused by shard {shard}: {msg.fields['message']}")
                self._forget(call)
                continue
            call.replies[shard] = msg
            self._open.pop((shard, msg.fields["id"]), None)

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
            refused = (f" Or it refuses this client's CURVE key ({self.curve.user}): both sides need the same "
                       "[ps] keys_dir, and the shard logs every client it refuses." if self.curve else "")
            return f"{text}; the PS at {', '.join(self.endpoints)} does not answer either: is it running?{refused}"
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
