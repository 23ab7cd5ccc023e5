"""Moving a stage's PS tensors between its device and the wire (docs/architecture.md#the-ps-path).

Push: on CUDA the wave's tensors are packed into one flat device buffer and copied to host memory in one
device-to-host copy into a pinned buffer (two, used in turn, so the next wave's copy need not wait for the
last push to leave), on a stream of its own, so the copy overlaps the next wave's compute; on the CPU the
tensors go out as they are, zero-copy. Pull: the agent copies the received frames into one flat host
buffer; on CUDA one host-to-device copy then brings it over, queued, and the agent copies the next pull into
the buffer only once that copy has left it (`wait_free`), so the stage need not wait for it. The host buffers'
per-key arrays are made once, and device buffers are cut into per-key views in one split: a few hundred slices
a wave, made one by one in Python, are host time a plain loop does not spend. Both copies signal blocking CUDA
events: their waiter (a thread beside the stage's, or the agent's side) sleeps until the copy is done, where a
default event's synchronize spins on a core, calling into the driver, for as long as the copy is queued behind
the wave's compute.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import numpy as np
import torch
from torch import Tensor

from hetpipe.worker.flat_layout import FlatLayout

__all__ = ["PullStaging", "PushStaging"]


def _flat_float(t: Tensor) -> Tensor:
    return t.reshape(-1) if t.dtype == torch.float32 else t.float().reshape(-1)


def _host_buffer(numel: int, pinned: bool) -> Tensor:
    return torch.empty(numel, dtype=torch.float32, pin_memory=pinned)


class PushStaging:
    """Host copies of what a stage pushes; `ready()` of a staged push blocks until its copy has landed.

    `slots`: two host buffers to stage into (those the stage shares with its PS agent process); without them a
    CUDA stage allocates two pinned ones, and a CPU stage's arrays are its tensors themselves (zero-copy)."""

    def __init__(self, layout: FlatLayout, device: torch.device, slots: list[Tensor] | None = None) -> None:
        self.layout = layout
        self.device = device
        self.cuda = device.type == "cuda"
        self._slots = (
            slots
            if slots is not None
            else [_host_buffer(layout.numel, True) for _ in range(2)]
            if self.cuda
            else []
        )
        self._arrays = [layout.array_views(host.numpy()) for host in self._slots]
        self._stream = torch.cuda.Stream(device) if self.cuda else None  # the copies, beside the compute
        self._turn = 0

    def stage(
        self, tensors: Mapping[str, Tensor], wait_for_slot: Callable[[int], None]
    ) -> tuple[dict[str, np.ndarray], Callable[[], None]]:
        """Host arrays of `tensors` (float32, by key) and a function that returns once they hold the values.
        `wait_for_slot(slot)` blocks until the push that used that pinned buffer before is done."""
        if not self._slots:
            arrays = {k: t.detach().float().numpy() for k, t in tensors.items()}
            return arrays, lambda: None
        slot = self._turn
        self._turn = 1 - self._turn
        wait_for_slot(slot)
        host = self._slots[slot]
        if not self.layout.keys:  # a stage whose layers are all frozen pushes nothing
            return {}, lambda: None
        if not self.cuda:  # into the shared slot, in one pass
            with torch.no_grad():
                torch.cat([_flat_float(tensors[k]) for k in self.layout.keys], out=host)
            return dict(self._arrays[slot]), lambda: None
        with torch.no_grad():  # one call per tensor, not three: host time a plain loop does not spend
            flat = torch.cat([_flat_float(tensors[k]) for k in self.layout.keys])
        assert self._stream is not None
        self._stream.wait_stream(
            torch.cuda.current_stream(self.device)
        )  # after the wave's updates and the cat
        with torch.cuda.stream(self._stream):
            host.copy_(flat, non_blocking=True)  # the one device-to-host copy of this wave
            copied = torch.cuda.Event(
                blocking=True
            )  # its waiter sleeps, not spins on a core beside the stage's
            copied.record(self._stream)
        flat.record_stream(
            self._stream
        )  # its memory is not reused by the compute before the copy has read it
        return dict(self._arrays[slot]), copied.synchronize

    @property
    def copies(self) -> bool:
        """Whether a push is staged into host buffers (a copy the stage may change meanwhile), not
        zero-copy."""
        return bool(self._slots)

    @property
    def slot(self) -> int:
        """The pinned buffer the last stage() used (for the caller's bookkeeping of which push holds it)."""
        return 1 - self._turn


class PullStaging:
    """The host buffer a pull is copied into (by the agent) and its trip to the device; `host`: a buffer to
    use (the one the stage shares with its PS agent process), else one is allocated (pinned on CUDA)."""

    def __init__(self, layout: FlatLayout, device: torch.device, host: Tensor | None = None) -> None:
        self.layout = layout
        self.device = device
        self.host = host if host is not None else _host_buffer(layout.numel, device.type == "cuda")
        self.out = layout.array_views(self.host.numpy())  # where the agent copies to
        self._copied: torch.cuda.Event | None = None  # CUDA: the last host-to-device copy out of self.host

    def to_device(self) -> dict[str, Tensor]:
        """The pulled tensors on the stage's device: views of the host buffer (CPU) or of one device copy
        (queued, not waited for)."""
        if self.device.type != "cuda":
            return self.layout.views(self.host)
        flat = self.host.to(self.device, non_blocking=True)  # the one host-to-device copy of this pull
        self._copied = torch.cuda.Event(blocking=True)  # waited for by the agent's side: sleep, do not spin
        self._copied.record()
        return self.layout.views(flat)

    def wait_free(self) -> None:
        """Block until the host buffer may be written again (an agent thread calls it before copying a pull
        in; an agent process is sent the pull only once it returns)."""
        if self._copied is not None:
            self._copied.synchronize()
