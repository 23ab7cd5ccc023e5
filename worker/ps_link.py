"""A stage's link to the PS: its agent in a thread of the stage process, or in a process of its own.

Both give the stage the same calls, declared by PSLink: register, push, pull (futures), close, wait_durable,
shutdown, a progress cell the heartbeats report, and the agent's time totals. `[ps] agent` picks one ("auto":
a process for a CUDA stage, whose throughput is its one thread's issuing speed, which an agent thread's GIL
use cuts; a thread for a CPU stage, whose arrays then go out zero-copy; docs/architecture.md#the-ps-path).
"""

from __future__ import annotations

import contextlib
import queue
import subprocess
import sys
import threading
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, Protocol

import numpy as np
import torch

from hetpipe.core.errors import HetpipeError
from hetpipe.core.runs.metrics import TraceRecorder
from hetpipe.worker.agent_pipe import PipeWriter, read_message
from hetpipe.worker.flat_layout import FlatLayout
from hetpipe.worker.ps_agent import PSAgent, PushDone
from hetpipe.worker.ps_client import ClientSpec, PSError, PSTimeout, Pulled
from hetpipe.worker.shared_host import SharedHost

__all__ = ["PSLink", "ProcessLink", "ThreadLink", "agent_kind", "open_link"]


class PSLink(Protocol):
    """What a stage uses of its link to the PS agent (ThreadLink, ProcessLink; tests/test_ps_link.py checks
    that both have every member, with these signatures)."""

    @property
    def push_slots(self) -> list[torch.Tensor] | None:
        """The host buffers pushes are staged in, used in turn (None: the stage stages them its own way)."""
        ...

    @property
    def pull_host(self) -> torch.Tensor | None:
        """The host buffer pulls land in (None: the stage's own)."""
        ...

    @property
    def progress(self) -> np.ndarray:
        """One int64 cell the stage writes how many of its actions it has run into (the heartbeats say it)."""
        ...

    @property
    def totals(self) -> tuple[float, float, float]:
        """Seconds of the agent: pushes in flight, pulls' round trips less parking, parked at the PS."""
        ...

    def checkpoint_floor(self) -> int:
        """The clock of the oldest checkpoint any PS shard keeps on disk (0: none yet), as last heard."""
        ...

    def register(
        self,
        values: Mapping[str, torch.Tensor],
        kinds: Mapping[str, str],
        num_waves: int,
        start_wave: int,
        pulls: bool,
    ) -> dict[str, np.ndarray]:
        """Declare the stage's keys with their initial values and kinds; returns the PS's W_0 of them."""
        ...

    def start(
        self, pull_into: Mapping[str, np.ndarray] | None, pull_into_free: Callable[[], None] | None
    ) -> None:
        """Start the agent: pulls are copied into `pull_into`, once `pull_into_free()` returns."""
        ...

    def push(
        self, wave: int, slot: int, arrays: Mapping[str, np.ndarray], ready: Callable[[], None], reused: bool
    ) -> Future:
        """Hand over the push of `wave` (staged in push slot `slot`, or `arrays`), to go once `ready()`
        returns; the future completes with the last shard's acknowledgement (PushDone)."""
        ...

    def pull(self, wave: int) -> Future:
        """Hand over the pull of `wave`; the future completes with the weights (Pulled) once its gate
        opens."""
        ...

    def close(self, timeout_s: float) -> None:
        """Let every push and pull handed over finish, then stop the agent."""
        ...

    def wait_durable(self, timeout_s: float, progress: int) -> bool:
        """Block until every shard has the stage's pushes in a checkpoint; False after `timeout_s`."""
        ...

    def shutdown(self) -> None:
        """Release the link: its client's sockets, or the agent process and the shared buffers."""
        ...


def agent_kind(setting: str, device: torch.device) -> str:
    """thread or process, for `[ps] agent` = `setting` on a stage computing on `device`."""
    if setting == "auto":
        return "process" if device.type == "cuda" else "thread"
    return setting


class ThreadLink:
    """The agent as a thread of the stage process (PSAgent), its PSClient used directly to register."""

    push_slots: list[torch.Tensor] | None = None  # the stage stages pushes its own way (pinned, or zero-copy)
    pull_host: torch.Tensor | None = None
    progress: np.ndarray  # the actions the stage has run, for the heartbeats (PSAgent reads it)

    def __init__(
        self,
        spec: ClientSpec,
        trace: TraceRecorder,
        trace_tid: int,
        heartbeat_s: float,
        on_fatal: Callable[[BaseException], None],
    ) -> None:
        self.client = spec.client()
        self.trace, self.trace_tid, self.heartbeat_s, self.on_fatal = trace, trace_tid, heartbeat_s, on_fatal
        self.progress = np.zeros(1, np.int64)
        self.agent: PSAgent | None = None

    def checkpoint_floor(self) -> int:
        return self.client.checkpoint_floor

    def register(
        self,
        values: Mapping[str, torch.Tensor],
        kinds: Mapping[str, str],
        num_waves: int,
        start_wave: int,
        pulls: bool,
    ) -> dict[str, np.ndarray]:
        """Declare the stage's keys and initial values; returns the PS's W_0 of them (PSClient.register)."""
        mine = {k: t.detach().float().cpu().numpy() for k, t in values.items()}
        return self.client.register(mine, kinds=kinds, num_waves=num_waves, start_wave=start_wave)

    def start(
        self, pull_into: Mapping[str, np.ndarray] | None, pull_into_free: Callable[[], None] | None
    ) -> None:
        self.agent = PSAgent(
            self.client,
            pull_into,
            self.trace,
            self.trace_tid,
            heartbeat_s=self.heartbeat_s,
            progress=lambda: int(self.progress[0]),
            on_fatal=self.on_fatal,
            pull_into_free=pull_into_free,
        )

    def push(
        self, wave: int, slot: int, arrays: Mapping[str, np.ndarray], ready: Callable[[], None], reused: bool
    ) -> Future:
        assert self.agent is not None
        return self.agent.push(wave, arrays, ready, reused=reused)

    def pull(self, wave: int) -> Future:
        assert self.agent is not None
        return self.agent.pull(wave)

    def close(self, timeout_s: float) -> None:
        if self.agent is not None:
            self.agent.close(timeout_s=timeout_s)

    def wait_durable(self, timeout_s: float, progress: int) -> bool:
        return self.client.wait_durable(timeout_s, progress=progress)

    def shutdown(self) -> None:
        self.client.close()

    @property
    def totals(self) -> tuple[float, float, float]:
        """Seconds of the agent: pushes in flight, pulls' round trips less parking, parked at the PS."""
        a = self.agent
        return (a.push_s, a.pull_s, a.parked_s) if a is not None else (0.0, 0.0, 0.0)


_ERRORS: dict[str, Callable[[str, str], HetpipeError]] = {
    "PSError": lambda code, message: PSError(code, message),
    "PSTimeout": lambda code, message: PSTimeout(message),
}


def _error(error: Mapping[str, str]) -> HetpipeError:
    make = _ERRORS.get(error["type"])
    if make is not None:
        return make(error["code"], error["message"])
    return HetpipeError(f"the PS agent process failed: {error['type']}: {error['message']}")


class ProcessLink:
    """The agent as a process of its own (worker/agent_process.py): the stage's side.

    Requests go to it in the order they are made, from one sender thread that first waits, for a push, until
    its device-to-host copy has landed, and for a pull, until the pull buffer's last host-to-device copy has
    left it; a reader thread completes the futures from the replies and records the agent's trace spans."""

    push_slots: list[torch.Tensor]  # the two push slots of the shared file
    pull_host: torch.Tensor | None  # its pull buffer (None once shut down)
    progress: np.ndarray  # its heartbeat cell, which the agent process reads

    def __init__(
        self,
        spec: ClientSpec,
        layout: FlatLayout,
        device: torch.device,
        trace: TraceRecorder,
        trace_tid: int,
        heartbeat_s: float,
        on_fatal: Callable[[BaseException], None],
        name: str,
    ) -> None:
        self.layout, self.trace, self.trace_tid, self.on_fatal = layout, trace, trace_tid, on_fatal
        self.shared = SharedHost.create(layout.numel, name)
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "hetpipe.worker.agent_process"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
            )
            assert self.proc.stdin is not None and self.proc.stdout is not None
            self._out, self._in = PipeWriter(self.proc.stdin), self.proc.stdout
            self._out.send(
                "setup",
                client=spec.fields(),
                path=str(self.shared.path),
                numel=layout.numel,
                keys=list(layout.keys),
                shapes=[list(s) for s in layout.shapes],
                heartbeat_s=heartbeat_s,
            )
            ready = read_message(self._in)
        finally:
            self.shared.unlink()  # mapped by both (or the agent is gone): nothing is left behind either way
        if ready is None or ready["op"] != "ready":
            code = self.proc.wait(timeout=30)
            raise HetpipeError(
                f"the PS agent process of vw {spec.vw} stage {spec.stage} ended at start (exit code "
                f'{code}): its error is above in this log; `[ps] agent = "thread"` runs it in the stage'
            )
        if device.type == "cuda":
            self.shared.pin()
        self.push_slots = [torch.from_numpy(a) for a in self.shared.slots]
        self.pull_host = torch.from_numpy(self.shared.pull)
        self.progress = self.shared.progress
        self._floor = self.shared.checkpoint_floor
        self._pull_free: Callable[[], None] = lambda: None
        self._ids = iter(range(1 << 62))
        self._open: dict[int, tuple[Future, str, int]] = {}  # id -> (future, op, wave)
        self._lock = threading.Lock()
        self._broken: HetpipeError | None = None
        self._outbox: queue.SimpleQueue[tuple[Callable[[], None] | None, str, dict[str, Any]] | None] = (
            queue.SimpleQueue()
        )
        self._totals = (0.0, 0.0, 0.0)
        self._sender = threading.Thread(target=self._send_loop, name="ps-link-send", daemon=True)
        self._reader = threading.Thread(target=self._read_loop, name="ps-link-read", daemon=True)
        self._sender.start()
        self._reader.start()

    # ---- requests ---------------------------------------------------------------------------------------
    def _request(
        self, op: str, wait: Callable[[], None] | None = None, wave: int = -1, **fields: Any
    ) -> Future:
        future: Future = Future()
        with self._lock:
            if self._broken is not None:
                raise self._broken
            job = next(self._ids)
            self._open[job] = (future, op, wave)
        self._outbox.put((wait, op, {"id": job, **({"wave": wave} if wave >= 0 else {}), **fields}))
        return future

    def _call(self, op: str, wait_s: float | None = None, **fields: Any) -> dict[str, Any]:
        try:
            return self._request(op, **fields).result(timeout=wait_s)
        except FutureTimeout:
            raise HetpipeError(
                f"the PS agent process (pid {self.proc.pid}) did not answer its {op} within "
                f"{wait_s:.0f} s; its log lines are in this stage's log"
            ) from None

    def register(
        self,
        values: Mapping[str, torch.Tensor],
        kinds: Mapping[str, str],
        num_waves: int,
        start_wave: int,
        pulls: bool,
    ) -> dict[str, np.ndarray]:
        """The values go over in push slot 0, W_0 comes back in the pull buffer (views of it are returned)."""
        if self.layout.keys:  # a stage whose layers are all frozen from its start has none on the wire
            with torch.no_grad():
                flat = torch.cat([values[k].detach().float().reshape(-1) for k in self.layout.keys]).cpu()
            self.push_slots[0].copy_(flat)
        keys = self._call(
            "register", kinds=dict(kinds), num_waves=num_waves, start_wave=start_wave, pulls=pulls
        )["keys"]
        views = self.layout.array_views(self.shared.pull)
        return {k: views[k] for k in keys}

    def start(
        self, pull_into: Mapping[str, np.ndarray] | None, pull_into_free: Callable[[], None] | None
    ) -> None:
        """Pulls land in the shared pull buffer (pull_into is the stage's view of it); `pull_into_free` blocks
        until the stage's last copy out of it has left."""
        self._pull_free = pull_into_free or (lambda: None)

    def push(
        self, wave: int, slot: int, arrays: Mapping[str, np.ndarray], ready: Callable[[], None], reused: bool
    ) -> Future:
        return self._request("push", ready, wave, slot=slot)

    def pull(self, wave: int) -> Future:
        return self._request("pull", self._pull_free, wave)

    def close(self, timeout_s: float) -> None:
        reply = self._call("close", timeout_s + 10, timeout_s=timeout_s)
        self._totals = (reply["push_s"], reply["pull_s"], reply["parked_s"])

    def wait_durable(self, timeout_s: float, progress: int) -> bool:
        return bool(self._call("durable", timeout_s + 10, timeout_s=timeout_s, progress=progress)["ok"])

    def shutdown(self) -> None:
        """End the agent process and release the shared buffers."""
        try:
            if self._broken is None:
                self._call("exit", 30)
        except HetpipeError:
            pass
        finally:
            self._outbox.put(None)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self._reader.join(timeout=5)
            self.push_slots, self.pull_host = [], None
            self.shared.close()

    @property
    def totals(self) -> tuple[float, float, float]:
        return self._totals

    def checkpoint_floor(self) -> int:
        return int(self._floor[0])

    # ---- threads ------------------------------------------------------------------------------------------
    def _send_loop(self) -> None:
        while (item := self._outbox.get()) is not None:
            wait, op, fields = item
            try:
                if wait is not None:
                    wait()
            except Exception as exc:  # this request's own wait failed (a device copy): only it fails
                self._fail(
                    fields["id"],
                    exc
                    if isinstance(exc, HetpipeError)
                    else HetpipeError(
                        f"the {op} could not be handed to the PS agent: {type(exc).__name__}: {exc}"
                    ),
                )
                continue
            try:
                self._out.send(op, **fields)
            except (OSError, ValueError):  # the pipe is gone: so is the agent process
                self._break()
        with contextlib.suppress(OSError):
            self.proc.stdin.close()  # type: ignore[union-attr]

    def _fail(self, job: int, exc: BaseException) -> None:
        with self._lock:
            entry = self._open.pop(job, None)
        if entry is not None:
            entry[0].set_exception(exc)

    def _break(self) -> None:
        """The agent process is gone: every open request fails, and every later one raises at once."""
        code = self.proc.poll()
        broken = HetpipeError(
            f"the PS agent process ended{f' (exit code {code})' if code else ''} with requests "
            "open: its error is above in this stage's log"
        )
        with self._lock:
            if self._broken is None:
                self._broken = broken
            still, self._open = list(self._open.values()), {}
        for future, _, _ in still:
            future.set_exception(self._broken)

    def _read_loop(self) -> None:
        try:
            while (msg := read_message(self._in)) is not None:
                op = msg["op"]
                if op == "span":
                    self.trace.add(msg["name"], msg["ts"], msg["dur"], tid=self.trace_tid, **msg["args"])
                elif op == "fatal":
                    self.on_fatal(_error(msg["error"]))
                elif op == "failed":
                    self._fail(msg["id"], _error(msg["error"]))
                else:
                    with self._lock:
                        entry = self._open.pop(msg["id"], None)
                    if entry is not None:  # None: its caller gave up waiting (a timed-out call)
                        future, kind, wave = entry
                        future.set_result(self._result(kind, wave, msg))
        except Exception as exc:  # a garbled pipe: the same as the process ending
            print(
                f"hetpipe: reading the PS agent's pipe failed: {type(exc).__name__}: {exc}", file=sys.stderr
            )
        self.proc.wait()
        self._break()

    @staticmethod
    def _result(kind: str, wave: int, msg: Mapping[str, Any]) -> Any:
        if kind == "push":
            return PushDone(wave, msg["c_global"], msg["seconds"])
        if kind == "pull":
            gaps = [list(g) for g in msg["gaps"]]
            return Pulled(msg["version"], msg["own_through"], {}, msg["parked_s"], gaps, msg["movement"])
        return msg


def open_link(
    kind: str,
    spec: ClientSpec,
    layout: FlatLayout,
    device: torch.device,
    trace: TraceRecorder,
    trace_tid: int,
    heartbeat_s: float,
    on_fatal: Callable[[BaseException], None],
    name: str,
) -> PSLink:
    """The link of `kind` (thread or process, agent_kind's answer)."""
    if kind == "process":
        return ProcessLink(spec, layout, device, trace, trace_tid, heartbeat_s, on_fatal, name)
    return ThreadLink(spec, trace, trace_tid, heartbeat_s, on_fatal)
