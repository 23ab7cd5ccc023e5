"""A node's relay for node-local aggregation (docs/wsp.md#node-local-aggregation): a shard to the stages of
its group's VWs (hetpipe.server's loop and handlers), and a client of its upstream shard (hetpipe.worker's),
so it lives in the app layer above both. The group's sum of each wave goes upstream as one push
(registered as the group's first VW, naming the members), and one upstream pull of W_t serves every member
stage's pull of it. The WSP state is hetpipe.core.wsp.relay.RelayState; this module moves the bytes.

The relay keeps no checkpoint: its stages keep their pushes until upstream holds the group's wave in a
checkpoint (the relay's `keep_from` is upstream's), and its own upstream client resends after a restart of
the upstream shard as any stage's does.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import zmq

from hetpipe.core.protocol import wire
from hetpipe.core.wsp.relay import RelayState
from hetpipe.core.wsp.results import WspError
from hetpipe.server.handlers import REQUEST_HANDLERS, admit_registration
from hetpipe.server.pulls import answer_opened_pulls, refuse_parked
from hetpipe.server.shard import ShardServer, ShardSettings
from hetpipe.worker.ps_calls import Call
from hetpipe.worker.ps_client import PSClient, pulled_of

__all__ = ["RelayJob", "RelayServer", "serve_relay"]


@dataclass(frozen=True)
class RelayJob:
    """What one relay process runs by: the shard settings it serves its stages with (no checkpoints), its
    group, and its upstream shard."""

    settings: ShardSettings
    node: str
    members: tuple[int, ...]
    upstream: str  # the upstream shard's endpoint
    num_vws: int
    vw_weights: tuple[int, ...]
    timeout_s: float
    retry_s: float
    heartbeat_s: float
    wire_dtype: str  # of the upstream link (the group's sum packed again: docs/ps-protocol.md)


class RelayServer(ShardServer):
    """Serves one relay until stopped: the shard loop, with the upstream client's replies read in it."""

    def __init__(self, job: RelayJob, log: Callable[[str], None] | None = None) -> None:
        settings = replace(job.settings, checkpoint_dir=None, wire_dtype="float32", pull_mode="exact")
        self.job = job
        super().__init__(settings, log)
        self.state = RelayState(  # type: ignore[assignment]
            job.members, settings.staleness, settings.make_aggregation(), settings.freeze_schedule
        )
        self.handlers = {**REQUEST_HANDLERS, "register": _register, "evict": _refuse, "rejoin": _refuse}
        self.waiting: dict[tuple[int, int], tuple[bytes, int, bool]] = {}  # registrations held back
        self.client: PSClient | None = None
        self.pushes: list[Call] = []
        self.pulls: dict[int, Call] = {}  # wave -> the upstream pull that brings its gate's weights
        self.last_beat = 0.0

    def say(self, line: str) -> None:
        self.log(f"[relay {self.job.node} shard {self.settings.shard}] {line}")

    def _loop(self, sock: zmq.Socket) -> None:
        """The shard's loop, with the upstream client's replies read (and its calls moved on) between
        requests."""
        try:
            self._serve_both(sock)
        finally:
            if self.client is not None:
                self.client.close()

    def _serve_both(self, sock: zmq.Socket) -> None:
        while not self._stopping:
            now = time.monotonic()
            self._check_heartbeats(now)
            self.doors.tick(now)
            if self.client is None:
                ready = [s for s in (sock, self.doors.monitor) if s.poll(50)]
            else:
                ready = self.client.poll(50, extra=[sock, self.doors.monitor])
                self._upstream(now)
            if self.doors.monitor in ready:
                self.doors.handle()
            if sock in ready:
                self._drain(sock)
                if self.client is not None:
                    self._upstream(now)

    # ---- upstream ---------------------------------------------------------------------------------
    def register_upstream(self) -> None:
        """Once every member stage registered: register the group upstream (as its first VW, stage 0),
        take upstream's W_0, and answer the member stages' registrations with it."""
        state: RelayState = self.state  # type: ignore[assignment]
        tensors, kinds = state.group_keys()
        job = self.job
        self.client = PSClient(
            [job.upstream],
            self.settings.run,
            job.members[0],
            0,
            job.num_vws,
            1,
            dict.fromkeys(tensors, 0),
            timeout_s=job.timeout_s,
            retry_s=job.retry_s,
            wire_dtype=job.wire_dtype,
            vw_weights=job.vw_weights,
            members=job.members,
        )
        initial = self.client.register(tensors, kinds=kinds, num_waves=state.num_waves or 0)
        for key, value in initial.items():
            state.registrations.initial[key] = value
        state.caught_up(self.client.recovery.next_wave)  # the group's waves upstream holds already
        self.say(f"registered upstream for vws {list(job.members)} ({len(tensors)} keys)")
        for sid, (identity, request_id, want) in sorted(self.waiting.items()):
            self._registered(identity, request_id, sid, want)
        self.waiting.clear()

    def _registered(self, identity: bytes, request_id: int, sid: tuple[int, int], want: bool) -> None:
        state: RelayState = self.state  # type: ignore[assignment]
        initial = state.registrations.initial
        tensors = {k: initial[k] for k in state.stage_keys[sid]} if want else {}
        fields = {
            "id": request_id,
            "c_global": state.c_global,
            "pushed": state.pushed[sid],
            "keep_from": self.keep_from(sid),
            "ckpt_from": self.ckpt_from(),
        }
        self.send(identity, wire.encode("registered", fields, tensors))

    def _upstream(self, now: float) -> None:
        """Send the group's complete waves, pull the versions parked pulls wait for, take what came back."""
        client, state = self.client, self.state
        assert client is not None and isinstance(state, RelayState)
        if client.fatal is not None:
            self._fail(f"upstream: {client.fatal}")
            return
        for wave, tensors in state.take_outbox():
            self.pushes.append(client.send_push(wave, tensors))
        for call in [c for c in self.pushes if c.done]:
            self.pushes.remove(call)
            try:
                state.upstream_c_global = max(
                    state.upstream_c_global, *(r.fields["c_global"] for r in call.result())
                )
            except Exception as exc:  # noqa: BLE001 - the run cannot go on without the group's wave
                self._fail(f"upstream refused the group's push of wave {call.wave}: {exc}")
                return
        for p in list(self.parked.values()):
            if p.wave not in self.pulls and state.wanted(p.wave):
                self.pulls[p.wave] = client.send_pull(p.wave)
        for wave, call in [(w, c) for w, c in self.pulls.items() if c.done]:
            del self.pulls[wave]
            try:
                pulled = pulled_of(call.result())
            except Exception as exc:  # noqa: BLE001
                self._fail(f"upstream refused the pull of wave {wave}: {exc}")
                return
            state.receive(pulled.version, pulled.tensors, pulled.version)
            answer_opened_pulls(self)
        if now - self.last_beat >= self.job.heartbeat_s:
            self.last_beat = now
            client.send_heartbeat(sum(n for _, n in self.beats.values()))

    def _fail(self, why: str) -> None:
        """Stop the group: every member stage's next request is refused with the reason."""
        if self.failed is None:
            self.failed = why
            self.say(f"stopping the group: {why}")
            refuse_parked(self, "vw_failed", why)

    # ---- what the stages hear -----------------------------------------------------------------------
    def keep_from(self, sid: tuple[int, int]) -> int:
        """A stage keeps its pushes from the first wave upstream does not hold in a checkpoint (the relay
        keeps none)."""
        floor = self.client.keep_from[0] if self.client is not None else 0
        return min(floor, self.state.pushed[sid])

    def ckpt_from(self) -> int:
        return self.client.checkpoint_floor if self.client is not None else 0

    def clock_advanced(self) -> None:
        answer_opened_pulls(self)


def _register(relay: RelayServer, identity: bytes, msg: wire.Message) -> None:
    """`register` at a relay: recorded at once, answered once the group is registered upstream."""
    f = msg.fields
    sid = (f["vw"], f["stage"])
    admit_registration(relay, identity, msg)
    if relay.client is not None:
        relay._registered(identity, f["id"], sid, f["want_weights"])
        return
    relay.waiting[sid] = (identity, f["id"], f["want_weights"])
    if relay.state.registered():  # type: ignore[attr-defined]
        relay.register_upstream()


def _refuse(relay: RelayServer, identity: bytes, msg: wire.Message) -> None:
    raise WspError(
        "bad_message",
        f'{msg.type} goes to the PS, not to a node relay (node aggregation needs on_vw_failure = "stop")',
    )


def serve_relay(job: RelayJob, port_queue=None) -> None:  # type: ignore[no-untyped-def]
    """The child-process entry point of a relay: serve until SIGTERM, putting the port it bound on
    `port_queue`."""
    RelayServer(job).serve(ready=port_queue.put if port_queue is not None else None)
