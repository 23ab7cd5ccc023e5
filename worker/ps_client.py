"""The PS client of one stage: register, push (acknowledged, retried), pull(wave) behind the WSP gate.

One DEALER socket per shard. Every request carries an id and is answered by the server; a request
without an answer within `retry_s` is sent again with the same id (safe: pushes are idempotent, pulls
and reads change nothing), and fails after `timeout_s` with an error that says whom it waited for.
With `curve` keys every socket is a CurveZMQ client: encrypted, and the PS knows which key it holds.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import zmq

from hetpipe.core import wire
from hetpipe.core.errors import HetpipeError
from hetpipe.core.keys import ClientKeys
from hetpipe.core.placement import keys_by_shard

__all__ = ["PSClient", "PSError", "PSTimeout", "Pulled"]


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
        self._socks: list[zmq.Socket] = []
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
            self._socks.append(sock)
        self.keys: list[str] = []

    def close(self) -> None:
        for sock in self._socks:
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
            parts = keys_by_shard(self.placement, list(tensors), len(self._socks))
        except KeyError as exc:
            raise HetpipeError(f"key {exc} has no shard in the placement: place the whole model's keys") from None
        return [{k: tensors[k] for k in part} for part in parts]

    def register(self, tensors: Mapping[str, np.ndarray], want_weights: bool = True) -> dict[str, np.ndarray]:
        """Declare this stage's keys with their initial values; returns the PS's W_0 for them."""
        self.keys = list(tensors)
        fields = {**self._stage_fields(), "num_vws": self.num_vws, "num_stages": self.num_stages}
        fields["want_weights"] = want_weights
        requests = [("register", fields, part) for part in self._split(tensors)]
        replies = self._call(requests, what="register")
        out: dict[str, np.ndarray] = {}
        for reply in replies:
            out.update({k: v.to_array() for k, v in reply.tensors.items()})
        return out

    def push(self, wave: int, deltas: Mapping[str, np.ndarray]) -> int:
        """Push this stage's summed update of `wave` to every shard; returns the smallest c_global seen."""
        fields = {**self._stage_fields(), "wave": wave}
        replies = self._call([("push", fields, part) for part in self._split(deltas)], what=f"push of wave {wave}")
        return min(r.fields["c_global"] for r in replies)

    def pull(self, wave: int, out: Mapping[str, np.ndarray] | None = None) -> Pulled:
        """Wait for the gate of `wave` and return the global weights (copied into `out` when given)."""
        fields = {**self._stage_fields(), "wave": wave}
        replies = self._call([("pull", fields, None)] * len(self._socks), what=f"pull of wave {wave}", gate=wave)
        tensors: dict[str, np.ndarray] = {}
        for reply in replies:
            for key, view in reply.tensors.items():
                if out is not None and key in out:
                    view.copy_into(out[key])
                    tensors[key] = out[key]
                else:
                    tensors[key] = np.array(view.to_array())
        versions = {r.fields["version"] for r in replies}
        own = {r.fields["own_through"] for r in replies}
        return Pulled(version=min(versions), own_through=min(own), tensors=tensors)

    def status(self) -> list[dict[str, Any]]:
        replies = self._call([("status", {"run": self.run}, None)] * len(self._socks), what="status")
        return [r.fields["info"] for r in replies]

    def read(self) -> dict[str, np.ndarray]:
        """Admin read: every key of every shard, at the newest complete version."""
        replies = self._call([("read", {"run": self.run}, None)] * len(self._socks), what="read")
        return {k: np.array(v.to_array()) for r in replies for k, v in r.tensors.items()}

    # ---- the request loop -----------------------------------------------------------------------------
    def _call(
        self, requests: list[tuple[str, dict[str, Any], Mapping[str, np.ndarray] | None]], what: str, gate: int = -1
    ) -> list[wire.Message]:
        """Send one request per shard, wait for every reply; resend unanswered ones every retry_s."""
        frames, ids = [], []
        for msg_type, fields, tensors in requests:
            rid = next(self._ids)
            ids.append(rid)
            frames.append(wire.encode(msg_type, {"id": rid, **fields}, tensors))
        replies: list[wire.Message | None] = [None] * len(requests)
        poller = zmq.Poller()
        for sock in self._socks:
            poller.register(sock, zmq.POLLIN)
        start = time.monotonic()
        sent_at = [-1e9] * len(requests)
        while any(r is None for r in replies):
            now = time.monotonic()
            if now - start > self.timeout_s:
                raise PSTimeout(self._timeout_message(what, now - start, gate))
            for i, reply in enumerate(replies):
                if reply is None and now - sent_at[i] >= self.retry_s:
                    # never block: a DEALER whose connection failed its handshake has nowhere to queue; an
                    # unsent request is tried again after retry_s, and the timeout still counts
                    with contextlib.suppress(zmq.Again):
                        self._socks[i].send_multipart(frames[i], copy=False, flags=zmq.NOBLOCK)
                    sent_at[i] = now
            for sock, _ in poller.poll(timeout=int(self.retry_s * 1000 / 4) + 1):
                shard = self._socks.index(sock)
                while True:
                    try:
                        raw = sock.recv_multipart(copy=False, flags=zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    msg = self._decode(raw, shard)
                    if msg is None or msg.fields.get("id") != ids[shard] or replies[shard] is not None:
                        continue  # an answer to an earlier try of an earlier request
                    if msg.type == "error":
                        raise PSError(msg.fields["code"], f"{what} refused by shard {shard}: {msg.fields['message']}")
                    replies[shard] = msg
        return [r for r in replies if r is not None]

    def _decode(self, raw: list[zmq.Frame], shard: int) -> wire.Message | None:
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
