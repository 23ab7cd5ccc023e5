"""What `hetpipe train` does when one of its children dies (docs/recovery.md): a PS shard is restarted from
its newest checkpoint on the same port (the stages resend what it lost); a stage's VW stops the run or, with
[ps] on_vw_failure = "evict", is evicted and the other VWs go on. The decisions are pure (`on_exit`); the
Supervisor carries them out on the launcher's ChildGroup."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from hetpipe.core.config.schema import ClusterConfig
from hetpipe.core.errors import HetpipeError
from hetpipe.core.runs.procs import Child, ChildFailed, ChildGroup, describe_exit
from hetpipe.server.jobs import ShardJob
from hetpipe.server.launch import serve_job
from hetpipe.worker.ps_client import PSClient
from hetpipe.worker.stage import EXIT_STOPPED_BY_PS

__all__ = ["Decision", "Supervisor", "on_exit"]


@dataclass(frozen=True)
class Decision:
    # "restart" (a shard) | "evict" (a stage's VW) | "gone" (its VW is out already) | "stop" (the run)
    action: str
    why: str


def on_exit(
    config: ClusterConfig, name: str, exitcode: int, restarts: int, evicted: bool, live_vws: int
) -> Decision:
    """What to do about child `name` (ps-shard-<i> or vw<I>-s<J>) that ended with `exitcode` != 0."""
    how = describe_exit(exitcode)
    if name.startswith("ps-shard-"):
        if config.checkpoint.every < 1 or not config.checkpoint.enabled:
            return Decision(
                "stop",
                f"{name} {how}; with [checkpoint] every = 0 it cannot be restarted without losing "
                "updates (set every >= 1 to let `hetpipe train` restart it)",
            )
        if restarts >= config.ps.max_restarts:
            return Decision(
                "stop",
                f"{name} {how} after {restarts} restarts ([ps] max_restarts = {config.ps.max_restarts})",
            )
        return Decision(
            "restart",
            f"{name} {how}; restarting it from its newest checkpoint "
            f"(restart {restarts + 1} of at most {config.ps.max_restarts})",
        )
    if evicted:
        return Decision("gone", f"{name} {how}; its VW is evicted already")
    if config.ps.on_vw_failure != "evict":
        return Decision("stop", f"{name} {how}")
    if live_vws <= 1:
        return Decision("stop", f"{name} {how}, and its VW was the last one live: nothing can go on")
    why = "the PS evicted its VW" if exitcode == EXIT_STOPPED_BY_PS else how
    return Decision(
        "evict", f'{name} {why}; evicting its VW, the others go on ([ps] on_vw_failure = "evict")'
    )


@dataclass
class Supervisor:
    """The launcher's children by role, and what it did about the ones that died."""

    config: ClusterConfig
    group: ChildGroup
    run_dir: Path
    shard_jobs: list[ShardJob]  # with the port each shard listens on
    shards: list[Child]
    stages: dict[tuple[int, int], Child]
    admin: Callable[[], PSClient]
    say: Callable[[str], None] = lambda line: print(line, file=sys.stderr, flush=True)
    record: Callable[..., None] = lambda event, **fields: None
    restarts: list[int] = field(default_factory=list)
    evicted: set[int] = field(default_factory=set)
    _handled: set[str] = field(default_factory=set)  # stages whose end was dealt with
    _port_queues: dict[int, Any] = field(default_factory=dict)  # alive until the restarted shard has read it

    def __post_init__(self) -> None:
        self.restarts = [0] * len(self.shards)
        # a restart takes the newest checkpoint
        self.shard_jobs = [replace(job, resume_clock=None) for job in self.shard_jobs]

    @property
    def num_vws(self) -> int:
        return 1 + max(vw for vw, _ in self.stages)

    def live_vws(self) -> list[int]:
        return [v for v in range(self.num_vws) if v not in self.evicted]

    def tick(self) -> None:
        """Handle every child that ended badly since the last tick; ChildFailed when the run must stop."""
        for i, child in enumerate(self.shards):
            code = child.process.exitcode
            if (
                code is None
            ):  # a shard that ends during the run, even with 0 (someone stopped it), is restarted
                continue
            decision = on_exit(self.config, child.name, code, self.restarts[i], False, len(self.live_vws()))
            self._log(decision, child)
            if decision.action == "stop":
                raise ChildFailed(child)
            self._restart_shard(i)
        for (vw, _), child in self.stages.items():
            code = child.process.exitcode
            if code in (None, 0) or (vw in self.evicted and child.name in self._handled):
                continue
            self._handled.add(child.name)
            live = len(self.live_vws()) if vw in self.evicted else self.live_at_ps()
            decision = on_exit(self.config, child.name, code, 0, vw in self.evicted, live)
            if decision.action == "gone":
                continue
            self._log(decision, child)
            if decision.action == "stop":
                raise ChildFailed(child)
            self._evict(vw)

    def ps_status(self) -> list[dict[str, Any]] | None:
        """Every shard's status now, or None when one cannot answer within 10 s (a shard restarting)."""
        try:
            with self.admin() as ps:
                ps.timeout_s = 10
                return ps.status()
        except HetpipeError:
            return None

    def live_at_ps(self) -> int:
        """How many VWs are live as the PS sees them: a VW this launcher lost that rejoined through
        `hetpipe worker --join` counts again (the launcher does not see it come back). Its own count if the
        PS cannot say now."""
        infos = self.ps_status()
        if infos is None:
            return len(self.live_vws())
        return len(set().union(*(info["live"] for info in infos)))

    def all_live_done(self, waves: int) -> bool:
        """The launcher's own stages are done; has every live VW (one that rejoined through `hetpipe worker`
        too) finished at the PS, its last pushes in a checkpoint (its stages wait for that, so the PS serves
        on)?"""
        if not self.evicted:
            return True  # no VW can have rejoined
        infos = self.ps_status()
        return infos is not None and all(
            info["c_global"] >= waves and not info["not_durable"] for info in infos
        )

    def stages_running(self) -> bool:
        return any(c.process.exitcode is None for (vw, _), c in self.stages.items() if vw not in self.evicted)

    def _log(self, decision: Decision, child: Child) -> None:
        self.say(f"hetpipe train: {decision.why}")
        self.record(
            "child_exit",
            name=child.name,
            pid=child.process.pid,
            exitcode=child.process.exitcode,
            action=decision.action,
            why=decision.why,
        )

    def _restart_shard(self, i: int) -> None:
        self.restarts[i] += 1
        queue = self._port_queues[i] = (
            self.group.ctx.Queue()
        )  # (a queue collected before the child unpickles it
        self.group.children.remove(self.shards[i])  # takes its semaphore along)
        self.shards[i] = self.group.start(f"ps-shard-{i}", serve_job, self.shard_jobs[i], queue)
        self.write_pids()

    def _evict(self, vw: int) -> None:
        """Take `vw` out at every shard (its half waves dropped there), then end its other stages."""
        self.evicted.add(vw)
        try:
            with self.admin() as ps:
                calls = ps.send(
                    [("evict", {"run": self.config.name, "vw": vw}, None)] * len(ps.sockets),
                    what=f"evict of vw {vw}",
                )
                waves = [r.fields["at_wave"] for r in ps.wait(calls)]
        except Exception as exc:  # the PS may be restarting; its heartbeat check evicts the VW in time anyway
            self.say(
                f"hetpipe train: could not tell the PS to evict vw {vw} now ({exc}); its heartbeats will"
            )
            waves = []
        for (v, _), child in self.stages.items():
            if v == vw and child.process.exitcode is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(child.process.pid, signal.SIGKILL)
                child.process.join(5)
            if v == vw:
                self._handled.add(child.name)
        self.say(
            f"hetpipe train: vw {vw} evicted at wave {min(waves) if waves else '?'}; "
            f"live VWs {self.live_vws()}"
        )
        self.record("vw_evicted", vw=vw, at_wave=waves)

    def write_pids(self) -> None:
        pids: dict[str, Any] = {c.name: c.process.pid for c in [*self.shards, *self.stages.values()]}
        (self.run_dir / "pids.json").write_text(json.dumps(pids, indent=1))
