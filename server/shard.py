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

This module holds the loop, the sending and the table lookup; the parts live beside it: handlers.py (each
request type's answer, REQUEST_HANDLERS), pulls.py (parked pulls), admission.py (the checks a request
passes), liveness.py (heartbeats, eviction, rejoin), recovery.py (restore at start, checkpoints, keep_from).
"""

from __future__ import annotations

import signal
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import zmq

from hetpipe.core.protocol import wire
from hetpipe.core.protocol.access import RefusalLog
from hetpipe.core.protocol.keys import ServerKeys
from hetpipe.core.wsp.aggregation import DEFAULT_AGGREGATION, Aggregation, OptimizerSettings, get_aggregation
from hetpipe.core.wsp.freezing import FreezeSchedule
from hetpipe.core.wsp.state import ShardState, WspError
from hetpipe.server.admission import check_access
from hetpipe.server.doors import Doors, connection_cap, open_files, raise_fd_limit
from hetpipe.server.guard import CurveGate
from hetpipe.server.handlers import REQUEST_HANDLERS, STAGE_REQUESTS
from hetpipe.server.liveness import (
    check_checkpoints,
    check_heartbeats,
    evict_vw,
    fresh_beats,
    require_evict_policy,
)
from hetpipe.server.pulls import Parked, answer_opened_pulls
from hetpipe.server.recovery import ShardCheckpoints, local_clocks

__all__ = ["ShardServer", "ShardSettings"]

REQUEST_TYPES = tuple(REQUEST_HANDLERS)  # the requests a shard answers; the rest are replies


@dataclass(frozen=True)
class ShardSettings:
    """What one shard runs by: hetpipe.server.jobs.shard_settings derives it from a ShardJob's config in the
    shard's own process (tests and benchmarks may build a bare one)."""

    run: str
    shard: int
    endpoint: str  # tcp://host:port to bind
    staleness: int
    pull_mode: str = "exact"
    checkpoint_dir: Path | None = None  # None: no checkpoints
    checkpoint_every: int = 0  # clocks between checkpoints; 0: only on SIGTERM
    checkpoint_keep: int = 3
    aggregation: str = DEFAULT_AGGREGATION  # the rule's name (hetpipe.core.wsp.aggregation)
    optimizer: OptimizerSettings = OptimizerSettings()  # [train]'s, for a rule whose optimizer runs at the PS

    keys: ServerKeys | None = None  # None: no authentication (auth = "none")
    on_vw_failure: str = "stop"  # a stage silent for hung_after_s: "stop" the run | "evict" its VW
    hung_after_s: float = 0.0  # 0: no heartbeat checks
    # start from this clock's checkpoint, cut back to it (hetpipe train --resume)
    resume_clock: int | None = None
    # pulled weights on the wire: float32 | bfloat16 (pushes come as their sender chose)
    wire_dtype: str = "float32"
    freeze: tuple[tuple[int, int], ...] = ()  # [train] freeze: its parameters leave the wire (docs/wsp.md)
    autofreeze: int = 0  # [train] autofreeze's interval: the layers' movement is recorded (0: off)

    @property
    def freeze_schedule(self) -> FreezeSchedule:
        return FreezeSchedule.at(self.freeze)

    @property
    def recoverable(self) -> bool:
        """Checkpoints come every few clocks, so a crash of this shard can be recovered from."""
        return self.checkpoint_dir is not None and self.checkpoint_every > 0

    def make_aggregation(self) -> Aggregation:
        """The rule this shard folds by, with its own state (a PS-side optimizer's)."""
        return get_aggregation(self.aggregation)(self.optimizer)


@dataclass
class Traffic:
    """Counters for the status line, reset at every clock."""

    bytes_in: int = 0
    bytes_out: int = 0
    pull_wait_s: float = 0.0


class ShardServer:
    """Serves one shard until stopped; `serve()` returns after a SIGTERM checkpoint or `stop()`. The handlers
    of the requests (hetpipe.server.handlers) and its parts read and change its state through it."""

    def __init__(self, settings: ShardSettings, log: Callable[[str], None] | None = None) -> None:
        self.settings = settings
        self.log = log or (lambda line: print(line, file=sys.stderr, flush=True))
        self.state = ShardState(
            settings.staleness,
            settings.pull_mode,
            settings.make_aggregation(),
            settings.freeze_schedule,
            settings.autofreeze,
        )
        self.handlers = REQUEST_HANDLERS  # request type -> handler (a node relay answers with its own)
        self.identities: dict[tuple[int, int], bytes] = {}
        self.evicted_identities: dict[bytes, int] = {}  # connections of stages whose VW was evicted -> the VW
        self.parked: dict[tuple[int, int], Parked] = {}  # (vw, stage) -> its one pull waiting for the gate
        self.refusals = RefusalLog()
        self.gate: CurveGate | None = None
        self.doors: Doors | None = None
        self.traffic = Traffic()
        self.beats: dict[tuple[int, int], tuple[float, int]] = {}  # (vw, stage) -> (last heartbeat, progress)
        self.failed: str | None = None  # why the run stopped (on_vw_failure = "stop")
        self._stopping = False
        self._sock: zmq.Socket | None = None
        self.checkpoints = ShardCheckpoints(settings, self.say)
        restored = self.checkpoints.restore()
        if restored is not None:
            self.state = restored
            self.beats = fresh_beats(restored)
        self.checkpoints.start_writer()

    def say(self, line: str) -> None:
        """Log one line as this shard."""
        self.log(f"[shard {self.settings.shard}] {line}")

    # ---- lifecycle --------------------------------------------------------------------------------
    def stop(self) -> None:
        """Make serve() return after the request in hand (safe from a signal handler)."""
        self._stopping = True

    def serve(self, ready: Callable[[int], None] | None = None) -> None:
        """Bind, then handle requests until stop() or SIGTERM (which checkpoints first)."""
        soft_limit, _ = raise_fd_limit()  # connections are capped well below it (server/doors.py)
        ctx = zmq.Context()
        if self.settings.keys is not None:
            self.gate = CurveGate(ctx, self.settings.keys)
        sock = self._sock = ctx.socket(zmq.ROUTER)
        wire.configure_socket(sock, router=True)
        if self.gate is not None:
            self.gate.secure(sock)
        self.doors = Doors(sock, connection_cap(soft_limit, open_files()), self.refusals, self.say)
        if self.gate is not None:
            self.gate.doors = self.doors
        port = self._bind(sock)
        if threading_main():
            signal.signal(signal.SIGTERM, lambda *_: self.stop())
            signal.signal(signal.SIGINT, lambda *_: self.stop())
        auth = "none" if self.gate is None else f"curve, {len(self.settings.keys.clients)} client keys"
        self.say(
            f"run {self.settings.run!r} listening on port {port} "
            f"(D={self.settings.staleness}, pull={self.settings.pull_mode}, auth={auth})"
        )
        if ready:
            ready(port)
        try:
            self._loop(sock)
        finally:
            if self.settings.checkpoint_dir is not None and self.state.stage_keys:
                self.checkpoint(reason="stop")
            self.checkpoints.close()
            self.doors.close()
            if self.gate is not None:
                self.gate.close()
            sock.close(linger=0)
            ctx.term()

    def _loop(self, sock: zmq.Socket) -> None:
        """Poll the ROUTER (and the CURVE gate's sockets), check heartbeats, handle requests until stop()."""
        poller = zmq.Poller()
        for watched in (sock, self.doors.monitor, *([self.gate.zap] if self.gate else [])):
            poller.register(watched, zmq.POLLIN)
        while not self._stopping:
            events = dict(poller.poll(100))
            now = time.monotonic()
            self._check_heartbeats(now)
            check_checkpoints(self)
            self.doors.tick(now)
            if not events:
                continue
            if self.doors.monitor in events:
                self.doors.handle()
            if self.gate is not None and self.gate.zap in events:
                self.gate.handle()
            self._drain(sock)

    def _drain(self, sock: zmq.Socket) -> None:
        """Handle the requests waiting on the ROUTER, a burst at most, then look at the stop flag again."""
        for _ in range(64):
            try:
                frames = sock.recv_multipart(copy=False, flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            self._handle(frames)

    def _bind(self, sock: zmq.Socket) -> int:
        """Bind the endpoint (port 0: any free one) and return the port."""
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
        return self.checkpoints.write(self.state, reason, background)

    # ---- requests ---------------------------------------------------------------------------------
    def _handle(self, frames: list[zmq.Frame]) -> None:
        """Decode, check and answer one request; every refusal, and every bug, is answered too."""
        identity, body = frames[0].bytes, frames[1:]
        self.traffic.bytes_in += sum(len(f.buffer) for f in body)
        request_id: int | None = None
        try:
            if not body:
                raise wire.WireError("bad_message", "empty message")
            msg = wire.decode(body)
            request_id = msg.fields["id"]
            handler = self.handlers.get(msg.type)
            if handler is None:
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
                check_access(body[0], msg, self.refusals, self.say)
            if self.failed is not None and msg.type in STAGE_REQUESTS:
                raise WspError("vw_failed", self.failed)
            handler(self, identity, msg)
        except (wire.WireError, WspError) as exc:
            if request_id is None:  # decode could not finish; it kept the id if the header had one
                request_id = getattr(exc, "request_id", None)
            self.send(identity, wire.error_frames(request_id, exc.code, str(exc)))
        except Exception as exc:  # a bug must not take the shard down; say so loudly and go on
            self.say(f"internal error: {exc}\n{traceback.format_exc()}")
            self.send(identity, wire.error_frames(request_id, "internal", f"internal error: {exc}"))

    def ckpt_from(self) -> int:
        """The oldest checkpoint's clock on disk (0: none): stages keep their snapshots from there."""
        return self.checkpoints.oldest

    def keep_from(self, sid: tuple[int, int]) -> int:
        """The first wave of this stage whose push the client must keep: the shard may lose it in a crash."""
        return self.checkpoints.keep_from(self.state, sid)

    def status_info(self) -> dict[str, Any]:
        """The state's status with the shard's own: parked pulls, checkpoints, heartbeats, what is durable."""
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
            last_checkpoint=self.checkpoints.last_clock,
            failed=self.failed,
            heartbeat_age_s={
                f"{v}/{st}": round(now - t, 1) for (v, st), (t, _) in sorted(self.beats.items())
            },
            # live stages with pushes a crash would lose: their clients keep them and wait, so the PS must
            # serve on
            not_durable=[
                f"{v}/{st}"
                for (v, st) in sorted(self.state.pushed)
                if v in live and self.keep_from((v, st)) < self.state.pushed[(v, st)]
            ],
            progress={f"{v}/{st}": n for (v, st), (_, n) in sorted(self.beats.items())},
            connections=len(self.doors.table.peers) if self.doors else 0,
            **(self.checkpoints.writer.health.info() if self.checkpoints.writer else {}),
        )
        return info

    # ---- liveness ---------------------------------------------------------------------------------
    def evict(self, vw: int, why: str) -> int:
        """Take VW `vw` out of the live set (its half waves dropped), answer its parked pulls, forget its
        connections; checkpointed before anyone hears of it. Returns the wave boundary it left at."""
        return evict_vw(self, vw, why)

    def _check_heartbeats(self, now: float) -> None:
        """A registered stage of a live VW that has not finished and sent nothing for hung_after_s fails its
        VW."""
        check_heartbeats(self, now)

    def _evict_policy(self, what: str) -> None:
        """Refuse `what` (an evict or a rejoin) unless on_vw_failure = "evict"."""
        require_evict_policy(self.settings, what)

    # ---- clocks -----------------------------------------------------------------------------------
    def clock_advanced(self) -> None:
        """c_global moved: answer the pulls it opened, log the status line, checkpoint when one is due."""
        answer_opened_pulls(self)
        self._status_line()
        reason = self.checkpoints.due(self.state.c_global, self.state.num_waves)
        if reason is not None:
            self.checkpoint(reason=reason, background=True)

    def _status_line(self) -> None:
        """Log the clock, every VW's c_local and the traffic since the last clock; reset the counters."""
        t = self.traffic
        self.say(
            f"clock {self.state.c_global}  c_local {local_clocks(self.state)}  "
            f"in {t.bytes_in / 1e6:.1f} MB  out {t.bytes_out / 1e6:.1f} MB  "
            f"pulls waited {t.pull_wait_s:.2f} s"
        )
        self.traffic = Traffic()

    # ---- sending ----------------------------------------------------------------------------------
    def send(self, identity: bytes, frames: list, lent: dict[str, np.ndarray] | None = None) -> None:
        """Reply zero-copy; arrays of the state that the send reads are lent until it completes."""
        self.traffic.bytes_out += sum(len(memoryview(f)) for f in frames)
        try:
            tracker = self._sock.send_multipart([identity, *frames], copy=False, track=bool(lent))
        except zmq.ZMQError as exc:  # ROUTER_MANDATORY: the peer is gone; nothing to answer
            self.say(f"reply dropped, peer unreachable: {exc}")
            return
        for key, arr in (lent or {}).items():
            if self.state.weights.get(key) is arr:
                self.state.lend(key, lambda tracker=tracker: tracker.done)


def threading_main() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()
