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
"""

from __future__ import annotations

import os
import sys
import time
import traceback
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hetpipe.compute import data as datalib
from hetpipe.compute.build import audit_shape, dataset_of, model_of, ps_placement
from hetpipe.compute.heap import keep_freed_memory
from hetpipe.compute.stage_compute import StageCompute, StageRules
from hetpipe.core.errors import HetpipeError
from hetpipe.core.hardware.devices import p2p_backend
from hetpipe.core.hardware.emulate import LinkEmulator, device_dilator
from hetpipe.core.pipeline.resume import cut_position, forwarded_before, rejoin_actions, snapshot_floor
from hetpipe.core.pipeline.schedule import WAIT, get_schedule, own_through_required
from hetpipe.core.runs.metrics import STAGE_PARTS, TraceRecorder
from hetpipe.core.runs.procs import child_entered_at, process_started_at
from hetpipe.core.wsp.aggregation import get_aggregation, needs_pulls
from hetpipe.core.wsp.audit import AuditError, audit_key, ledger_violations
from hetpipe.core.wsp.state import gate_version
from hetpipe.models import build_stage
from hetpipe.worker.flat_layout import FlatLayout
from hetpipe.worker.jobs import StageJob
from hetpipe.worker.loss_reader import LossReader
from hetpipe.worker.p2p import P2P
from hetpipe.worker.ps_client import ClientSpec
from hetpipe.worker.ps_link import ProcessLink, ThreadLink, agent_kind, open_link
from hetpipe.worker.snapshot import load_snapshot, save_snapshot, snapshot_dir
from hetpipe.worker.stage_profile import StageProfiler
from hetpipe.worker.transfer import PullStaging, PushStaging

__all__ = ["EXIT_STOPPED_BY_PS", "NonFiniteLoss", "StageRunner", "run_stage"]

PS_ROW = 1000  # trace row of a stage's PS traffic: PS_ROW + stage
EXIT_STOPPED_BY_PS = 3  # the PS evicted this stage's VW or failed the run


class NonFiniteLoss(HetpipeError):
    """A minibatch's loss came out NaN or infinite; the message names the stage, minibatch and wave."""

    def __init__(self, message: str, wave: int) -> None:
        super().__init__(message)
        self.wave = wave


class StageRunner:
    """Owns one stage's compute, transport and PS agent; `run()` executes the action list."""

    def __init__(self, job: StageJob, report: Callable[[dict[str, Any]], None]) -> None:
        self.job, self.report = job, report
        # when each step of this stage's start-up ended (Unix seconds), reported once before the first action
        imported = child_entered_at() or time.time()
        started = process_started_at()  # from /proc's 10 ms ticks: may read a few ms after `imported`
        self.startup = {"process": None if started is None else min(started, imported), "imported": imported}
        self.config = config = job.config
        self.device = torch.device(job.device)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self.spec = model_of(config)
        self.first, self.last = job.stage == 0, job.stage == job.num_stages - 1
        self.store = (
            P2P.rendezvous_store(0, job.num_stages, job.p2p_host, job.p2p_port)
            if self.first and job.num_stages > 1
            else None
        )  # listening before any peer asks
        dataset = dataset_of(config)
        self.x, self.y = dataset.train.x, dataset.train.y
        self.startup["data"] = time.time()
        self.indices = datalib.shard_indices(len(self.y), job.num_vws, job.vw, config.seed)
        start, stop = job.layers
        module = build_stage(self.spec, start, stop, self.device)
        t, wsp = config.train, config.wsp
        kind = get_schedule(t.schedule)
        self.schedule = kind(job.num_stages, wsp.nm, t.waves, wsp.staleness)
        self.actions = list(self.schedule.stages[job.stage])
        if job.start_wave:
            self.actions = rejoin_actions(self.actions, job.start_wave, wsp.nm)
        self.position = 0  # index of the next action to run (the heartbeats report it)
        rules = StageRules.of(config, self.schedule.stages[job.stage], job.num_vws)
        self.ledgers: dict[str, torch.Tensor] = {}
        if job.audit:
            shape = audit_shape(config, job.num_vws)
            self.ledgers = {
                audit_key(layer): torch.zeros(shape, device=self.device) for layer in range(start, stop)
            }
        self.audit_checks = 0
        self.compute = StageCompute(
            module,
            t.optimizer,
            t.lr,
            t.momentum,
            t.weight_decay,
            rules,
            ledgers=self.ledgers,
            on_update=self._tag_updates,
        )
        self.pulls = needs_pulls(job.num_vws, get_aggregation(config.ps.aggregation))
        self.waits = [a.index for a in self.actions if a.kind == WAIT] if self.pulls else []
        self.dilator = device_dilator(job.slowdown, wall_clock=self.device.type == "cuda")
        # A CUDA block is timed to its end (a wait for the device) only where the dilator stretches it; else
        # the CPU queues work ahead, as a plain loop does, and at each push waits only for the wave's last
        # loss and the previous wave's work (docs/architecture.md#devices)
        self._sync_blocks = self.device.type == "cuda" and job.slowdown > 1.0
        link = config.network.link_gbps
        emulate_links = config.emulation.enabled and config.emulation.link_bandwidth
        self.links = {
            peer: LinkEmulator.for_link(
                emulate_links, link(job.gpus[job.stage], job.gpus[peer]), job.time_scale
            )
            for peer in (job.stage - 1, job.stage + 1)
            if 0 <= peer < job.num_stages
        }
        self.trace = TraceRecorder(f"vw{job.vw}", job.stage)
        self.profiler = (
            StageProfiler(job.profile, self.device, Path(job.run_dir) / "profile", f"vw{job.vw}-s{job.stage}")
            if job.profile is not None
            else None
        )
        self.trace.other_threads[PS_ROW + job.stage] = f"stage {job.stage} PS traffic"
        self.client_spec = ClientSpec(
            list(job.ps_endpoints),
            config.name,
            job.vw,
            job.stage,
            job.num_vws,
            job.num_stages,
            ps_placement(config, self.spec, job.num_vws if job.audit else 0, job.first_vw),
            timeout_s=config.ps.timeout_s,
            retry_s=min(5.0, config.ps.timeout_s / 4),
            curve=job.ps_keys,
            wire_dtype=config.ps.wire_dtype,
        )
        self.p2p: P2P | None = None
        self.link: ThreadLink | ProcessLink | None = None
        self.samples = 0
        self._targets: dict[int, torch.Tensor] = {}
        self.losses = LossReader(self.device)  # last stage: each minibatch's loss, read once a wave
        self._wave_queued: torch.cuda.Event | None = (
            None  # CUDA: recorded at the last PUSH, behind its wave's work
        )
        self._pushes: deque[tuple[int, Future]] = deque()  # (pinned slot, its push) in hand-over order
        self._pull: tuple[int, Future] | None = None  # the pull handed over, for WAIT of that wave
        self._next_wait = 0  # index into self.waits of the next WAIT to run
        self._pushed = job.start_wave  # waves handed over to the agent
        self.c_global = 0
        self.gaps: list[list[int]] = []  # from the last pull: waves some VW contributed nothing to (evicted)
        # seconds of this stage's own thread by part (recv: blocked for a neighbour's activation or gradient;
        # send: handing one over, the emulated link's delay included), and of its whole training loop
        self.times = dict.fromkeys(STAGE_PARTS, 0.0)
        self.train_s = 0.0
        self.dispatch: dict[str, Callable[[int], None]] = {
            "F": self.forward,
            "B": self.backward,
            "U": self.update,
            "PUSH": self.push,
            "WAIT": self.wait,
        }
        self.startup["built"] = time.time()

    # ---- lifecycle ----------------------------------------------------------------------------------
    def run(self) -> None:
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
        w0 = link.register(values, self.compute.kinds(), self.config.train.waves, job.start_wave, self.pulls)
        self.compute.load({k: torch.from_numpy(np.array(v)).to(self.device) for k, v in w0.items()})
        self.startup["registered"] = time.time()
        resend = self._resume() if job.resume_wave else {}
        self.push_staging = PushStaging(layout, self.device, link.push_slots)
        self.pull_staging = PullStaging(layout, self.device, link.pull_host) if self.pulls else None
        link.start(
            self.pull_staging.out if self.pull_staging else None,
            self.pull_staging.wait_free if self.pull_staging else None,
        )
        self.p2p = P2P.connect(
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
        self.started = time.monotonic()
        try:
            for p in sorted(
                resend
            ):  # sent before the checkpoint, not received by the next stage before its own
                self._send(resend[p], job.stage + 1)
            self._hand_over_pull()
            progress = link.progress  # what the agent's heartbeats report
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
            self._read_losses()  # a schedule that ends without a push (none of ours) still reports every loss
            self._sync()  # the device's last queued work is part of the run
            self.train_s = time.monotonic() - self.started
            for _, future in self._pushes:  # every push acknowledged before the stage reports done
                self._note_push(future.result())
        finally:
            link.close(timeout_s=30)
            self.p2p.close()
        try:
            if not link.wait_durable(self.config.ps.timeout_s, progress=self.position):
                print(
                    f"vw {job.vw} stage {job.stage}: the PS did not put the last pushes in a checkpoint "
                    f"within {self.config.ps.timeout_s:.0f} s; finishing anyway",
                    file=sys.stderr,
                    flush=True,
                )
        finally:
            link.shutdown()
        run_dir = Path(job.run_dir)
        totals = self.totals()
        self.trace.dump(
            run_dir / "trace" / f"vw{job.vw}-s{job.stage}.json",
            other={"times_s": totals, "waves": self.config.train.waves - job.start_wave},
        )
        if job.dump_weights:
            state = {
                k: t.detach().cpu().clone() for k, t in self.compute.values().items() if k not in self.ledgers
            }
            torch.save(state, run_dir / f"final-vw{job.vw}-s{job.stage}.pt")
        self.report(
            {
                "event": "stage_done",
                "vw": job.vw,
                "stage": job.stage,
                "time": time.time(),
                "audit_checks": self.audit_checks,
                "compute_s": round(self.dilator.compute_s, 3),
                "slept_s": round(self.dilator.slept_s, 3),
                "times_s": totals,
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
        job = self.job
        meta, tensors = self.compute.state_dict()
        runner = {
            "position": self.position + 1,
            "next_wait": self._next_wait,
            "pushed": self._pushed,
            "c_global": self.c_global,
            "samples": self.samples,
        }
        keep_from = snapshot_floor(self.c_global, job.snapshot_every, job.snapshot_keep)
        save_snapshot(
            snapshot_dir(job.run_dir, job.vw, job.stage),
            wave,
            {
                "vw": job.vw,
                "stage": job.stage,
                "run": self.config.name,
                "wave": wave,
                "compute": meta,
                "runner": runner,
            },
            tensors,
            keep_from,
        )

    def _resume(self) -> dict[int, torch.Tensor]:
        """Load this stage's snapshot of job.resume_wave; returns the activations to send the next stage
        again."""
        job, wave = self.job, self.job.resume_wave
        meta, tensors = load_snapshot(snapshot_dir(job.run_dir, job.vw, job.stage), wave)
        runner = meta["runner"]
        self.position = runner["position"]
        if self.position != cut_position(self.actions, wave):
            raise HetpipeError(
                f"vw {job.vw} stage {job.stage}: its snapshot of wave {wave} is at action "
                f"{self.position}, this run's schedule cuts there at {cut_position(self.actions, wave)}: "
                "resume with the config the run was started with"
            )
        self._next_wait, self._pushed = runner["next_wait"], runner["pushed"]
        self.c_global, self.samples = runner["c_global"], runner["samples"]
        in_flight = [entry["p"] for entry in meta["compute"]["in_flight"]]
        if self.last:
            self._targets = {p: self._batch(p)[1] for p in in_flight}
        resend: frozenset[int] = frozenset()
        if not self.last:
            following = self.schedule.stages[job.stage + 1]
            received = forwarded_before(following, cut_position(following, wave))
            resend = frozenset(p for p in in_flight if p not in received)
        return self.compute.load_state_dict(
            meta["compute"],
            {k: t.to(self.device) for k, t in tensors.items()},
            targets=self._targets,
            loss_fn=self.spec.loss,
            resend=resend,
        )

    def _batch(self, p: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = datalib.minibatch(
            self.x, self.y, self.indices, self.config.train.batch_size, self.config.seed, p
        )
        return datalib.on_device(x, y, self.device)

    def _send(self, tensor: Any, peer: int) -> None:
        started = time.perf_counter()
        if tensor is P2P.SKIPPED:
            self.p2p.send_skip(peer)
        else:
            self.links[peer].delay(tensor.numel() * tensor.element_size())  # emulated link (off by default)
            self.p2p.send(tensor, peer)
        self._timed("send", started)

    def _recv(self, peer: int) -> Any:
        started = time.perf_counter()
        received = self.p2p.recv(peer)
        self._timed("recv", started)
        return received

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _sync_block(self) -> None:
        if self._sync_blocks:
            self._sync()

    def _timed(self, what: str, started: float) -> None:
        self.times[what] += time.perf_counter() - started

    # ---- audit ----------------------------------------------------------------------------------------
    @torch.no_grad()
    def _tag_updates(self, minibatches: list[int]) -> None:
        for ledger in self.ledgers.values():
            for p in minibatches:
                ledger[self.job.vw, p] += 1.0

    def _check_ledgers(self, p: int) -> None:
        wsp = self.config.wsp
        own = own_through_required(self.schedule.guarantee, p, wsp.nm)
        for key, ledger in self.ledgers.items():
            problems = ledger_violations(
                ledger.cpu().numpy(),
                self.job.vw,
                p,
                wsp.nm,
                wsp.staleness,
                own,
                self.gaps,
                own_from=self.job.start_wave * wsp.nm,
            )
            if problems:
                raise AuditError(
                    f"vw {self.job.vw} stage {self.job.stage}, forward of minibatch {p}, {key}: "
                    + "; ".join(problems)
                )
            self.audit_checks += 1

    # ---- actions --------------------------------------------------------------------------------------
    def forward(self, p: int) -> None:
        job = self.job
        if self.ledgers:
            self._check_ledgers(p)
        with self.trace.span(f"F{p}"):
            if self.first:
                inputs, target = self._batch(p)
            else:
                inputs = self._recv(job.stage - 1)
                target = self._batch(p)[1] if self.last else None
            started = time.perf_counter()
            with self.dilator.compute(f"F{p}"):
                output = self.compute.forward(
                    p, inputs, target if self.last else None, self.spec.loss, input_grad=not self.first
                )
                self._sync_block()
            self._timed("compute", started)
            if not self.last:
                self._send(output, job.stage + 1)
            else:
                self._targets[p] = target

    def backward(self, p: int) -> None:
        job = self.job
        value = None
        with self.trace.span(f"B{p}"):
            grad = None if self.last else self._recv(job.stage + 1)
            skip = grad is P2P.SKIPPED
            target = self._targets.pop(p) if self.last else None
            unread = None
            if self.last:
                loss = self.compute.loss_of(p, target, self.spec.loss)
                if self.config.train.on_nan == "skip":  # skipping needs the value before the backward
                    value = float(loss)
                    skip = not np.isfinite(value)
                else:  # read at the wave's end: reading it now would make the CPU wait for the device
                    unread = {"event": "minibatch", "vw": job.vw, "p": p, "loss": None}
                    self.losses.add(
                        unread, loss
                    )  # (on CUDA its copy to the host goes before the backward's kernels)
            started = time.perf_counter()
            with self.dilator.compute(f"B{p}"):
                if skip:  # train.on_nan = "skip": the minibatch adds nothing, at every stage
                    self.compute.skip(p)
                    grad_in = P2P.SKIPPED
                else:
                    grad_in, _ = self.compute.backward(p, grad, target, self.spec.loss)
                self._sync_block()
            self._timed("compute", started)
            if not self.first:
                self._send(grad_in, job.stage - 1)
        self.samples += self.config.train.batch_size
        if self.last:
            elapsed = time.monotonic() - self.started
            fields = {
                "time": time.time(),
                "samples_per_s": self.samples / max(elapsed, 1e-9),
                "skipped": skip,
            }
            if unread is not None:
                unread.update(fields)  # reported once its loss is read
            else:
                self.report({"event": "minibatch", "vw": job.vw, "p": p, "loss": value, **fields})

    def _read_losses(self) -> None:
        """Report the wave's minibatch losses, read in one go (on CUDA one wait, for the copy of the last of
        them, not one per minibatch and not for the whole queue); under train.on_nan = "stop" a NaN or inf
        stops the run here, before the wave's push carries it."""
        for event, value in self.losses.read():
            if not np.isfinite(value):
                p, wave = event["p"], event["p"] // self.config.wsp.nm
                raise NonFiniteLoss(
                    f"vw {self.job.vw} stage {self.job.stage}: the loss of minibatch {p} (wave {wave}) "
                    f"is {value}; lower the learning rate, or check the data",
                    wave,
                )
            self.report({**event, "loss": value})

    def update(self, p: int) -> None:
        with self.trace.span(f"U{p}"):
            started = time.perf_counter()
            with self.dilator.compute(f"U{p}"):
                self.compute.update(p)
                self._sync_block()
            self._timed("compute", started)

    def push(self, wave: int) -> None:
        with self.trace.span(f"PUSH{wave}"):
            started = time.perf_counter()
            self._read_losses()  # on CUDA a wait for the device's last loss of the wave: counted as compute
            if (
                self._wave_queued is not None
            ):  # CUDA: the CPU runs at most a wave ahead of the device, not more
                self._wave_queued.synchronize()
            self._timed("compute", started)
            copies = self.push_staging.copies
            if self._next_wait >= len(self.waits) and not copies:
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
            self._pushed = wave + 1
            if self.device.type == "cuda":
                self._wave_queued = torch.cuda.Event(blocking=True)
                self._wave_queued.record()  # waited for at the next PUSH
        if self.compute.optimizer is not None or self.ledgers:
            # own sums the next pull will contain (or all, when no pull comes) are not needed any more
            ahead = self.waits[self._next_wait] if self._next_wait < len(self.waits) else None
            self.compute.forget(
                wave if ahead is None else min(wave, gate_version(ahead, self.config.wsp.staleness) - 1)
            )
        while self._pushes and self._pushes[0][1].done():
            self._note_push(self._pushes.popleft()[1].result())
        self._hand_over_pull()
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

    def _hand_over_pull(self) -> None:
        """Hand the next WAIT's pull to the agent as soon as our own pushes it needs are handed over."""
        if self._pull is not None or self._next_wait >= len(self.waits):
            return
        wave = self.waits[self._next_wait]
        if self._pushed >= gate_version(wave, self.config.wsp.staleness):  # own waves <= c - D - 2 are out
            self._pull = (wave, self.link.pull(wave))

    def wait(self, wave: int) -> None:
        if not self.pulls:
            return
        with self.trace.span(f"WAIT{wave}"):
            self._hand_over_pull()
            assert self._pull is not None and self._pull[0] == wave, (self._pull, wave)
            started = time.perf_counter()
            pulled = self._pull[1].result()
            self.gaps = pulled.gaps
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
            started = (
                time.perf_counter()
            )  # on CUDA the copy and the rebase are queued, not waited for (the agent
            self.compute.rebase(
                self.pull_staging.to_device(), pulled.own_through
            )  # waits for the copy instead),
            self._sync_block()  # unless emulation stretches blocks: then the next F must not carry this work
            self._timed("h2d", started)
        self._pull = None
        self._next_wait += 1
        self._hand_over_pull()


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
