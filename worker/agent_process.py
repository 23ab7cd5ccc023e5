"""The PS agent process of a stage: its PSClient and PSAgent, away from the stage's interpreter.

A CUDA stage is bound by how fast its one thread issues work, and every torch call it makes lets go of the
GIL; an agent thread in the same process that wants the GIL meanwhile (a push's framing and sends, its
acknowledgements, pyzmq's frame bookkeeping) then takes it at each of those calls, and the stage waits to get
it back, hundreds of times a minibatch (docs/architecture.md#the-ps-path). Here the agent runs in a process
of its own: the stage and it share the push slots and the pull buffer (worker/shared_host.py) and exchange
small control messages over a pipe (worker/agent_pipe.py); no tensor is pickled or copied between them.

Started by worker/ps_link.py as `python -m hetpipe.worker.agent_process`; stdin and stdout are the pipe,
stderr is the stage's log. It ends when the stage says so, when the pipe closes, or when the stage process is
gone.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from concurrent.futures import Future
from typing import Any

import numpy as np

from hetpipe.core.runs.procs import is_stopped
from hetpipe.worker.agent_pipe import PipeWriter, read_message
from hetpipe.worker.flat_layout import FlatLayout
from hetpipe.worker.ps_agent import PSAgent, PushDone
from hetpipe.worker.ps_client import ClientSpec, Pulled
from hetpipe.worker.shared_host import SharedHost

__all__ = ["describe_error", "main"]


def describe_error(exc: BaseException) -> dict[str, str]:
    """An exception as the pipe carries it (the stage raises PSError, PSTimeout or HetpipeError from it)."""
    return {"type": type(exc).__name__, "code": str(getattr(exc, "code", "")), "message": str(exc)}


class _SpanRelay:
    """Stands in for the stage's TraceRecorder: the agent's spans go to the stage, which records them."""

    def __init__(self, out: PipeWriter) -> None:
        self.out = out

    def add(self, name: str, ts_us: float, dur_us: float, tid: int | None = None, **args: Any) -> None:
        self.out.send("span", name=name, ts=ts_us, dur=dur_us, args=args)


def _watch_parent(parent: int) -> None:
    """End this process once the stage that started it is gone (it may be blocked where it cannot read
    EOF)."""
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(0)


def _reply(out: PipeWriter, job: int, future: Future) -> None:
    exc = future.exception()
    if exc is not None:
        out.send("failed", id=job, error=describe_error(exc))
        return
    result = future.result()
    if isinstance(result, PushDone):
        out.send("done", id=job, c_global=result.c_global, seconds=result.seconds)
    else:
        assert isinstance(result, Pulled)
        out.send(
            "done",
            id=job,
            version=result.version,
            own_through=result.own_through,
            parked_s=result.parked_s,
            gaps=result.gaps,
            movement=result.movement,
        )


def serve(stdin: Any, out: PipeWriter) -> int:
    """Run the agent from its setup message to the stage's `exit` (or the pipe's end)."""
    setup = read_message(stdin)
    if setup is None:
        return 0
    stage_pid = os.getppid()  # the stage that started this agent: its heartbeats stop while it is stopped
    shared = SharedHost.attach(setup["path"], setup["numel"])
    layout = FlatLayout(tuple(setup["keys"]), tuple(tuple(s) for s in setup["shapes"]))
    slots = [layout.array_views(slot) for slot in shared.slots]
    pulled_into = layout.array_views(shared.pull)
    client = ClientSpec.of(setup["client"]).client()
    agent: PSAgent | None = None
    out.send("ready")
    try:
        while (msg := read_message(stdin)) is not None:
            op, job = msg["op"], msg.get("id", -1)
            try:
                if op == "register":
                    w0 = client.register(
                        slots[0], kinds=msg["kinds"], num_waves=msg["num_waves"], start_wave=msg["start_wave"]
                    )
                    for key, value in w0.items():
                        np.copyto(pulled_into[key], value.reshape(pulled_into[key].shape), casting="unsafe")
                    agent = PSAgent(
                        client,
                        pulled_into if msg["pulls"] else None,
                        _SpanRelay(out),
                        0,
                        heartbeat_s=setup["heartbeat_s"],
                        progress=lambda: int(shared.progress[0]),
                        on_fatal=lambda exc: out.send("fatal", error=describe_error(exc)),
                        stage_alive=lambda: not is_stopped(stage_pid),
                        after_replies=lambda: shared.checkpoint_floor.__setitem__(0, client.checkpoint_floor),
                    )
                    out.send("done", id=job, keys=sorted(w0))
                elif op in ("push", "pull"):
                    assert agent is not None, "push or pull before register"
                    future = (
                        agent.push(msg["wave"], slots[msg["slot"]], None, reused=True)
                        if op == "push"
                        else agent.pull(msg["wave"])
                    )
                    future.add_done_callback(lambda f, job=job: _reply(out, job, f))
                elif op == "close":
                    totals = (0.0, 0.0, 0.0)
                    if agent is not None:
                        agent.close(timeout_s=msg["timeout_s"])
                        totals, agent = (agent.push_s, agent.pull_s, agent.parked_s), None
                    out.send("done", id=job, push_s=totals[0], pull_s=totals[1], parked_s=totals[2])
                elif op == "durable":
                    out.send(
                        "done", id=job, ok=client.wait_durable(msg["timeout_s"], progress=msg["progress"])
                    )
                elif op == "exit":
                    out.send("done", id=job)
                    break
                else:
                    raise ValueError(f"unknown op {op!r}")
            except Exception as exc:  # the stage's request fails, the agent goes on
                out.send("failed", id=job, error=describe_error(exc))
    finally:
        if agent is not None:
            agent.close(timeout_s=5)
        client.close()
        shared.close()
    return 0


def main() -> int:
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # the pipe carries messages only: a stray print goes to the stage's log
    threading.Thread(target=_watch_parent, args=(os.getppid(),), name="parent-watch", daemon=True).start()
    return serve(stdin, PipeWriter(stdout))


if __name__ == "__main__":
    sys.exit(main())
