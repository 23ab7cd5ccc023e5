"""One stage's PS traffic in a background thread, so that pushes and pulls overlap compute.

The stage thread hands over a push (the host arrays of a wave and a function that blocks until they hold
the values) or a pull, and gets a Future back; the agent thread owns the PSClient's sockets from then on,
sends each request as it comes, keeps several in flight, and completes the futures as replies arrive. It is
woken by an inproc socket, so a new job never waits for a poll timeout.

Pushes and pulls go out in the order they are handed over; a stage hands over the pull of wave c only after
its own pushes of waves <= c - D - 2 (hetpipe.worker.stage), which is what keeps this free of deadlock.

The agent also sends the stage's heartbeats (every `heartbeat_s`, with how many actions the stage has run);
when the PS says the VW was evicted or the run failed, or pushes were lost for good, `on_fatal` hears of it
from this thread (the stage thread may be blocked on a neighbour that will never answer).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field

import numpy as np
import zmq

from hetpipe.core.runs.metrics import TraceRecorder
from hetpipe.worker.ps_client import Call, PSClient, pulled_of

__all__ = ["PSAgent", "PushDone"]

_POLL_MS = 50


@dataclass(frozen=True)
class PushDone:
    wave: int
    c_global: int
    seconds: float  # from handing it over to the last acknowledgement


@dataclass
class _Job:
    kind: str  # "push" | "pull"
    wave: int
    future: Future
    tensors: Mapping[str, np.ndarray] | None = None
    ready: Callable[[], None] | None = None
    reused: bool = False  # the push's arrays are reused by the stage once it is acknowledged
    call: Call | None = None
    handed: float = field(default_factory=time.monotonic)
    sent: float = 0.0
    sent_wall: float = 0.0


class PSAgent:
    """Runs PSClient requests for one stage in a thread; push() and pull() return futures."""

    def __init__(
        self,
        client: PSClient,
        pull_into: Mapping[str, np.ndarray] | None = None,
        trace: TraceRecorder | None = None,
        trace_tid: int = 0,
        heartbeat_s: float = 0.0,
        progress: Callable[[], int] | None = None,
        on_fatal: Callable[[BaseException], None] | None = None,
        pull_into_free: Callable[[], None] | None = None,
        stage_alive: Callable[[], bool] = lambda: True,
        after_replies: Callable[[], None] = lambda: None,
    ) -> None:
        """`pull_into_free()` blocks until `pull_into` may be overwritten (the stage's last read of it is
        done). `stage_alive()` false withholds the heartbeats: an agent in a process of its own beats for a
        stage that is stopped or gone only while it says so, or the PS could not see the stage hang.
        `after_replies()` runs in the agent thread after each turn of its loop (an agent process publishes
        there what the replies said)."""
        self.client = client
        self.pull_into, self.pull_into_free = pull_into, pull_into_free
        self.trace, self.trace_tid = trace, trace_tid
        self.heartbeat_s, self.progress, self.on_fatal = heartbeat_s, progress or (lambda: 0), on_fatal
        self._next_beat = 0.0
        self.stage_alive, self.after_replies = stage_alive, after_replies
        self._jobs: deque[_Job] = deque()
        self._active: list[_Job] = []
        self._stopping = False
        self._failed: BaseException | None = None
        address = f"inproc://ps-agent-{id(self)}"
        self._wake_rx = client.context.socket(zmq.PAIR)
        self._wake_rx.bind(address)
        self._wake_tx = client.context.socket(zmq.PAIR)
        self._wake_tx.connect(address)
        self._lock = threading.Lock()  # guards _wake_tx (push/pull may come from the stage thread only)
        self.push_s = self.pull_s = self.parked_s = 0.0
        self._thread = threading.Thread(target=self._run, name="ps-agent", daemon=True)
        self._thread.start()

    # ---- the stage thread's side --------------------------------------------------------------------
    def push(
        self,
        wave: int,
        tensors: Mapping[str, np.ndarray],
        ready: Callable[[], None] | None = None,
        reused: bool = False,
    ) -> Future:
        """Push `tensors` as wave `wave` once ready() returns; the future gives a PushDone. `reused`: the
        stage writes into the arrays again once the future is done (they are copied if the client must keep
        them)."""
        return self._hand_over(_Job("push", wave, Future(), tensors, ready, reused))

    def pull(self, wave: int) -> Future:
        """Pull the weights for the gate of `wave`; the future gives a Pulled (copied into pull_into)."""
        return self._hand_over(_Job("pull", wave, Future()))

    def _hand_over(self, job: _Job) -> Future:
        if self._failed is not None:
            raise self._failed
        if self._stopping:
            raise RuntimeError("the PS agent is closed")
        self._jobs.append(job)
        self._wake()
        return job.future

    def _wake(self) -> None:
        with self._lock, contextlib.suppress(zmq.Again):  # zmq.Again: a wake-up is already queued
            self._wake_tx.send(b"", zmq.NOBLOCK)

    def close(self, timeout_s: float | None = None) -> None:
        """Let every job handed over finish, then stop the thread (its sockets stay with the client)."""
        self._stopping = True
        self._wake()
        self._thread.join(timeout_s)
        self._wake_tx.close(linger=0)
        self._wake_rx.close(linger=0)

    # ---- the agent thread -------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not (self._stopping and not self._jobs and not self._active):
                woken = self.client.poll(_POLL_MS, extra=[self._wake_rx])
                if woken:
                    while True:
                        try:
                            self._wake_rx.recv(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                while self._jobs:
                    self._send(self._jobs.popleft())
                self._complete()
                self._beat()
                self.after_replies()
        except BaseException as exc:  # the stage thread must hear of it through every future
            self._failed = exc
            for job in [*self._active, *self._jobs]:
                if not job.future.done():
                    job.future.set_exception(exc)
            self._active.clear()
            self._jobs.clear()
            if self.on_fatal is not None:
                self.on_fatal(exc)

    def _beat(self) -> None:
        if self.heartbeat_s <= 0 or self._stopping:
            return
        now = time.monotonic()
        if now >= self._next_beat and self.stage_alive():
            self._next_beat = now + self.heartbeat_s
            self.client.send_heartbeat(self.progress())

    def _send(self, job: _Job) -> None:
        try:
            if job.kind == "push":
                if job.ready is not None:
                    job.ready()
                job.call = self.client.send_push(job.wave, job.tensors or {}, reused=job.reused)
            else:
                job.call = self.client.send_pull(job.wave)
        except Exception as exc:
            job.future.set_exception(exc)
            return
        job.sent, job.sent_wall = time.monotonic(), time.time()
        self._active.append(job)

    def _complete(self) -> None:
        still = []
        for job in self._active:
            call = job.call
            assert call is not None
            if not call.done:
                still.append(job)
                continue
            now = time.monotonic()
            try:
                replies = call.result()
                if job.kind == "push":
                    self.push_s += now - job.sent
                    self._span(f"PUSH{job.wave}", job, now)
                    result: object = PushDone(
                        job.wave, min(r.fields["c_global"] for r in replies), now - job.handed
                    )
                else:
                    if self.pull_into_free is not None:
                        self.pull_into_free()
                    pulled = self.client.took(pulled_of(replies, self.pull_into))
                    self.parked_s += pulled.parked_s
                    self.pull_s += max(0.0, now - job.sent - pulled.parked_s)
                    self._span(f"PULL{job.wave}", job, now, parked_s=round(pulled.parked_s, 4))
                    result = pulled
            except Exception as exc:
                job.future.set_exception(exc)
                continue
            job.future.set_result(result)
        self._active = still

    def _span(self, name: str, job: _Job, now: float, **args: object) -> None:
        if self.trace is not None:
            self.trace.add(name, job.sent_wall * 1e6, (now - job.sent) * 1e6, tid=self.trace_tid, **args)
