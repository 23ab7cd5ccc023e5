"""One stage process of a virtual worker: runs its schedule's action list through a dispatch table.

F p: receive the input (stage 0: read minibatch p), forward, send the output on.
B p: receive the output gradient (last stage: from the loss), backward, send the input gradient.
U p: the optimizer step (or, where the PS runs the optimizer, the gradient into the wave's sum).
PUSH c: hand the wave's push to the PS agent, a thread or a process (it goes out while compute goes on).
WAIT c: take the pull of W_{c-D-1} (handed to the agent as early as WSP allows), rebase.
Compute is stretched to the emulated GPU's speed; every action is traced, and the stage reports where
its time went (compute, device-to-host, push, gate wait, pull, host-to-device) to the launcher.

Recovery (docs/recovery.md): at the PS's checkpoint waves the stage saves its state right after its PUSH c-1
(hetpipe.core.pipeline.resume), and a resumed stage starts there; a stage of a rejoining VW runs only the
actions of waves from its start wave on. The PS agent sends heartbeats; when the PS says the VW was evicted or
the run failed, the process ends (exit code 3) even if its thread waits on a neighbour that will never answer.

Here: StageRunner (the stage's life: build, start-up, the action loop, the end and its report) and PSHandOver
(PUSH and WAIT: everything the stage hands to its PS link). F, B and U are worker/stage_actions.py's, the
`--audit` checks worker/stage_audit.py's, the snapshots worker/stage_resume.py's, the other parts a stage
builds worker/stage_build.py's.
"""

from __future__ import annotations

import gc
import os
import sys
import time
import traceback
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hetpipe.compute import data as datalib
from hetpipe.compute.build import dataset_of, model_of, start_from_init
from hetpipe.compute.heap import keep_freed_memory
from hetpipe.compute.stage_compute import StageCompute, StageRules
from hetpipe.core.hardware.devices import p2p_backend
from hetpipe.core.pipeline.schedule import WAIT, Action
from hetpipe.core.runs.metrics import STAGE_PARTS, TraceRecorder
from hetpipe.core.wsp.aggregation import get_aggregation, needs_pulls
from hetpipe.core.wsp.audit import planned_gaps
from hetpipe.core.wsp.clock import gate_version
from hetpipe.models import build_stage
from hetpipe.worker.flat_layout import FlatLayout
from hetpipe.worker.jobs import StageJob
from hetpipe.worker.optimizer_handover import load_handover, save_handover
from hetpipe.worker.p2p import P2P
from hetpipe.worker.ps_link import PSLink, agent_kind, open_link
from hetpipe.worker.stage_actions import ComputeActions, NonFiniteLoss
from hetpipe.worker.stage_audit import StageAudit
from hetpipe.worker.stage_build import (
    PS_ROW,
    client_spec,
    records_only_waits,
    stage_profiler,
    stage_schedule,
    stage_trace,
    startup_points,
)
from hetpipe.worker.stage_resume import load_stage_snapshot, save_stage_snapshot
from hetpipe.worker.transfer import PullStaging, PushStaging

__all__ = ["EXIT_STOPPED_BY_PS", "NonFiniteLoss", "PSHandOver", "StageRunner", "run_stage"]

EXIT_STOPPED_BY_PS = 3  # the PS evicted this stage's VW or failed the run


class PSHandOver:
    """PUSH c and WAIT c of one stage: each wave's push staged on the host and handed to the PS agent with its
    pinned slot, the next WAIT's pull handed over as early as WSP allows, and the waits for both
    (docs/architecture.md#the-ps-path). It keeps the stage's place on the PS side: the waves pushed, the next
    WAIT, c_global and the last pull's gaps."""

    def __init__(
        self,
        job: StageJob,
        actions: Sequence[Action],
        compute: StageCompute,
        compute_actions: ComputeActions,
        ledgers: dict[str, torch.Tensor],
        trace: TraceRecorder,
        times: dict[str, float],
        report: Callable[[dict[str, Any]], None],
        snapshot: Callable[[int], None],
    ) -> None:
        self.job, self.config, self.compute, self.ledgers = job, job.config, compute, ledgers
        self.trace, self.times, self.report = trace, times, report
        self.device = torch.device(job.device)
        self._read_losses = compute_actions.read_losses  # the wave's losses, read at its push
        self._sync_block = compute_actions.sync_block
        self._snapshot = snapshot  # saves the stage's state at a wave (job.snapshot_every)
        self.pulls = needs_pulls(job.num_vws, get_aggregation(self.config.ps.aggregation))
        # autofreeze: the WAITs bring the movement its freeze points are decided by, to a lone VW too
        self.records_only = records_only_waits(job)
        self.waits = [a.index for a in actions if a.kind == WAIT] if self.pulls or self.records_only else []
        self.link: PSLink | None = None
        self.push_staging: PushStaging | None = None
        self.pull_staging: PullStaging | None = None
        # CUDA: recorded at the last PUSH, behind its wave's work
        self._wave_queued: torch.cuda.Event | None = None
        self._pushes: deque[tuple[int, Future]] = deque()  # (pinned slot, its push) in hand-over order
        self._pull: tuple[int, Future] | None = None  # the pull handed over, for WAIT of that wave
        self.next_wait = 0  # index into self.waits of the next WAIT to run
        self.pushed = job.start_wave  # waves handed over to the agent
        self.c_global = 0
        # from the last pull: waves some VW contributed nothing to (evicted; before a pull: those of the plan)
        self.gaps: list[list[int]] = planned_gaps(job.vw_spans, job.config.train.waves)

    def start(self, link: PSLink, layout: FlatLayout) -> None:
        """Stage pushes and pulls in the link's host buffers (or the stage's own), and start its agent."""
        self.link = link
        self.push_staging = PushStaging(layout, self.device, link.push_slots)
        self.pull_staging = PullStaging(layout, self.device, link.pull_host) if self.pulls else None
        link.start(
            self.pull_staging.out if self.pull_staging else None,
            self.pull_staging.wait_free if self.pull_staging else None,
        )

    def push(self, wave: int) -> None:
        """PUSH wave: the wave's losses read, its push staged and handed to the agent, the sums no pull needs
        any more forgotten, the next pull handed over if it may; a snapshot at the checkpoint waves."""
        with self.trace.span(f"PUSH{wave}"):
            started = time.perf_counter()
            self._read_losses()  # on CUDA a wait for the device's last loss of the wave: counted as compute
            # CUDA: the CPU runs at most a wave ahead of the device, not more
            if self._wave_queued is not None:
                self._wave_queued.synchronize()
            self._timed("compute", started)
            copies = self.push_staging.copies
            if self.next_wait >= len(self.waits) and not copies:
                # no pull is due to hold this stage back, so a PS slower than the stage would let pushes (and
                # their sums) pile up without bound: one push in flight at most
                # (docs/memory.md#what-a-stage-keeps); staged into two host buffers (CUDA, or an agent
                # process) they bound them at two (a push waits for its buffer's last push)
                self._wait_for_pushes(lambda slot: True)
            started = time.perf_counter()
            # staging copies the buffers itself (on CUDA in stream order)
            arrays, ready = self.push_staging.stage(
                self.compute.wave_push(wave, copy_buffers=not copies), self._wait_for_slot
            )
            self._timed("d2h", started)
            slot = self.push_staging.slot
            self._pushes.append((slot, self.link.push(wave, slot, arrays, ready, reused=copies)))
            self.pushed = wave + 1
            if self.device.type == "cuda":
                self._wave_queued = torch.cuda.Event(blocking=True)
                self._wave_queued.record()  # waited for at the next PUSH
        if self.compute.optimizer is not None or self.ledgers:
            # own sums the next pull will contain (or all, when no pull comes) are not needed any more
            ahead = self.waits[self.next_wait] if self.next_wait < len(self.waits) else None
            self.compute.forget(
                wave if ahead is None else min(wave, gate_version(ahead, self.config.wsp.staleness) - 1), wave
            )
        while self._pushes and self._pushes[0][1].done():
            self._note_push(self._pushes.popleft()[1].result())
        self.hand_over_pull()
        self.report(
            {
                "event": "push",
                "vw": self.job.vw,
                "stage": self.job.stage,
                "wave": wave,
                "time": time.time(),
                "c_global": self.c_global,
                "gate_wait_s": round(self.times["gate_wait"], 3),
            }
        )
        every = self.job.snapshot_every
        if every and (wave + 1) % every == 0 and wave + 1 < self.config.train.waves:
            self._snapshot(wave + 1)

    def wait(self, wave: int) -> None:
        """WAIT wave: take the pull of W_{wave-D-1} (handed over earlier), bring it to the device, rebase."""
        if not self.waits:
            return
        with self.trace.span(f"WAIT{wave}"):
            self.hand_over_pull()
            assert self._pull is not None and self._pull[0] == wave, (self._pull, wave)
            started = time.perf_counter()
            pulled = self._pull[1].result()
            self.gaps = pulled.gaps
            for boundary, point in self.compute.freezing.observe(pulled.movement):  # autofreeze
                if self.job.stage == 0:  # every stage decides alike: one line per VW
                    self.report(
                        {
                            "event": "freeze",
                            "vw": self.job.vw,
                            "time": time.time(),
                            "wave": point.wave,
                            "layers": point.layers,
                            "decided_at": boundary,
                        }
                    )
            self._timed("gate_wait", started)
            self.report(
                {
                    "event": "pull",
                    "vw": self.job.vw,
                    "stage": self.job.stage,
                    "wave": wave,
                    "time": time.time(),
                    "version": pulled.version,
                    "age_waves": wave - pulled.version,
                }
            )
            # on CUDA the copy and the rebase are queued, not waited for (the agent waits for the copy
            # instead), unless emulation stretches blocks: then the next F must not carry this work
            if not self.records_only:
                started = time.perf_counter()
                self.compute.rebase(self.pull_staging.to_device(), pulled.own_through, pulled.version)
                self._sync_block()
                self._timed("h2d", started)
        self._pull = None
        self.next_wait += 1
        self.hand_over_pull()

    def hand_over_pull(self) -> None:
        """Hand the next WAIT's pull to the agent as soon as our own pushes it needs are handed over."""
        if self._pull is not None or self.next_wait >= len(self.waits):
            return
        wave = self.waits[self.next_wait]
        if self.pushed >= gate_version(wave, self.config.wsp.staleness):  # own waves <= c - D - 2 are out
            self._pull = (wave, self.link.pull(wave))

    def settle(self) -> None:
        """Block until every push handed over is acknowledged (before the stage reports done)."""
        for _, future in self._pushes:
            self._note_push(future.result())

    def _note_push(self, done: Any) -> None:
        self.c_global = max(self.c_global, done.c_global)

    def _wait_for_slot(self, slot: int) -> None:
        """Block until the push that last used pinned buffer `slot` has left (CUDA only)."""
        self._wait_for_pushes(lambda used: used == slot)

    def _wait_for_pushes(self, which: Callable[[int], bool]) -> None:
        """Block until every push handed over whose pinned slot `which` picks is acknowledged
        ("push_wait")."""
        started = time.perf_counter()
        for used, future in self._pushes:
            if which(used):
                self._note_push(future.result())
        self._timed("push_wait", started)

    def _timed(self, what: str, started: float) -> None:
        self.times[what] += time.perf_counter() - started


class StageRunner:
    """One stage's life: built from its job, started up (PS link and registration, resume, neighbours), its
    action list run through a dispatch table from action kind to handler, and where its time went reported."""

    def __init__(self, job: StageJob, report: Callable[[dict[str, Any]], None]) -> None:
        self.job, self.report = job, report
        # when each step of this stage's start-up ended (Unix seconds), reported once before the first action
        self.startup = startup_points()
        self.config = config = job.config
        self.device = torch.device(job.device)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self.spec = model_of(config)
        self.store = (
            P2P.rendezvous_store(0, job.num_stages, job.p2p_host, job.p2p_port)
            if job.stage == 0 and job.num_stages > 1
            else None
        )  # listening before any peer asks
        train = dataset_of(config).train
        self.startup["data"] = time.time()
        shards = datalib.span_shards(len(train.y), job.vw_spans, job.vw, config.seed, job.vw_weights)
        start, stop = job.layers
        module = build_stage(self.spec, start, stop, self.device)
        start_from_init(module, config)  # [model] init: a state to fine-tune from
        self.schedule, self.actions = stage_schedule(job)
        self.position = 0  # index of the next action to run (the heartbeats report it)
        rules = StageRules.of(config, self.schedule.stages[job.stage], job.num_vws)
        self.audit = StageAudit(job, self.schedule, self.device)
        t = config.train
        self.compute = StageCompute(
            module,
            t.optimizer,
            t.lr,
            t.momentum,
            t.weight_decay,
            rules,
            ledgers=self.audit.ledgers,
            on_update=self.audit.tag_updates,
        )
        self.trace = stage_trace(job)
        self.profiler = stage_profiler(job, self.device)
        self.client_spec = client_spec(job, self.spec)
        self.p2p: P2P | None = None
        self.link: PSLink | None = None
        # seconds of this stage's own thread by part (recv: blocked for a neighbour's activation or gradient;
        # send: handing one over, the emulated link's delay included), and of its whole training loop
        self.times = dict.fromkeys(STAGE_PARTS, 0.0)
        self.train_s = 0.0
        self.started = 0.0  # time.monotonic() at the first action
        self.compute_actions = ComputeActions(
            job, self.spec, train, shards, self.compute, self.trace, self.times, report
        )
        self.handover = PSHandOver(
            job,
            self.actions,
            self.compute,
            self.compute_actions,
            self.audit.ledgers,
            self.trace,
            self.times,
            report,
            self._snapshot,
        )
        self.dispatch: dict[str, Callable[[int], None]] = {
            "F": self._audited_forward if self.audit.ledgers else self.compute_actions.forward,
            "B": self.compute_actions.backward,
            "U": self.compute_actions.update,
            "PUSH": self.handover.push,
            "WAIT": self.handover.wait,
        }
        self.startup["built"] = time.time()

    # ---- lifecycle ----------------------------------------------------------------------------------
    def run(self) -> None:
        """Start up, run the action list, leave once the PS has the last pushes in a checkpoint, report."""
        job = self.job
        layout = self._register()
        resend = self._resume() if job.resume_wave else {}
        load_handover(job, self.compute, self.config.ps.timeout_s)  # a re-plan's VW: its source's optimizer
        self.handover.start(self.link, layout)
        self._connect()
        # what start-up built (model, data, sockets) lives to the end: keep it out of the garbage collector's
        # full passes, which otherwise stop the training thread for ~0.1 s (and an emulated GPU that long
        # times its slowdown) to walk objects none of which is garbage
        gc.freeze()
        self.started = time.monotonic()
        self.compute_actions.begin(self.started)
        try:
            self._train(resend)
        except BaseException:
            close_all([lambda: self.link.close(timeout_s=30), self.p2p.close], failed=True)
            raise
        close_all([lambda: self.link.close(timeout_s=30), self.p2p.close], failed=False)
        save_handover(job, self.compute)  # a VW that retires at a re-plan: its optimizer for the next
        try:
            if not self.link.wait_durable(self.config.ps.timeout_s, progress=self.position):
                print(
                    f"vw {job.vw} stage {job.stage}: the PS did not put the last pushes in a checkpoint "
                    f"within {self.config.ps.timeout_s:.0f} s; finishing anyway",
                    file=sys.stderr,
                    flush=True,
                )
        finally:
            self.link.shutdown()
        self._report_done()

    def _register(self) -> FlatLayout:
        """Open the link to the PS agent and register the stage's keys there; loads the PS's W_0 of them.
        Returns the keys' flat layout."""
        job = self.job
        values = self.compute.values()
        layout = FlatLayout.of(values)
        self.link = link = open_link(
            agent_kind(self.config.ps.agent, self.device),
            self.client_spec,
            layout,
            self.device,
            self.trace,
            PS_ROW + job.stage,
            self.config.ps.heartbeat_s,
            self._stopped_by_ps,
            f"{self.config.name}-vw{job.vw}-s{job.stage}",
        )
        pulls = self.handover.pulls
        w0 = link.register(values, self.compute.kinds(), self.config.train.waves, job.start_wave, pulls)
        self.compute.load({k: torch.from_numpy(np.array(v)).to(self.device) for k, v in w0.items()})
        self.startup["registered"] = time.time()
        return layout

    def _connect(self) -> None:
        """Join the VW's process group (P2P with the neighbouring stages), then report the start-up points."""
        job = self.job
        self.p2p = self.compute_actions.p2p = P2P.connect(
            job.stage,
            job.num_stages,
            job.p2p_host,
            job.p2p_port,
            self.device,
            max_in_flight=self.config.wsp.nm + 1,
            backend=p2p_backend(job.devices or (job.device,)),
            store=self.store,
        )
        self.startup["rendezvous"] = time.time()
        self.report(
            {
                "event": "startup",
                "vw": job.vw,
                "stage": job.stage,
                "time": self.startup["rendezvous"],
                "points": {k: round(v, 3) for k, v in self.startup.items() if v is not None},
            }
        )

    def _train(self, resend: dict[int, torch.Tensor]) -> None:
        """The training loop: the resumed activations sent again, the actions run, the last losses and the
        device's last work waited for (train_s ends there), every push acknowledged."""
        compute_actions = self.compute_actions
        for p in sorted(resend):  # sent before the checkpoint, not received by the next stage before its own
            compute_actions.send(resend[p], self.job.stage + 1)
        self.handover.hand_over_pull()
        self._run_actions()
        # a schedule that ends without a push (none of ours) still reports every loss
        compute_actions.read_losses()
        compute_actions.sync()  # the device's last queued work is part of the run
        self.train_s = time.monotonic() - self.started
        self.handover.settle()  # every push acknowledged before the stage reports done

    def _run_actions(self) -> None:
        """Run the action list from self.position on, each through the dispatch table (under --profile inside
        the profiler's before and after); the agent's heartbeats report the position."""
        progress = self.link.progress  # what the agent's heartbeats report
        profiler = self.profiler
        while self.position < len(self.actions):
            action = self.actions[self.position]
            if profiler is not None:
                profiler.before(action.kind, action.index)
            self.dispatch[action.kind](action.index)
            if profiler is not None:
                profiler.after(action.kind, action.index)
            self.position += 1
            progress[0] = self.position
        if profiler is not None:
            profiler.close()

    def _audited_forward(self, p: int) -> None:
        """F p under --audit: the ledgers checked (against the last pull's gaps) before the forward."""
        self.audit.check(p, self.handover.gaps)
        self.compute_actions.forward(p)

    # ---- where the time went ---------------------------------------------------------------------------
    def _report_done(self) -> None:
        """Write the trace (with the time totals) and, if asked, the final weights; report stage_done."""
        job = self.job
        run_dir = Path(job.run_dir)
        totals = self.totals()
        self.trace.dump(
            run_dir / "trace" / f"vw{job.vw}-s{job.stage}.json",
            other={"times_s": totals, "waves": job.end_wave - job.start_wave},
        )
        if job.dump_weights:
            ledgers = self.audit.ledgers
            state = {
                k: t.detach().cpu().clone() for k, t in self.compute.values().items() if k not in ledgers
            }
            torch.save(state, run_dir / f"final-vw{job.vw}-s{job.stage}.pt")
        dilator = self.compute_actions.dilator
        cache = self.compute.frozen_cache
        self.report(
            {
                "event": "stage_done",
                "vw": job.vw,
                "stage": job.stage,
                "time": time.time(),
                "audit_checks": self.audit.checks,
                "compute_s": round(dilator.compute_s, 3),
                "slept_s": round(dilator.slept_s, 3),
                "times_s": totals,
                # train.freeze_cache_mib: minibatches whose frozen layers' output came from kept rows
                "frozen_cache": {"hits": cache.hits, "misses": cache.misses, "mib": cache.bytes / 2**20},
                # train.autofreeze_every: every freeze point the rule chose, [wave, layers]
                "autofreeze": [[p.wave, p.layers] for p in self.compute.freezing.freeze.points],
            }
        )

    def totals(self) -> dict[str, float]:
        """Seconds by part: this thread's (self.times), its PS agent's (push, pull, parked) and the training
        loop's."""
        assert self.link is not None
        push, pull, parked = self.link.totals
        return {
            **{k: round(v, 4) for k, v in self.times.items()},
            "push": round(push, 4),
            "pull": round(pull, 4),
            "parked": round(parked, 4),
            "train": round(self.train_s, 4),
        }

    def _stopped_by_ps(self, exc: BaseException) -> None:
        """The PS agent heard that this stage must stop (its VW evicted, the run failed, pushes lost): say
        so and end the process, whatever the stage thread is blocked on."""
        code = getattr(exc, "code", "")
        if code not in ("evicted", "vw_failed", "lost"):
            return  # anything else reaches the stage thread through its futures
        job = self.job
        print(f"vw {job.vw} stage {job.stage} stops: {exc}", file=sys.stderr, flush=True)
        self.report(
            {
                "event": "stage_failed",
                "vw": job.vw,
                "stage": job.stage,
                "pid": os.getpid(),
                "error": f"{type(exc).__name__}: {exc}",
                "traceback": "",
                "code": code,
            }
        )
        time.sleep(0.3)  # let the event queue's feeder thread hand the report over
        os._exit(EXIT_STOPPED_BY_PS)

    # ---- snapshots (hetpipe train --resume) -----------------------------------------------------------
    def _snapshot(self, wave: int) -> None:
        """Save this stage's state at wave `wave` (just after PUSH wave-1), for a resume from there."""
        handover = self.handover
        runner = {
            "position": self.position + 1,
            "next_wait": handover.next_wait,
            "pushed": handover.pushed,
            "c_global": handover.c_global,
            "samples": self.compute_actions.samples,
        }
        save_stage_snapshot(self.job, self.compute, wave, runner, self.link.checkpoint_floor())

    def _resume(self) -> dict[int, torch.Tensor]:
        """Load this stage's snapshot of job.resume_wave and go on from its place; returns the activations to
        send the next stage again."""
        compute_actions = self.compute_actions
        runner, resend = load_stage_snapshot(
            self.job,
            self.schedule,
            self.actions,
            self.compute,
            compute_actions.loss_fn,
            compute_actions.batch,
            compute_actions.targets,
        )
        self.position = runner["position"]
        handover = self.handover
        handover.next_wait, handover.pushed = runner["next_wait"], runner["pushed"]
        handover.c_global, compute_actions.samples = runner["c_global"], runner["samples"]
        return resend


def close_all(closers: Sequence[Callable[[], None]], *, failed: bool) -> None:
    """Run every closer. When the stage failed already, a closer's own error (a neighbour that went away with
    it) is printed, not raised: it would replace the error that stopped the stage (a full disk)."""
    errors: list[BaseException] = []
    for close in closers:
        try:
            close()
        except Exception as exc:
            errors.append(exc)
    for exc in errors if failed else ():
        print(f"while closing after the failure: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
    if errors and not failed:
        raise errors[0]


def run_stage(job: StageJob, events: Any = None) -> None:
    """Child-process entry point: one torch thread, run the stage, report failure with its traceback."""
    torch.set_num_threads(1)
    keep_freed_memory()
    report = events.put if events is not None else (lambda _msg: None)
    try:
        StageRunner(job, report).run()
    except BaseException as exc:
        report(
            {
                "event": "stage_failed",
                "vw": job.vw,
                "stage": job.stage,
                "pid": os.getpid(),
                "time": time.time(),
                "error": f"{type(exc).__name__}: {exc}",
                "traceback": traceback.format_exc(),
                **({"wave": exc.wave} if isinstance(exc, NonFiniteLoss) else {}),
            }
        )
        raise
