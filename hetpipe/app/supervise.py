"""What `hetpipe train` does when one of its children dies (docs/recovery.md): a PS shard is restarted from
its newest checkpoint on the same port (the stages resend what it lost); a stage's VW stops the run or, with
[ps] on_vw_failure = "evict", is evicted and the other VWs go on (also when the PS evicted it by itself: a
stage hung or stopped, its process alive). The decisions are pure (`on_exit`, `on_silent_vw`,
`first_failure`); the Supervisor carries them out on the launcher's ChildGroup."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import time
from collections.abc import Callable, Sequence
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

__all__ = ["Decision", "Supervisor", "first_failure", "on_exit", "on_silent_vw"]

WATCH_PS_S = 1.0  # under "evict", how often the launcher asks the PS which VWs it evicted by itself
SETTLE_S = 1.0  # when a child's plain exit stops the run, how long to wait for the one that took it down


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
    why = f"{how}: the PS evicted its VW" if exitcode == EXIT_STOPPED_BY_PS else how
    return Decision(
        "evict", f'{name} {why}; evicting its VW, the others go on ([ps] on_vw_failure = "evict")'
    )


def on_silent_vw(config: ClusterConfig, name: str, age_s: float, live_vws: int) -> Decision:
    """What to do about the VW of stage `name`, which the PS evicted by itself (on_vw_failure = "evict")
    because `name` sent no heartbeat for `age_s`: its process is alive but hung or stopped. `live_vws` counts
    the live VWs before that eviction."""
    how = (
        f"{name} sent no heartbeat for {age_s:.1f} s ([ps] hung_after_s = {config.ps.hung_after_s:g}): it "
        "is hung or stopped, and the PS evicted its VW"
    )
    if live_vws <= 1:
        return Decision("stop", f"{how}; its VW was the last one live: nothing can go on")
    return Decision("evict", f"{how}; killing its stages, the others go on")


def first_failure(ends: Sequence[tuple[str, int, float]]) -> str:
    """Of children that ended badly close together, (name, exit code, when the launcher saw it end), the one
    to blame: the first killed by a signal (what takes a neighbour down with it: a stage that loses its peer
    exits 1 on "Connection reset by peer"), else the first to exit; a tie goes to the first listed."""
    order = {name: i for i, (name, _, _) in enumerate(ends)}
    return min(ends, key=lambda end: (end[1] >= 0, end[2], order[end[0]]))[0]


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
    relays: list[Child] = field(
        default_factory=list
    )  # node aggregation's (docs/wsp.md#node-local-aggregation)
    restarts: list[int] = field(default_factory=list)
    evicted: set[int] = field(default_factory=set)
    _handled: set[str] = field(default_factory=set)  # stages whose end was dealt with
    _port_queues: dict[int, Any] = field(default_factory=dict)  # alive until the restarted shard has read it
    _ended: dict[int, float] = field(default_factory=dict)  # child PID -> when first seen ended (monotonic)
    _next_watch: float = 0.0  # when _watch_ps next asks the PS

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
        """Handle every child that ended badly since the last tick, and (under "evict") every VW the PS
        evicted by itself; ChildFailed when the run must stop."""
        self._note_ends()
        for i, child in enumerate(self.shards):
            code = child.process.exitcode
            if code is None:  # a shard that ends during the run, even with 0 (someone stopped it), restarts
                continue
            decision = on_exit(self.config, child.name, code, self.restarts[i], False, len(self.live_vws()))
            if decision.action == "stop":
                self._stop(child, decision, len(self.live_vws()))
            self._log(decision, child)
            self._restart_shard(i)
        for child in self.relays:  # a relay holds its group's waves until upstream has them: none restarts
            code = child.process.exitcode
            if code is not None:
                why = f"{child.name} {describe_exit(code)}; a node relay is not restarted, so its VWs stop"
                self._stop(child, Decision("stop", why), len(self.live_vws()))
        for (vw, _), child in self.stages.items():
            code = child.process.exitcode
            if code in (None, 0) or (vw in self.evicted and child.name in self._handled):
                continue
            self._handled.add(child.name)
            live = len(self.live_vws()) if vw in self.evicted else self.live_before(vw)
            decision = on_exit(self.config, child.name, code, 0, vw in self.evicted, live)
            if decision.action == "gone":
                continue
            if decision.action == "stop":
                self._stop(child, decision, live)
            self._log(decision, child)
            self._evict(vw)
        self._watch_ps()

    def _note_ends(self) -> None:
        """Remember when each child was first seen ended (by PID: a restarted shard is a new process)."""
        now = time.monotonic()
        for child in [*self.shards, *self.relays, *self.stages.values()]:
            if child.process.exitcode is not None:
                self._ended.setdefault(child.process.pid, now)

    def _stop(self, child: Child, decision: Decision, live: int) -> None:
        """Stop the run on `child`'s end, naming (in the error and in metrics.jsonl) the child that failed
        first of those that ended with it: the one killed by a signal, not the neighbour it took down."""
        culprit = self._first_failed(child)
        if culprit is not child:
            code = culprit.process.exitcode
            own = (
                on_exit(self.config, culprit.name, code, 0, False, live)
                if culprit in self.stages.values()
                else None
            )
            why = (
                own.why
                if own is not None and own.action == "stop"
                else f"{culprit.name} {describe_exit(code)}"
            )
            decision = Decision("stop", why)
        also = [c for c in self._failed_children() if c is not culprit]
        self._log(decision, culprit, also)
        raise ChildFailed(culprit, also=also)

    def _failed_children(self) -> list[Child]:
        """The shards and the stages of live VWs that ended with a non-zero exit."""
        live_stages = (c for (vw, _), c in self.stages.items() if vw not in self.evicted)
        children = [*self.shards, *self.relays, *live_stages]
        return [c for c in children if c.process.exitcode not in (None, 0)]

    def _first_failed(self, child: Child) -> Child:
        """The child to blame when `child` failed: first_failure of the children that ended badly, waiting up
        to SETTLE_S for one killed by a signal when none is yet (it may be seen to end a moment later)."""
        deadline = time.monotonic() + SETTLE_S
        while True:
            self._note_ends()
            failed = self._failed_children()
            failed = failed if child in failed else [child, *failed]
            ends = [(c.name, c.process.exitcode or 0, self._ended.get(c.process.pid, 0.0)) for c in failed]
            if any(code < 0 for _, code, _ in ends) or time.monotonic() >= deadline:
                name = first_failure(ends)
                return next(c for c in failed if c.name == name)
            time.sleep(0.1)

    def _watch_ps(self) -> None:
        """Under "evict", every WATCH_PS_S: a VW of this launcher that the PS evicted by itself (a stage
        silent for hung_after_s, its process alive but hung or stopped) is evicted here too and its stages
        killed, or the run stops when it was the last VW live. Nothing else would see it: no process of it
        ends."""
        now = time.monotonic()
        if self.config.ps.on_vw_failure != "evict" or now < self._next_watch:
            return
        self._next_watch = now + WATCH_PS_S
        infos = self.ps_status(timeout_s=2)
        if not infos:
            return
        live = set().union(*(info["live"] for info in infos))
        for vw in range(self.num_vws):
            if vw in self.evicted or not any(i.get("num_vws") and vw not in i["live"] for i in infos):
                continue
            stage, age = _silent_stage(vw, infos)
            child = self.stages[(vw, stage)]
            decision = on_silent_vw(self.config, child.name, age, len(live | {vw}))
            self._log(decision, child)
            if decision.action == "stop":
                raise ChildFailed(child, how=decision.why.removeprefix(f"{child.name} "))
            self._evict(vw)

    def live_before(self, vw: int) -> int:
        """How many VWs were live just before the failure of `vw` being handled: as the PS sees them now, with
        `vw` (the PS may have evicted it already: a hung stage's VW, whose other stages it then stops)."""
        live = self._live_set_at_ps()
        return len(set(self.live_vws()) if live is None else live | {vw})

    def ps_status(self, timeout_s: float = 10.0) -> list[dict[str, Any]] | None:
        """Every shard's status now, or None when one cannot answer within `timeout_s` (one restarting)."""
        try:
            with self.admin() as ps:
                ps.timeout_s = timeout_s
                return ps.status()
        except HetpipeError:
            return None

    def _live_set_at_ps(self) -> set[int] | None:
        """The VWs live at any shard now (one may lag a wave), or None when the PS cannot say now."""
        infos = self.ps_status()
        return None if infos is None else set().union(*(info["live"] for info in infos))

    def live_at_ps(self) -> int:
        """How many VWs are live as the PS sees them: a VW this launcher lost that rejoined through
        `hetpipe worker --join` counts again (the launcher does not see it come back). Its own count if the
        PS cannot say now."""
        live = self._live_set_at_ps()
        return len(self.live_vws()) if live is None else len(live)

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

    def _log(self, decision: Decision, child: Child, also: Sequence[Child] = ()) -> None:
        self.say(f"hetpipe train: {decision.why}")
        others = {"also": [{"name": c.name, "how": describe_exit(c.process.exitcode)} for c in also]}
        self.record(
            "child_exit",
            name=child.name,
            pid=child.process.pid,
            exitcode=child.process.exitcode,
            how=describe_exit(child.process.exitcode),
            action=decision.action,
            why=decision.why,
            **(others if also else {}),
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


def _silent_stage(vw: int, infos: list[dict[str, Any]]) -> tuple[int, float]:
    """The stage of `vw` silent longest at any shard, and for how many seconds (stage 0 when none says)."""
    ages = [
        (age, int(key.split("/")[1]))
        for info in infos
        for key, age in info.get("heartbeat_age_s", {}).items()
        if int(key.split("/")[0]) == vw
    ]
    age, stage = max(ages, default=(0.0, 0))
    return stage, age
