"""One PS shard: a single-threaded ZeroMQ ROUTER loop around hetpipe.core.wsp.state.ShardState.

Requests are decoded and validated by hetpipe.core.protocol.wire; every request gets a reply (or, for a pull
whose gate is closed, is parked and answered the moment the gate opens; one parked pull per stage). Weights
leave by zero-copy sends; the state copies an array before changing it while such a send still reads it.
Tensors with NaN or inf are refused before the state sees them. With keys (auth = "curve") the ROUTER is a
CURVE server behind hetpipe.server.guard, and each request must come from a key allowed to act as its VW.

Recovery (docs/recovery.md): a shard restarted after a crash loads its newest valid checkpoint; clients find
their connection unknown (`not_registered`), register again and resend every push the shard does not hold.
Acks say how far each stage's pushes are in a checkpoint (`keep_from`), so clients keep only the rest. Stages
send heartbeats; one silent for `hung_after_s` fails its VW: evicted (on_vw_failure = "evict": the others go
on) or the whole run stopped ("stop").
"""

from __future__ import annotations

import signal
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import zmq

from hetpipe.core.protocol import wire
from hetpipe.core.protocol.access import RefusalLog, refusal
from hetpipe.core.protocol.keys import ServerKeys
from hetpipe.core.wsp.aggregation import Aggregation, make_aggregation
from hetpipe.core.wsp.state import PullResult, ShardState, WspError
from hetpipe.server.checkpoint import (
    BackgroundWriter,
    discard_after,
    load_clock,
    load_newest,
    write_checkpoint,
)
from hetpipe.server.guard import CurveGate

__all__ = ["ShardServer", "ShardSettings"]

REQUEST_TYPES = ("register", "push", "pull", "status", "read", "heartbeat", "evict", "rejoin")
STAGE_REQUESTS = (
    "register",
    "push",
    "pull",
    "heartbeat",
)  # refused once the run failed (on_vw_failure = "stop")


@dataclass(frozen=True)
class ShardSettings:
    run: str
    shard: int
    endpoint: str  # tcp://host:port to bind
    staleness: int
    pull_mode: str = "exact"
    checkpoint_dir: Path | None = None  # None: no checkpoints
    checkpoint_every: int = 0  # clocks between checkpoints; 0: only on SIGTERM
    checkpoint_keep: int = 3
    aggregation: str = "sum"  # sum | mean | server (hetpipe.core.wsp.aggregation)
    optimizer: str = "sgd"  # the PS-side optimizer of aggregation "server", with its settings
    lr: float = 0.01
    momentum: float = 0.9
    weight_decay: float = 0.0

    keys: ServerKeys | None = None  # None: no authentication (auth = "none")
    on_vw_failure: str = "stop"  # a stage silent for hung_after_s: "stop" the run | "evict" its VW
    hung_after_s: float = 0.0  # 0: no heartbeat checks
    resume_clock: int | None = (
        None  # start from this clock's checkpoint, cut back to it (hetpipe train --resume)
    )
    wire_dtype: str = (
        "float32"  # pulled weights on the wire: float32 | bfloat16 (pushes come as their sender chose)
    )

    @property
    def recoverable(self) -> bool:
        """Checkpoints come every few clocks, so a crash of this shard can be recovered from."""
        return self.checkpoint_dir is not None and self.checkpoint_every > 0

    def make_aggregation(self) -> Aggregation:
        return make_aggregation(self.aggregation, self.optimizer, self.lr, self.momentum, self.weight_decay)


@dataclass
class Parked:
    identity: bytes
    request_id: int
    vw: int
    stage: int
    wave: int
    since: float = field(default_factory=time.monotonic)


@dataclass
class Traffic:
    """Counters for the status line, reset at every clock."""

    bytes_in: int = 0
    bytes_out: int = 0
    pull_wait_s: float = 0.0


class ShardServer:
    """Serves one shard until stopped; `serve()` returns after a SIGTERM checkpoint or `stop()`."""

    def __init__(self, settings: ShardSettings, log: Callable[[str], None] | None = None) -> None:
        self.settings = settings
        self.log = log or (lambda line: print(line, file=sys.stderr, flush=True))
        self.state = ShardState(settings.staleness, settings.pull_mode, settings.make_aggregation())
        self.identities: dict[tuple[int, int], bytes] = {}
        self.evicted_identities: dict[bytes, int] = {}  # connections of stages whose VW was evicted -> the VW
        self.parked: dict[tuple[int, int], Parked] = {}  # (vw, stage) -> its one pull waiting for the gate
        self.refusals = RefusalLog()
        self.gate: CurveGate | None = None
        self.traffic = Traffic()
        self.durable: dict[tuple[int, int], int] = {}  # (vw, stage) -> its pushes in the newest checkpoint
        self.beats: dict[tuple[int, int], tuple[float, int]] = {}  # (vw, stage) -> (last heartbeat, progress)
        self.failed: str | None = None  # why the run stopped (on_vw_failure = "stop")
        self._stopping = False
        self._last_checkpoint = -1
        self._sock: zmq.Socket | None = None
        self._writer: BackgroundWriter | None = None
        self._restore()
        if settings.checkpoint_dir is not None and settings.checkpoint_every > 0:
            self._writer = BackgroundWriter(
                settings.checkpoint_dir,
                settings.checkpoint_keep,
                lambda m: self.log(f"[shard {settings.shard}] {m}"),
            )

    # ---- lifecycle --------------------------------------------------------------------------------
    def _restore(self) -> None:
        directory = self.settings.checkpoint_dir
        if directory is None:
            return
        say = lambda m: self.log(f"[shard {self.settings.shard}] {m}")  # noqa: E731
        cut = self.settings.resume_clock
        ckpt = load_newest(directory, say) if cut is None else load_clock(directory, cut)
        if ckpt is None:
            return
        meta = ckpt.meta
        if meta.get("run") != self.settings.run or meta["wsp"]["staleness"] != self.settings.staleness:
            self.log(
                f"[shard {self.settings.shard}] note: checkpoint {ckpt.path.name} is of run "
                f"{meta.get('run')!r} with D={meta['wsp']['staleness']}; resuming it as it was written"
            )
        exact = meta["wsp"]["pull_mode"] == "exact"
        try:
            self.state = ShardState.from_state(
                meta["wsp"], ckpt.arrays, self.settings.make_aggregation(), cut=cut if exact else None
            )
        except WspError as exc:
            from hetpipe.core.errors import HetpipeError

            raise HetpipeError(
                f"shard {self.settings.shard}: cannot resume from {ckpt.path}: {exc}"
            ) from None
        if cut is not None:
            dropped = discard_after(directory, cut)
            if dropped:
                say(f"resuming from clock {cut}: dropped the later checkpoints {dropped}")
        self._last_checkpoint = ckpt.clock
        self.durable = dict(self.state.pushed)
        now = time.monotonic()
        self.beats = {
            sid: (now, 0) for sid in self.state.stage_keys
        }  # a restart gives every stage its full grace
        self.log(
            f"[shard {self.settings.shard}] resumed from {ckpt.path} at clock {ckpt.clock} "
            f"(c_local {self.state.status()['c_local']})"
        )

    def stop(self) -> None:
        self._stopping = True

    def serve(self, ready: Callable[[int], None] | None = None) -> None:
        """Bind, then handle requests until stop() or SIGTERM (which checkpoints first)."""
        ctx = zmq.Context()
        if self.settings.keys is not None:
            self.gate = CurveGate(
                ctx, self.settings.keys, self.log, self.refusals, f"[shard {self.settings.shard}]"
            )
        sock = self._sock = ctx.socket(zmq.ROUTER)
        wire.configure_socket(sock, router=True)
        if self.gate is not None:
            self.gate.secure(sock)
        port = self._bind(sock)
        if threading_main():
            signal.signal(signal.SIGTERM, lambda *_: self.stop())
            signal.signal(signal.SIGINT, lambda *_: self.stop())
        auth = "none" if self.gate is None else f"curve, {len(self.settings.keys.clients)} client keys"
        self.log(
            f"[shard {self.settings.shard}] run {self.settings.run!r} listening on port {port} "
            f"(D={self.settings.staleness}, pull={self.settings.pull_mode}, auth={auth})"
        )
        if ready:
            ready(port)
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        for gate_sock in self.gate.sockets if self.gate else []:
            poller.register(gate_sock, zmq.POLLIN)
        try:
            while not self._stopping:
                events = dict(poller.poll(100))
                self._check_heartbeats(time.monotonic())
                if not events:
                    continue
                if self.gate is not None:
                    for gate_sock in self.gate.sockets:
                        if gate_sock in events:
                            self.gate.handle(gate_sock)
                for _ in range(64):  # drain a burst, then look at the stop flag again
                    try:
                        frames = sock.recv_multipart(copy=False, flags=zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self._handle(frames)
        finally:
            if self.settings.checkpoint_dir is not None and self.state.stage_keys:
                self.checkpoint(reason="stop")
            if self._writer is not None:
                self._writer.close()
            if self.gate is not None:
                self.gate.close()
            sock.close(linger=0)
            ctx.term()

    def _bind(self, sock: zmq.Socket) -> int:
        endpoint = self.settings.endpoint
        if endpoint.endswith(":0"):
            return sock.bind_to_random_port(endpoint.rsplit(":", 1)[0])
        deadline = (
            time.monotonic() + 10.0
        )  # a restarted shard takes its predecessor's port: the OS may hold it briefly
        while True:
            try:
                sock.bind(endpoint)
                break
            except zmq.ZMQError as exc:
                if exc.errno == zmq.EADDRINUSE and time.monotonic() < deadline:
                    time.sleep(0.2)
                    continue
                from hetpipe.core.errors import HetpipeError

                raise HetpipeError(
                    f"shard {self.settings.shard} cannot listen on {endpoint}: {exc}; "
                    "is another server running? choose another [ps] port"
                ) from None
        return int(endpoint.rsplit(":", 1)[1])

    def checkpoint(self, reason: str, background: bool = False) -> Path | None:
        """Write a checkpoint of the state now (`background`: by the writer thread, while requests go on; the
        pushes it holds count as durable once it is on disk)."""
        directory = self.settings.checkpoint_dir
        if directory is None:
            return None
        meta, arrays = self.state.to_state(detached=background)
        clock = self.state.c_global
        full_meta = {
            "run": self.settings.run,
            "shard": self.settings.shard,
            "c_local": meta_clocks(self.state),
            "wsp": meta,
        }
        pushed = dict(self.state.pushed)
        self._last_checkpoint = clock

        def done(path: Path) -> None:
            self.durable = pushed  # one assignment: the loop thread sees the old dict or this one
            self.log(f"[shard {self.settings.shard}] checkpoint {path.name} written ({reason})")

        if background and self._writer is not None:
            self._writer.submit(clock, full_meta, arrays, done)
            return None
        if self._writer is not None:
            self._writer.drain()  # one writer at a time: the files and their pruning stay in order
        path = write_checkpoint(directory, clock, full_meta, arrays, self.settings.checkpoint_keep)
        done(path)
        return path

    # ---- requests ---------------------------------------------------------------------------------
    def _handle(self, frames: list[zmq.Frame]) -> None:
        identity, body = frames[0].bytes, frames[1:]
        self.traffic.bytes_in += sum(len(f.buffer) for f in body)
        request_id: int | None = None
        try:
            if not body:
                raise wire.WireError("bad_message", "empty message")
            msg = wire.decode(body)
            request_id = msg.fields["id"]
            if msg.type not in REQUEST_TYPES:
                raise wire.WireError("bad_message", f"{msg.type!r} is a reply, not a request")
            if msg.fields["run"] != self.settings.run:
                raise wire.WireError(
                    "run_mismatch",
                    (
                        f"this shard serves run {self.settings.run!r}, not {msg.fields['run']!r}: "
                        "check the config"
                    ),
                )
            if self.gate is not None:
                self._access_check(body[0], msg)
            if self.failed is not None and msg.type in STAGE_REQUESTS:
                raise WspError("vw_failed", self.failed)
            getattr(self, f"_on_{msg.type}")(identity, msg)
        except (wire.WireError, WspError) as exc:
            if request_id is None:  # decode could not finish; it kept the id if the header had one
                request_id = getattr(exc, "request_id", None)
            self._send(identity, wire.error_frames(request_id, exc.code, str(exc)))
        except Exception as exc:  # a bug must not take the shard down; say so loudly and go on
            self.log(f"[shard {self.settings.shard}] internal error: {exc}\n{traceback.format_exc()}")
            self._send(identity, wire.error_frames(request_id, "internal", f"internal error: {exc}"))

    def _access_check(self, header: zmq.Frame, msg: wire.Message) -> None:
        """The key this connection was admitted with (its ZAP User-Id) must be allowed to act as the request's
        VW."""
        user = frame_property(
            header, "User-Id"
        )  # "" (no rights) if it was not admitted through the ZAP handler
        vw = msg.fields.get("vw")
        why = refusal(user, msg.type, vw)
        if why is None:
            return
        claim = f" claiming vw {vw} stage {msg.fields.get('stage')}" if vw is not None else ""
        line = (
            f"refused {msg.type}{claim} from key {user!r} at {frame_property(header, 'Peer-Address')}: {why}"
        )
        for text in self.refusals.note(line, time.monotonic()):
            self.log(f"[shard {self.settings.shard}] {text}")
        raise wire.WireError(
            "forbidden", f"{msg.type}{claim} refused: {why}; each VW's stages must use that VW's key"
        )

    def _finite_check(self, msg: wire.Message, what: str) -> None:
        """Refuse NaN and inf before the state sees them: one poisoned update would spread to every VW."""
        for key, view in msg.tensors.items():
            if not view.all_finite():
                nans, infs = view.non_finite_counts()
                raise wire.WireError(
                    "non_finite",
                    f"{what}: tensor {key!r} holds {nans} NaN and {infs} inf values; the PS refuses "
                    'non-finite tensors (a diverged loss? lower train.lr, or set train.on_nan = "skip")',
                )

    def _owner_check(self, identity: bytes, vw: int, stage: int) -> None:
        if identity in self.evicted_identities:
            gone = self.evicted_identities[identity]
            raise WspError(
                "evicted",
                f"vw {gone} was evicted: its stages must stop (`hetpipe worker --vw {gone}` "
                "rejoins it at the next wave boundary)",
            )
        owner = self.identities.get((vw, stage))
        if owner is None or owner != identity:
            raise WspError(
                "not_registered",
                f"vw {vw} stage {stage} is not registered from this connection: register first",
            )

    def _keep_from(self, sid: tuple[int, int]) -> int:
        """The first wave of this stage whose push the client must keep: the shard may lose it in a crash."""
        if not self.settings.recoverable:
            return self.state.pushed[sid]  # nothing survives a crash here: keeping pushes would not help
        return min(self.durable.get(sid, self.state.epoch_start(sid[0])), self.state.pushed[sid])

    def _on_register(self, identity: bytes, msg: wire.Message) -> None:
        f = msg.fields
        sid = (f["vw"], f["stage"])
        owner = self.identities.get(sid)
        if owner is not None and owner != identity:
            raise WspError(
                "conflict", f"vw {sid[0]} stage {sid[1]} is already registered from another connection"
            )
        self._finite_check(msg, f"register of vw {sid[0]} stage {sid[1]}")
        kinds = {**dict.fromkeys(f["buffers"], "buffer"), **dict.fromkeys(f["ledgers"], "ledger")}
        again = sid in self.state.stage_keys
        values = self.state.register(
            f["vw"],
            f["stage"],
            f["num_vws"],
            f["num_stages"],
            msg.tensors,
            kinds,
            f["num_waves"] or None,
            f["start_wave"],
        )
        self.identities[sid] = identity
        self.beats[sid] = (time.monotonic(), self.beats.get(sid, (0.0, 0))[1])
        if again and owner is None:
            self.log(
                f"[shard {self.settings.shard}] vw {sid[0]} stage {sid[1]} registered again "
                f"(it holds {self.state.pushed[sid]} of its waves)"
            )
        tensors = values if f["want_weights"] else {}
        fields = {
            "id": f["id"],
            "c_global": self.state.c_global,
            "pushed": self.state.pushed[sid],
            "keep_from": self._keep_from(sid),
        }
        self._send(identity, wire.encode("registered", fields, tensors), lent=tensors)

    def _on_push(self, identity: bytes, msg: wire.Message) -> None:
        f = msg.fields
        self._owner_check(identity, f["vw"], f["stage"])
        self._finite_check(msg, f"push of vw {f['vw']} stage {f['stage']} wave {f['wave']}")
        result = self.state.push(f["vw"], f["stage"], f["wave"], msg.tensors)
        sid = (f["vw"], f["stage"])
        ack = {
            "id": f["id"],
            "wave": f["wave"],
            "applied": result.applied,
            "c_global": result.c_global,
            "keep_from": self._keep_from(sid),
        }
        self._send(identity, wire.encode("ack", ack))
        if result.clock_advanced:
            self._on_clock()

    def _on_heartbeat(self, identity: bytes, msg: wire.Message) -> None:
        f = msg.fields
        self._owner_check(identity, f["vw"], f["stage"])
        self.state.stage_keys_of(f["vw"], f["stage"])  # "evicted" once its VW is out
        sid = (f["vw"], f["stage"])
        self.beats[sid] = (time.monotonic(), f["progress"])
        beat = {"id": f["id"], "c_global": self.state.c_global, "keep_from": self._keep_from(sid)}
        self._send(identity, wire.encode("beat", beat))

    def _evict_policy(self, what: str) -> None:
        if self.settings.on_vw_failure != "evict":
            raise WspError(
                "conflict",
                f'{what} refused: this shard runs with [ps] on_vw_failure = "stop" (a failed '
                'VW stops the run); with "evict" the others go on without it',
            )

    def _on_evict(self, identity: bytes, msg: wire.Message) -> None:
        f = msg.fields
        self._evict_policy(f"evict of vw {f['vw']}")
        at = self.evict(f["vw"], "on request")
        self._send(identity, wire.encode("evicted", {"id": f["id"], "vw": f["vw"], "at_wave": at}))

    def _on_rejoin(self, identity: bytes, msg: wire.Message) -> None:
        f = msg.fields
        vw, start = f["vw"], f["start_wave"]
        self._evict_policy(f"rejoin of vw {vw}")
        was_live = self.state.live(vw) if self.state.num_vws else True
        self.state.rejoin(vw, start)
        now = time.monotonic()
        for sid in [sid for sid in self.state.stage_keys if sid[0] == vw]:
            self.identities.pop(sid, None)
            self.beats[sid] = (now, 0)
        if not was_live:
            self.log(
                f"[shard {self.settings.shard}] vw {vw} rejoins at wave {start} "
                f"(c_global {self.state.c_global})"
            )
            if self.settings.recoverable:
                self.checkpoint(reason=f"vw {vw} rejoined")
        self._send(identity, wire.encode("rejoined", {"id": f["id"], "vw": vw, "start_wave": start}))

    def evict(self, vw: int, why: str) -> int:
        """Take VW `vw` out of the live set (its half waves dropped), answer its parked pulls, forget its
        connections; checkpointed before anyone hears of it. Returns the wave boundary it left at."""
        was_live = self.state.num_vws is not None and 0 <= vw < self.state.num_vws and self.state.live(vw)
        boundary, advanced = self.state.evict(vw)
        if not was_live:
            return boundary
        for sid in [sid for sid in self.parked if sid[0] == vw]:
            p = self.parked.pop(sid)
            self._send(p.identity, wire.error_frames(p.request_id, "evicted", f"vw {vw} was evicted ({why})"))
        for sid in [sid for sid in self.identities if sid[0] == vw]:
            self.evicted_identities[self.identities.pop(sid)] = vw
        self.log(
            f"[shard {self.settings.shard}] evicted vw {vw} at wave {boundary} ({why}); live VWs now "
            f"{self.state.live_vws()}, c_global {self.state.c_global}"
        )
        if self.settings.recoverable:
            self.checkpoint(reason=f"vw {vw} evicted")
        if advanced:
            self._on_clock()
        return boundary

    def _check_heartbeats(self, now: float) -> None:
        """A registered stage of a live VW that has not finished and sent nothing for hung_after_s fails its
        VW."""
        limit = self.settings.hung_after_s
        if limit <= 0 or self.failed is not None or self.state.num_vws is None:
            return
        waves = self.state.num_waves
        for sid in sorted(self.state.stage_keys):
            vw = sid[0]
            if not self.state.live(vw) or (waves is not None and self.state.pushed[sid] >= waves):
                continue
            last = self.beats.get(sid, (now, 0))[0]
            self.beats.setdefault(sid, (now, 0))
            if now - last <= limit:
                continue
            why = f"vw {vw} stage {sid[1]} sent no heartbeat for {now - last:.0f} s (dead or hung)"
            if self.settings.on_vw_failure == "evict":
                self.evict(vw, why)
            else:
                self.failed = (
                    f'{why}; [ps] on_vw_failure = "stop" ends the run ("evict" would go on without it)'
                )
                self.log(f"[shard {self.settings.shard}] {self.failed}")
                for p in list(self.parked.values()):
                    self._send(p.identity, wire.error_frames(p.request_id, "vw_failed", self.failed))
                self.parked.clear()
            return

    def _on_pull(self, identity: bytes, msg: wire.Message) -> None:
        f = msg.fields
        self._owner_check(identity, f["vw"], f["stage"])
        parked = Parked(identity, f["id"], f["vw"], f["stage"], f["wave"])
        if self.state.gate_open(f["wave"]):
            self._answer_pull(parked)
            return
        sid = (f["vw"], f["stage"])
        before = self.parked.get(sid)
        if before is not None and (before.identity, before.request_id) == (identity, f["id"]):
            return  # a retry: it keeps its place and its waiting time
        if before is not None:
            # a stage waits for one pull at a time, so an older one was abandoned (and parking every one would
            # grow memory without bound): answer it, so that nothing waits for it forever
            message = f"pull of wave {before.wave} replaced by pull {f['id']} of wave {f['wave']}"
            self._send(before.identity, wire.error_frames(before.request_id, "conflict", message))
        self.parked[sid] = parked

    def _answer_pull(self, p: Parked) -> None:
        try:
            result: PullResult = self.state.pull(p.vw, p.stage, p.wave)
        except WspError as exc:
            self._send(p.identity, wire.error_frames(p.request_id, exc.code, str(exc)))
            return
        parked_ms = int(1000 * (time.monotonic() - p.since))
        fields = {
            "id": p.request_id,
            "wave": p.wave,
            "version": result.version,
            "own_through": result.own_through,
            "parked_ms": parked_ms,
            "gaps": self.state.gaps(),
        }
        pack = None if self.settings.wire_dtype == "float32" else self.settings.wire_dtype
        packed = {k for k in result.tensors if self.state.kinds[k] == "param"} if pack else set()
        # packed weights go in new arrays; what goes as it is (all of it, unpacked) is the state's, lent to
        # the send
        self._send(
            p.identity,
            wire.encode("weights", fields, result.tensors, pack=pack, pack_only=packed),
            lent={k: v for k, v in result.tensors.items() if k not in packed},
        )

    def _on_status(self, identity: bytes, msg: wire.Message) -> None:
        info = self.status_info()
        self._send(identity, wire.encode("status_reply", {"id": msg.fields["id"], "info": info}))

    def _on_read(self, identity: bytes, msg: wire.Message) -> None:
        result = self.state.read()
        fields = {"id": msg.fields["id"], "version": result.version, "info": self.status_info()}
        self._send(identity, wire.encode("snapshot", fields, result.tensors), lent=result.tensors)

    def status_info(self) -> dict[str, Any]:
        info = self.state.status()
        now, live = time.monotonic(), set(info["live"])
        info.update(
            run=self.settings.run,
            shard=self.settings.shard,
            slowest_vw=self.state.slowest_vw(),
            parked=[
                {"vw": p.vw, "stage": p.stage, "wave": p.wave, "waiting_s": round(now - p.since, 3)}
                for p in self.parked.values()
            ],
            last_checkpoint=self._last_checkpoint,
            failed=self.failed,
            heartbeat_age_s={
                f"{v}/{st}": round(now - t, 1) for (v, st), (t, _) in sorted(self.beats.items())
            },
            # live stages with pushes a crash would lose: their clients keep them and wait, so the PS must
            # serve on
            not_durable=[
                f"{v}/{st}"
                for (v, st) in sorted(self.state.pushed)
                if v in live and self._keep_from((v, st)) < self.state.pushed[(v, st)]
            ],
            progress={f"{v}/{st}": n for (v, st), (_, n) in sorted(self.beats.items())},
        )
        return info

    # ---- clocks -----------------------------------------------------------------------------------
    def _on_clock(self) -> None:
        opened = [p for p in self.parked.values() if self.state.gate_open(p.wave)]
        now = time.monotonic()
        for p in sorted(opened, key=lambda p: (p.wave, p.vw, p.stage)):
            del self.parked[(p.vw, p.stage)]
            self.traffic.pull_wait_s += now - p.since
            self._answer_pull(p)
        self._status_line()
        every, clock = self.settings.checkpoint_every, self.state.c_global
        if every and clock != self._last_checkpoint and (clock % every == 0 or clock == self.state.num_waves):
            self.checkpoint(
                reason=f"every {every} clocks" if clock % every == 0 else "the last clock", background=True
            )

    def _status_line(self) -> None:
        t = self.traffic
        self.log(
            f"[shard {self.settings.shard}] clock {self.state.c_global}  c_local {meta_clocks(self.state)}  "
            f"in {t.bytes_in / 1e6:.1f} MB  out {t.bytes_out / 1e6:.1f} MB  "
            f"pulls waited {t.pull_wait_s:.2f} s"
        )
        self.traffic = Traffic()

    # ---- sending ----------------------------------------------------------------------------------
    def _send(self, identity: bytes, frames: list, lent: dict[str, np.ndarray] | None = None) -> None:
        """Reply zero-copy; arrays of the state that the send reads are lent until it completes."""
        self.traffic.bytes_out += sum(len(memoryview(f)) for f in frames)
        try:
            tracker = self._sock.send_multipart([identity, *frames], copy=False, track=bool(lent))
        except zmq.ZMQError as exc:  # ROUTER_MANDATORY: the peer is gone; nothing to answer
            self.log(f"[shard {self.settings.shard}] reply dropped, peer unreachable: {exc}")
            return
        for key, arr in (lent or {}).items():
            if self.state.weights.get(key) is arr:
                self.state.lend(key, lambda tracker=tracker: tracker.done)


def frame_property(frame: zmq.Frame, name: str) -> str:
    """A ZeroMQ message property ("User-Id", "Peer-Address"), "" when the connection has none."""
    try:
        return frame.get(name)
    except zmq.ZMQError:
        return ""


def meta_clocks(state: ShardState) -> list[int]:
    return [state.c_local(v) for v in range(state.num_vws or 0)]


def threading_main() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()
