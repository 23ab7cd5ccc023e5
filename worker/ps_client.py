"""The PS client of one stage: register, push (acknowledged, retried), pull(wave) behind the WSP gate, and the
status and admin reads.

One DEALER socket per shard (worker/ps_sockets.py). Every request carries an id and is answered by the server;
a request without an answer within `retry_s` is sent again with the same id (safe: pushes are idempotent,
pulls and reads change nothing), and fails after `timeout_s` with an error that says whom it waited for
(worker/ps_calls.py sends and completes the calls; this module words the timeout).

With `curve` keys every socket is a CurveZMQ client: encrypted, and the PS knows which key it holds.

Requests are Calls (one request per shard) that complete as replies arrive, so several may be in flight
at once (hetpipe.worker.ps_agent overlaps pushes and pulls with compute); register/push/pull/status/read
are the blocking forms.

A shard's restart reaches no caller unless pushes it acknowledged are gone for good: the client keeps its
registration and the pushes not yet in every shard's checkpoint, registers again and resends
(worker/ps_recovery.py, docs/recovery.md).
"""

from __future__ import annotations

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
from hetpipe.core.wsp.freezing import FreezeSchedule
from hetpipe.core.wsp.movement import combined
from hetpipe.worker.ps_calls import Call, PSError, PSTimeout, Request, ShardCalls
from hetpipe.worker.ps_recovery import ShardRecovery
from hetpipe.worker.ps_sockets import ShardSockets, routing_id

__all__ = ["Call", "ClientSpec", "PSClient", "PSError", "PSTimeout", "Pulled", "pulled_of"]


@dataclass(frozen=True)
class Pulled:
    """The weights a pull brought back, with what the shards said of them."""

    version: int  # t of W_t (exact) or c_global when served (latest)
    own_through: int  # own waves <= this are contained (max over shards is not needed: all agree)
    tensors: dict[str, np.ndarray]
    parked_s: float = 0.0  # how long the request waited at the PS for its gate (the longest shard)
    # [vw, from, to): waves a VW added nothing to (any shard)
    gaps: list[list[int]] = field(default_factory=list)
    # [train] autofreeze: the shards' movement records, added up in shard order (hetpipe.core.wsp.movement)
    movement: list[list[Any]] = field(default_factory=list)


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
    vw_weights: tuple[int, ...] = ()  # each VW's weight by samples (hetpipe.core.wsp.work); (): all 1
    freeze: tuple[tuple[int, int], ...] = ()  # [train] freeze: the frozen parameters' pushes are left out
    vw_spans: tuple[tuple[int, int], ...] = ()  # each VW's planned [start, end), end 0: the run's; (): all
    movement: bool = False  # [train] autofreeze: pulls ask for the layers' movement records
    records_only: bool = False  # and for nothing else (a lone VW, whose weights are its own)

    def fields(self) -> dict[str, Any]:
        """Its fields as plain values (the agent process gets them over its pipe, as msgpack)."""
        return asdict(self)  # the keys too, as a map

    @classmethod
    def of(cls, fields: Mapping[str, Any]) -> ClientSpec:
        """The spec `fields()` gave."""
        curve = fields["curve"]
        return cls(
            **{
                **fields,
                "curve": ClientKeys(**curve) if curve else None,
                "vw_weights": tuple(fields.get("vw_weights", ())),
                "freeze": tuple(tuple(pair) for pair in fields.get("freeze", ())),
                "vw_spans": tuple(tuple(pair) for pair in fields.get("vw_spans", ())),
            }
        )

    def client(self) -> PSClient:
        client = PSClient(
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
            vw_weights=self.vw_weights,
        )
        client.freeze = FreezeSchedule.at(self.freeze)
        client.vw_spans = self.vw_spans
        client.movement_known = -1 if self.movement else None
        client.records_only = self.records_only
        return client


class PSClient:
    """Talks to every shard for one stage of one virtual worker: what its requests say. Its sockets are
    `connections`, its calls go out and complete through `calls`, and `recovery` keeps what a shard's restart
    needs."""

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
        vw_weights: tuple[int, ...] = (),
        members: tuple[int, ...] = (),
    ) -> None:
        self.endpoints = endpoints
        self.members = tuple(members)  # a node relay's group (docs/wsp.md#node-local-aggregation); ()
        self.run, self.vw, self.stage = run, vw, stage
        self.num_vws, self.num_stages = num_vws, num_stages
        self.vw_weights = tuple(vw_weights)
        self.vw_spans: tuple[tuple[int, int], ...] = ()  # each VW's planned waves (docs/wsp.md#planned-spans)
        self.freeze = FreezeSchedule()  # [train] freeze: pushes leave a parameter out from its wave on
        # [train] autofreeze: the newest movement record taken (-1: none; None: pulls ask for none)
        self.movement_known: int | None = None
        self.records_only = False  # and its pulls ask for no weights
        self.placement, self.curve = dict(placement), curve
        self.keys: list[str] = []
        self.connections = ShardSockets(endpoints, routing_id(run, vw, stage), curve)
        self.recovery = ShardRecovery(len(endpoints), self._push_requests, f"vw {vw} stage {stage}")
        pack = None if wire_dtype == "float32" else wire_dtype
        self.calls = ShardCalls(
            self.connections.sockets, timeout_s, retry_s, pack, self.recovery, self._timeout_message
        )
        self._heartbeat: Call | None = None
        self._probing = False

    # ---- its parts' state, as attributes of the client --------------------------------------------------
    @property
    def context(self) -> zmq.Context:
        return self.connections.context

    @property
    def sockets(self) -> list[zmq.Socket]:
        return self.connections.sockets

    @property
    def timeout_s(self) -> float:
        return self.calls.timeout_s

    @timeout_s.setter
    def timeout_s(self, value: float) -> None:
        self.calls.timeout_s = value

    @property
    def retry_s(self) -> float:
        return self.calls.retry_s

    @property
    def fatal(self) -> HetpipeError | None:
        """A request the client sent by itself failed for good (poll raises it)."""
        return self.calls.fatal

    @property
    def checkpoint_floor(self) -> int:
        """The clock of the oldest checkpoint any shard keeps on disk (0: none yet)."""
        return self.recovery.checkpoint_floor()

    @property
    def keep_from(self) -> list[int]:
        """Per shard: this stage's pushes of earlier waves are in its checkpoint."""
        return self.recovery.keep_from

    @property
    def retained(self) -> dict[int, tuple[Mapping[str, np.ndarray], Call]]:
        """Wave -> its push, kept until every shard has it in a checkpoint."""
        return self.recovery.retained

    @property
    def restarts_seen(self) -> int:
        return self.recovery.restarts_seen

    def close(self) -> None:
        self.connections.close()

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

    def _push_requests(self, wave: int, tensors: Mapping[str, np.ndarray]) -> list[Request]:
        """The push of `wave`, one request per shard (each shard's keys of `tensors` but the frozen ones)."""
        fields = {**self._stage_fields(), "wave": wave}
        unfrozen = _unfrozen(tensors, self.calls.packed_keys, self.freeze, wave)
        return [("push", fields, part) for part in self._split(unfrozen)]

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
        returns the PS's W_0 for them (a shard sends back only the keys whose W_0 differs from the values
        sent: the others are these). A copy of the registration is kept, to register again with a restarted
        shard."""
        self.keys = list(tensors)
        kinds = kinds or {}
        self.calls.packed_keys = {k for k in tensors if kinds.get(k, "param") == "param"}
        requests: list[Request | None] = []
        self.recovery.registration = []
        for part in self._split(tensors):
            fields = {
                **self._stage_fields(),
                "num_vws": self.num_vws,
                "num_stages": self.num_stages,
                "want_weights": want_weights,
                "num_waves": num_waves,
                "start_wave": start_wave,
                "vw_weights": list(self.vw_weights),
                "members": list(self.members),
                "vw_spans": [list(span) for span in self.vw_spans],
                "buffers": [k for k in part if kinds.get(k) == "buffer"],
                "ledgers": [k for k in part if kinds.get(k) == "ledger"],
            }
            requests.append(("register", fields, part))
            self.recovery.keep_registration(fields, part)
        replies = self.wait(self.send(requests, what="register"))
        self.recovery.registered(start_wave, replies)
        out: dict[str, np.ndarray] = {}
        for reply in replies:
            out.update({k: v.to_array() for k, v in reply.tensors.items()})
        if want_weights:
            out.update({k: v for k, v in tensors.items() if k not in out})  # W_0 is what this stage sent
        return out

    def send_push(self, wave: int, tensors: Mapping[str, np.ndarray], reused: bool = False) -> Call:
        """Send this stage's push of `wave` to every shard (complete it with wait or poll). It is kept until
        every shard has it in a checkpoint; `reused`: the caller will change the arrays once the call is done
        (they are copied first if they must be kept)."""
        call = self.send(self._push_requests(wave, tensors), what=f"push of wave {wave}", wave=wave)
        self.recovery.keep_push(wave, tensors, call, reused)
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
        if self.movement_known is not None:
            fields["known"] = self.movement_known
        if self.records_only:
            fields["records_only"] = True
        return self.send([("pull", fields, None)] * len(self.sockets), what=f"pull of wave {wave}", gate=wave)

    def took(self, pulled: Pulled) -> Pulled:
        """Note the newest movement record `pulled` brought (later pulls ask for newer ones only)."""
        if self.movement_known is not None and pulled.movement:
            self.movement_known = max(self.movement_known, pulled.movement[-1][0])
        return pulled

    def pull(self, wave: int, out: Mapping[str, np.ndarray] | None = None) -> Pulled:
        """Wait for the gate of `wave` and return the global weights (copied into `out` when given)."""
        return self.took(pulled_of(self.wait(self.send_pull(wave)), out))

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

    # ---- calls (worker/ps_calls.py) -----------------------------------------------------------------
    def send(
        self, requests: list[Request | None], what: str, gate: int = -1, wave: int = -1, background: str = ""
    ) -> Call:
        """Send one request per shard (None: nothing to that shard); the returned Call completes as `poll`
        reads the replies."""
        return self.calls.send(requests, what, gate, wave, background)

    def poll(self, timeout_ms: int, extra: Sequence[zmq.Socket] = ()) -> list[zmq.Socket]:
        """Read every reply that arrives within timeout_ms into its Call; resend what is due. Returns which
        of `extra` (sockets the caller also waits on) became readable."""
        return self.calls.poll(timeout_ms, extra)

    def wait(self, call: Call) -> list[wire.Message]:
        """Block until `call` completes; its replies, one per shard (or its error)."""
        return self.calls.wait(call)

    def wait_durable(self, timeout_s: float, progress: int = 0) -> bool:
        """Block until every shard has this stage's pushes in a checkpoint (a shard restarting now would lose
        none), asking with heartbeats; False after timeout_s. Immediate when the shards keep no
        checkpoints."""
        deadline = time.monotonic() + timeout_s
        while not self.recovery.durable():
            if time.monotonic() > deadline:
                return False
            self.send_heartbeat(progress)
            self.poll(int(self.retry_s * 1000 / 4) + 1)
        return True

    # ---- why a call timed out -----------------------------------------------------------------------
    def _timeout_message(self, what: str, waited: float, gate: int) -> str:
        """Whom `what` waited for: the PS's status names the slowest VW, or the PS does not answer at all."""
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
        if gate >= 0 and info.get("relay"):  # a relay's c_global is the version it got from the PS
            need, members = gate - info["staleness"] - 1, ", ".join(map(str, info["members"]))
            return (
                f"{text}: its node's relay (vws {members}) holds W_{info['version']} and waits for W_{need} "
                "from the PS, which waits for a VW outside the group (the relay's log names it); is every VW "
                "running?"
            )
        if gate >= 0 and slow is not None:
            need = gate - info["staleness"] - 1
            return (
                f"{text}: waiting for vw {slow}, which completed {info['c_local'][slow]} waves "
                f"(c_global {info['c_global']}, wave {gate} needs {need}); is vw {slow} running?"
            )
        return f"{text}; the PS answers status (c_global {info['c_global']}), so the request itself stalls"


def _unfrozen(
    tensors: Mapping[str, np.ndarray], params: set[str], freeze: FreezeSchedule, wave: int
) -> Mapping[str, np.ndarray]:
    """`tensors` less the parameters `freeze` has frozen by `wave` (all of them without freezing)."""
    return {k: tensors[k] for k in freeze.pushed(tensors, params.__contains__, wave)}


def pulled_of(replies: Sequence[wire.Message], out: Mapping[str, np.ndarray] | None = None) -> Pulled:
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
        movement=combined(r.fields.get("movement", []) for r in replies),
    )
