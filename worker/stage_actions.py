"""A stage's compute actions F, B and U: the input from the data or the previous stage, compute stretched to
the emulated GPU's speed, the output to the neighbour; and the last stage's losses, read once a wave."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from hetpipe.compute import data as datalib
from hetpipe.compute.losses import loss_function
from hetpipe.compute.stage_compute import StageCompute
from hetpipe.core.errors import HetpipeError
from hetpipe.core.hardware.emulate import device_dilator
from hetpipe.core.runs.metrics import TraceRecorder
from hetpipe.models import ModelSpec
from hetpipe.worker.jobs import StageJob
from hetpipe.worker.loss_reader import LossReader
from hetpipe.worker.p2p import P2P
from hetpipe.worker.stage_build import neighbour_links

__all__ = ["ComputeActions", "NonFiniteLoss"]


class NonFiniteLoss(HetpipeError):
    """A minibatch's loss came out NaN or infinite; the message names the stage, minibatch and wave."""

    def __init__(self, message: str, wave: int) -> None:
        super().__init__(message)
        self.wave = wave


class ComputeActions:
    """F p, B p and U p of one stage, with what they need: this VW's data shard, the neighbours (P2P, set
    once connected), the device's dilation and waits, the trace, and the stage's seconds by part (`times`:
    compute, recv, send)."""

    def __init__(
        self,
        job: StageJob,
        spec: ModelSpec,
        train: datalib.Split,
        shards: list[tuple[int, np.ndarray]],
        compute: StageCompute,
        trace: TraceRecorder,
        times: dict[str, float],
        report: Callable[[dict[str, Any]], None],
    ) -> None:
        self.job, self.config, self.spec, self.compute = job, job.config, spec, compute
        self.loss_fn = loss_function(job.config.train.loss)  # train.loss (hetpipe.compute.losses)
        self.trace, self.times, self.report = trace, times, report
        self.device = torch.device(job.device)
        self.first, self.last = job.stage == 0, job.stage == job.num_stages - 1
        self.x, self.y = train.x, train.y
        self.shards = shards  # this VW's shard of the training set from each wave on (datalib.span_shards)
        self.dilator = device_dilator(job.slowdown, wall_clock=self.device.type == "cuda")
        # A CUDA block is timed to its end (a wait for the device) only where the dilator stretches it; else
        # the CPU queues work ahead, as a plain loop does, and at each push waits only for the wave's last
        # loss and the previous wave's work (docs/architecture.md#devices)
        self._sync_blocks = self.device.type == "cuda" and job.slowdown > 1.0
        self.links = neighbour_links(job)
        self.p2p: P2P | None = None  # set once the stage has joined its VW's process group
        self.started = 0.0  # time.monotonic() at the first action (begin)
        self.samples = 0  # trained on by this VW since wave 0 (a resumed stage restores it)
        self.samples_at_start = 0  # of those, the ones before this process began
        self.targets: dict[int, torch.Tensor] = {}  # last stage: each forwarded minibatch's target, for its B
        self.losses = LossReader(self.device)  # last stage: each minibatch's loss, read once a wave

    # ---- the actions ----------------------------------------------------------------------------------
    def forward(self, p: int) -> None:
        """F p: the input (stage 0: minibatch p of the shard), forward, the output to the next stage."""
        job = self.job
        with self.trace.span(f"F{p}"):
            if self.first:
                inputs, target = self.batch(p)
            else:
                inputs = self.recv(job.stage - 1)
                target = self.batch(p)[1] if self.last else None
            # the samples' indices, for the frozen layers' cache (their input is a fixed function of them)
            cached = self.compute.frozen_cache.limit_bytes and self.compute.freezing.frozen_here(p)
            ids = self.sample_ids(p) if cached else None
            started = time.perf_counter()
            with self.dilator.compute(f"F{p}"):
                output = self.compute.forward(
                    p, inputs, target if self.last else None, self.loss_fn, input_grad=not self.first, ids=ids
                )
                self.sync_block()
            self._timed("compute", started)
            if not self.last:
                self.send(output, job.stage + 1)
            else:
                self.targets[p] = target

    def backward(self, p: int) -> None:
        """B p: the output gradient (last stage: from the loss), backward, the input gradient to the previous
        stage; the last stage reports the minibatch (its loss once read: read_losses)."""
        job = self.job
        value = None
        with self.trace.span(f"B{p}"):
            # a stage all frozen in p's wave gets no output gradient (train.freeze: both ends know it)
            grad = (
                None if self.last or not self.compute.freezing.runs_backward(p) else self.recv(job.stage + 1)
            )
            skip = grad is P2P.SKIPPED
            target = self.targets.pop(p) if self.last else None
            unread = None
            if self.last:
                loss = self.compute.loss_of(p, target, self.loss_fn)
                if self.config.train.on_nan == "skip":  # skipping needs the value before the backward
                    value = float(loss)
                    skip = not np.isfinite(value)
                else:  # read at the wave's end: reading it now would make the CPU wait for the device
                    unread = {"event": "minibatch", "vw": job.vw, "p": p, "loss": None}
                    # (on CUDA its copy to the host goes before the backward's kernels)
                    self.losses.add(unread, loss)
            started = time.perf_counter()
            with self.dilator.compute(f"B{p}"):
                if skip:  # train.on_nan = "skip": the minibatch adds nothing, at every stage
                    self.compute.skip(p)
                    grad_in = P2P.SKIPPED
                else:
                    grad_in, _ = self.compute.backward(p, grad, target, self.loss_fn)
                self.sync_block()
            self._timed("compute", started)
            if not self.first and self.compute.freezing.sends_input_gradient(p):
                self.send(grad_in, job.stage - 1)
        self.samples += self.config.train.batch_size
        if self.last:
            fields = {
                "time": time.time(),
                "samples_per_s": self.samples_per_s(time.monotonic()),
                "batch": self.config.train.batch_size,
                "skipped": skip,
            }
            if unread is not None:
                unread.update(fields)  # reported once its loss is read
            else:
                self.report({"event": "minibatch", "vw": job.vw, "p": p, "loss": value, **fields})

    def begin(self, now: float) -> None:
        """Start this process's samples/s clock: a resumed stage's restored samples are not this run's."""
        self.started, self.samples_at_start = now, self.samples

    def samples_per_s(self, now: float) -> float:
        return (self.samples - self.samples_at_start) / max(now - self.started, 1e-9)

    def update(self, p: int) -> None:
        """U p: the optimizer step (or, where the PS runs the optimizer, the gradient into the wave's sum)."""
        with self.trace.span(f"U{p}"):
            started = time.perf_counter()
            with self.dilator.compute(f"U{p}"):
                self.compute.update(p)
                self.sync_block()
            self._timed("compute", started)

    def read_losses(self) -> None:
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

    # ---- data, neighbours, device -----------------------------------------------------------------------
    def batch(self, p: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Minibatch p of this VW's shard (in p's wave), on the device."""
        x, y = datalib.minibatch(
            self.x, self.y, self._shard(p), self.config.train.batch_size, self.config.seed, p
        )
        return datalib.on_device(x, y, self.device)

    def sample_ids(self, p: int) -> list[int]:
        """The training-set indices of minibatch p's samples."""
        return datalib.minibatch_indices(
            self._shard(p), self.config.train.batch_size, self.config.seed, p
        ).tolist()

    def _shard(self, p: int) -> np.ndarray:
        wave = p // self.config.wsp.nm
        return next(ix for first, ix in reversed(self.shards) if first <= wave)

    def send(self, tensor: Any, peer: int) -> None:
        """Hand an activation or gradient (or P2P.SKIPPED) to stage `peer`, through its emulated link."""
        started = time.perf_counter()
        if tensor is P2P.SKIPPED:
            self.p2p.send_skip(peer)
        else:
            self.links[peer].delay(tensor.numel() * tensor.element_size())  # emulated link (off by default)
            self.p2p.send(tensor, peer)
        self._timed("send", started)

    def recv(self, peer: int) -> Any:
        """The next activation or gradient from stage `peer` (blocks until it is there)."""
        started = time.perf_counter()
        received = self.p2p.recv(peer)
        self._timed("recv", started)
        return received

    def sync(self) -> None:
        """Wait until the device has done the work queued on it (CUDA; nothing on the CPU)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def sync_block(self) -> None:
        """At the end of a block the dilator stretches on CUDA: wait for its work (docs/emulation.md)."""
        if self._sync_blocks:
            self.sync()

    def _timed(self, what: str, started: float) -> None:
        self.times[what] += time.perf_counter() - started
