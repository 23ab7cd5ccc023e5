"""One stage process of a virtual worker: runs its schedule's action list through a dispatch table.

F p: receive the input (stage 0: read minibatch p), forward, send the output on.
B p: receive the output gradient (last stage: from the loss), backward + local step, send the input grad.
PUSH c: push the wave's update sum to the PS.   WAIT c: gate, pull W_{c-D-1}, rebase.
Compute is stretched to the emulated GPU's speed; every action is traced and reported to the launcher.
"""

from __future__ import annotations

import os
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from hetpipe.compute import data as datalib
from hetpipe.compute.build import audit_shape, dataset_of, model_of, ps_placement
from hetpipe.compute.heap import keep_freed_memory
from hetpipe.compute.stage_compute import StageCompute
from hetpipe.core.audit import AuditError, audit_key, ledger_violations
from hetpipe.core.emulate import LinkEmulator, device_dilator
from hetpipe.core.metrics import TraceRecorder
from hetpipe.core.schedule import get_schedule
from hetpipe.models import build_stage
from hetpipe.worker.jobs import StageJob
from hetpipe.worker.p2p import P2P
from hetpipe.worker.ps_client import PSClient

__all__ = ["StageRunner", "run_stage"]


class StageRunner:
    """Owns one stage's compute, transport and PS client; `run()` executes the action list."""

    def __init__(self, job: StageJob, report: Callable[[dict[str, Any]], None]) -> None:
        self.job, self.report = job, report
        self.config = config = job.config
        self.device = torch.device(job.device)
        self.spec = model_of(config)
        self.first, self.last = job.stage == 0, job.stage == job.num_stages - 1
        dataset = dataset_of(config)
        self.x, self.y = dataset.train.x, dataset.train.y
        self.indices = datalib.shard_indices(len(self.y), job.num_vws, job.vw, config.seed)
        start, stop = job.layers
        module = build_stage(self.spec, start, stop, self.device)
        t = config.train
        self.ledgers: dict[str, torch.Tensor] = {}
        if job.audit:
            shape = audit_shape(config, job.num_vws)
            self.ledgers = {audit_key(layer): torch.zeros(shape, device=self.device) for layer in range(start, stop)}
        self.audit_checks = 0
        self.compute = StageCompute(
            module, t.optimizer, t.lr, t.momentum, t.weight_decay, nm=config.wsp.nm,
            weight_stashing=t.weight_stashing, extra=self.ledgers, on_step=self._tag_update,
        )
        self.schedule = get_schedule(t.schedule)(job.num_stages, config.wsp.nm, t.waves, config.wsp.staleness)
        self.dilator = device_dilator(job.slowdown)
        link = config.network.link_gbps
        emulate_links = config.emulation.enabled and config.emulation.link_bandwidth
        self.links = {
            peer: LinkEmulator.for_link(emulate_links, link(job.gpus[job.stage], job.gpus[peer]), job.time_scale)
            for peer in (job.stage - 1, job.stage + 1)
            if 0 <= peer < job.num_stages
        }
        self.trace = TraceRecorder(f"vw{job.vw}", job.stage)
        self.ps = PSClient(
            list(job.ps_endpoints), config.name, job.vw, job.stage, job.num_vws, job.num_stages,
            ps_placement(config, self.spec, job.num_vws if job.audit else 0), timeout_s=config.ps.timeout_s, retry_s=min(5.0, config.ps.timeout_s / 4),
        )
        self.p2p: P2P | None = None
        self.gate_wait_s = 0.0
        self.samples = 0
        self._targets: dict[int, torch.Tensor] = {}
        self.dispatch: dict[str, Callable[[int], None]] = {
            "F": self.forward, "B": self.backward, "PUSH": self.push, "WAIT": self.wait,
        }

    # ---- lifecycle ----------------------------------------------------------------------------------
    def run(self) -> None:
        job = self.job
        local = {k: t.detach().cpu().numpy() for k, t in self.compute.synced.items()}
        self.compute.load(self.ps.register(local, want_weights=True))  # every VW starts from the PS's W_0
        self.p2p = P2P.connect(job.stage, job.num_stages, job.p2p_host, job.p2p_port, self.device,
                               max_in_flight=self.config.wsp.nm + 1)
        self.started = time.monotonic()
        try:
            for action in self.schedule.stages[job.stage]:
                self.dispatch[action.kind](action.index)
        finally:
            self.p2p.close()
            self.ps.close()
        run_dir = Path(job.run_dir)
        self.trace.dump(run_dir / "trace" / f"vw{job.vw}-s{job.stage}.json")
        if job.dump_weights:
            state = {k: t.detach().cpu().clone() for k, t in self.compute.synced.items()}
            torch.save(state, run_dir / f"final-vw{job.vw}-s{job.stage}.pt")
        self.report({"event": "stage_done", "vw": job.vw, "stage": job.stage, "audit_checks": self.audit_checks,
                     "compute_s": round(self.dilator.compute_s, 3), "slept_s": round(self.dilator.slept_s, 3)})

    def _batch(self, p: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = datalib.minibatch(self.x, self.y, self.indices, self.config.train.batch_size, self.config.seed, p)
        return x.to(self.device), y.to(self.device)

    def _send(self, tensor: torch.Tensor, peer: int) -> None:
        self.links[peer].delay(tensor.numel() * tensor.element_size())  # emulated link (off by default)
        self.p2p.send(tensor, peer)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    # ---- audit ----------------------------------------------------------------------------------------
    @torch.no_grad()
    def _tag_update(self, p: int) -> None:
        for ledger in self.ledgers.values():
            ledger[self.job.vw, p] += 1.0

    def _check_ledgers(self, p: int) -> None:
        for key, ledger in self.ledgers.items():
            problems = ledger_violations(ledger.cpu().numpy(), self.job.vw, p, self.config.wsp.nm, self.config.wsp.staleness)
            if problems:
                raise AuditError(f"vw {self.job.vw} stage {self.job.stage}, forward of minibatch {p}, {key}: "
                                 + "; ".join(problems))
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
                inputs = self.p2p.recv(job.stage - 1)
                target = self._batch(p)[1] if self.last else None
            with self.dilator.compute(f"F{p}"):
                flight = self.compute.forward(p, inputs, target if self.last else None, self.spec.loss,
                                              input_grad=not self.first)
                self._sync()
            if not self.last:
                self._send(flight.output, job.stage + 1)
            if self.last:
                self._targets[p] = target

    def backward(self, p: int) -> None:
        job = self.job
        with self.trace.span(f"B{p}"):
            grad = None if self.last else self.p2p.recv(job.stage + 1)
            target = self._targets.pop(p) if self.last else None
            with self.dilator.compute(f"B{p}"):
                grad_in, loss = self.compute.backward(p, grad, target, self.spec.loss)
                self._sync()
            if not self.first:
                self._send(grad_in, job.stage - 1)
        self.samples += self.config.train.batch_size
        if self.last:
            elapsed = time.monotonic() - self.started
            self.report({"event": "minibatch", "vw": job.vw, "p": p, "loss": float(loss), "time": time.time(),
                         "samples_per_s": self.samples / max(elapsed, 1e-9)})

    def push(self, wave: int) -> None:
        with self.trace.span(f"PUSH{wave}"):
            c_global = self.ps.push(wave, self.compute.wave_update(wave))
        self.report({"event": "push", "vw": self.job.vw, "stage": self.job.stage, "wave": wave,
                     "c_global": c_global, "gate_wait_s": round(self.gate_wait_s, 3)})

    def wait(self, wave: int) -> None:
        if self.job.num_vws == 1:
            # One VW: the global weights hold nothing but this stage's own updates, which its live
            # weights already hold; pulling and rebasing would only re-round them. Skip the gate.
            return
        with self.trace.span(f"WAIT{wave}"):
            t0 = time.monotonic()
            pulled = self.ps.pull(wave)
            self.gate_wait_s += time.monotonic() - t0
            self.compute.rebase(pulled.tensors, pulled.own_through)


def run_stage(job: StageJob, events: Any = None) -> None:
    """Child-process entry point: one torch thread, run the stage, report failure with its traceback."""
    torch.set_num_threads(1)
    keep_freed_memory()
    report = events.put if events is not None else (lambda _msg: None)
    try:
        StageRunner(job, report).run()
    except BaseException as exc:
        report({"event": "stage_failed", "vw": job.vw, "stage": job.stage, "pid": os.getpid(),
                "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()})
        raise
