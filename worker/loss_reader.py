"""The last stage's minibatch losses, read once a wave without draining the device
(docs/architecture.md#devices).

On CUDA each loss is copied into pinned host memory just before its backward is queued (the copy is queued
too, ahead of the backward's kernels, and nothing waits for it), and the wave's read waits only for the last
of those copies: the device still has the last backward and update queued while the stage reads the values,
checks them and stages its push, so it does not sit idle while the CPU catches up, as it would after a full
synchronize. On the CPU the losses are values already and are read as they are.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

__all__ = ["LossReader"]


class LossReader:
    """add() each minibatch's loss (a 0-d tensor on `device`) with its event; read() gives the (event, value)
    pairs added since the last read, in order."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self._events: list[dict[str, Any]] = []
        self._losses: list[Tensor] = []  # CPU: the losses themselves
        self._host = torch.empty(16, dtype=torch.float32, pin_memory=self.cuda)  # CUDA: where the copies land
        self._copied = torch.cuda.Event(blocking=True) if self.cuda else None  # after the last copy queued

    def __len__(self) -> int:
        return len(self._events)

    def add(self, event: dict[str, Any], loss: Tensor) -> None:
        if self.cuda:
            slot = len(self._events)
            if slot == len(self._host):  # more minibatches than slots before a read: a bigger buffer, once
                self._wait()  # the old buffer's copies have landed before they move
                grown = torch.empty(2 * slot, dtype=torch.float32, pin_memory=True)
                grown[:slot] = self._host
                self._host = grown
            self._host[slot].copy_(loss.detach().float(), non_blocking=True)
            assert self._copied is not None
            self._copied.record(torch.cuda.current_stream(loss.device))  # the stream the copy was queued on
        else:
            self._losses.append(loss.detach())
        self._events.append(event)

    def read(self) -> list[tuple[dict[str, Any], float]]:
        """The losses added since the last read, as floats (on CUDA once their copies have landed)."""
        if not self._events:
            return []
        if self.cuda:
            self._wait()
            values = self._host[: len(self._events)].tolist()
        else:
            values = torch.stack([loss.float() for loss in self._losses]).tolist()
        pairs = list(zip(self._events, values, strict=True))
        self._events, self._losses = [], []
        return pairs

    def _wait(self) -> None:
        if self._copied is not None:
            self._copied.synchronize()
