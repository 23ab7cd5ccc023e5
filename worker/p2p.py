"""Point-to-point tensors between the stages of one virtual worker (torch.distributed: gloo or NCCL).

NCCL when every stage has a CUDA device of its own; gloo otherwise
(hetpipe.core.hardware.devices.p2p_backend), and then a CUDA tensor travels through host memory: copied to a
pinned host buffer, sent, and copied to the receiver's device. That is what lets several stages share one GPU,
which NCCL refuses.

Sends are non-blocking (isend) so a stage never waits for its neighbour to post a receive; receives
block. Each tensor goes as a small int64 header (ndim, shape) and then its data, so receivers need not
know shapes in advance. Plain send/recv only: batch_isend_irecv has hung on gloo (pytorch #132644).

A sent tensor must stay alive until its send completes, and gloo's Work.is_completed() stays False until
wait() is called, so sends are kept per peer and the oldest are waited for once more than
`max_in_flight` minibatches' worth are outstanding. With 1F1B and Nm minibatches in flight, by the time
a stage sends for minibatch p + Nm its neighbour has already received everything it sent for minibatches
<= p (it needed them to get this far), so those waits return at once: connect with max_in_flight = Nm + 1.
"""

from __future__ import annotations

import datetime
import errno
import os
import socket
from collections import deque
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
import torch.distributed as dist

from hetpipe.core.errors import HetpipeError

__all__ = ["P2P"]

MAX_NDIM = 8
SKIP_NDIM = MAX_NDIM + 1  # a header with this ndim carries no tensor: the minibatch was skipped
DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


@dataclass
class P2P:
    """One process's end of its VW's process group (rank = stage index)."""

    rank: int
    world_size: int
    device: torch.device
    backend: str = "gloo"
    max_in_flight: int = 8  # minibatches' sends per peer that may be outstanding; older ones are waited for
    _pending: dict[int, deque[tuple[dist.Work, torch.Tensor]]] = field(default_factory=dict)
    bytes_sent: int = 0

    @staticmethod
    def rendezvous_store(
        rank: int, world_size: int, host: str, port: int, timeout_s: float = 300
    ) -> dist.Store:
        """The VW's rendezvous store: rank 0 (stage 0) serves it on host:port, the others connect to it.

        Stage 0 makes its store as soon as it starts, before its data and its PS registration: a stage that
        asked before the store listened would retry with backoff (measured here: up to 0.7 s)."""
        timeout = datetime.timedelta(seconds=timeout_s)
        if rank == 0:
            # torch's TCPStore server listens on every interface; handed a socket bound to `host`, it
            # listens there only (a rendezvous open to any address took set/get from anyone)
            listener = _listen(host, port)
            bound = listener.getsockname()[1]
            fd = listener.detach()  # the store owns the descriptor from here and closes it
            try:
                return dist.TCPStore(
                    host,
                    bound,
                    world_size,
                    is_master=True,
                    timeout=timeout,
                    wait_for_workers=False,
                    master_listen_fd=fd,
                )
            except BaseException:
                os.close(fd)
                raise
        return dist.TCPStore(host, port, world_size, is_master=False, timeout=timeout)

    @classmethod
    def connect(
        cls,
        rank: int,
        world_size: int,
        host: str,
        port: int,
        device: torch.device,
        timeout_s: float = 300,
        max_in_flight: int = 8,
        backend: str = "gloo",
        store: dist.Store | None = None,
    ) -> P2P:
        """Join the VW's process group; stage 0 hosts the rendezvous on host:port (`store`: one made earlier
        by rendezvous_store)."""
        if max_in_flight < 1:
            raise ValueError(f"max_in_flight must be >= 1, got {max_in_flight}: pass Nm + 1")
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"backend must be gloo or nccl, got {backend!r}")
        if world_size > 1:
            if backend == "nccl":
                torch.cuda.set_device(device)
            if store is None:
                store = cls.rendezvous_store(rank, world_size, host, port, timeout_s)
            dist.init_process_group(
                backend,
                store=store,
                rank=rank,
                world_size=world_size,
                timeout=datetime.timedelta(seconds=timeout_s),
            )
        return cls(rank, world_size, device, backend, max_in_flight)

    SKIPPED: ClassVar[object] = (
        object()
    )  # what recv returns for a minibatch the sender skipped (train.on_nan)

    def send_skip(self, dst: int) -> None:
        """Tell `dst` that this minibatch is skipped: a header alone, with ndim = SKIP_NDIM."""
        header = torch.zeros(MAX_NDIM + 2, dtype=torch.int64, device=self._wire_device)
        header[0] = SKIP_NDIM
        self._pending.setdefault(dst, deque()).append((dist.isend(header, dst), header))

    @property
    def _wire_device(self) -> torch.device:
        """Where tensors travel from: the stage's device for NCCL, host memory for gloo."""
        return self.device if self.backend == "nccl" else torch.device("cpu")

    def send(self, tensor: torch.Tensor, dst: int) -> None:
        tensor = tensor.detach().contiguous()
        if tensor.dim() > MAX_NDIM or tensor.dtype not in DTYPES:
            raise ValueError(f"cannot send a {tensor.dtype} tensor of {tensor.dim()} dims between stages")
        if tensor.device != self._wire_device:  # gloo from a GPU: through a pinned host buffer
            staged = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            tensor = staged.copy_(tensor)
        header = torch.tensor(
            [tensor.dim(), DTYPES.index(tensor.dtype), *tensor.shape, *([0] * (MAX_NDIM - tensor.dim()))],
            dtype=torch.int64,
            device=self._wire_device,
        )
        pending = self._pending.setdefault(dst, deque())
        for t in (header, tensor):
            pending.append((dist.isend(t, dst), t))
        self.bytes_sent += tensor.numel() * tensor.element_size()
        while len(pending) > 2 * self.max_in_flight:  # two sends (header, data) per tensor
            work, _ = pending.popleft()
            work.wait()

    def recv(self, src: int) -> Any:
        header = torch.empty(MAX_NDIM + 2, dtype=torch.int64, device=self._wire_device)
        dist.recv(header, src)
        ndim, dtype_index = int(header[0]), int(header[1])
        if ndim == SKIP_NDIM:
            return P2P.SKIPPED
        shape = [int(d) for d in header[2 : 2 + ndim]]
        pinned = self._wire_device != self.device
        out = torch.empty(shape, dtype=DTYPES[dtype_index], device=self._wire_device, pin_memory=pinned)
        dist.recv(out, src)
        return out.to(self.device, non_blocking=True) if pinned else out

    @property
    def outstanding(self) -> int:
        """Sends not yet waited for, over all peers."""
        return sum(len(pending) for pending in self._pending.values())

    def close(self) -> None:
        """Wait for every send to complete, then leave the group."""
        for pending in self._pending.values():
            for work, _ in pending:
                work.wait()
        self._pending.clear()
        if self.world_size > 1 and dist.is_initialized():
            dist.destroy_process_group()


def _listen(host: str, port: int) -> socket.socket:
    """A listening TCP socket bound to host:port (port 0: any free one), for the rendezvous store."""
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(socket.SOMAXCONN)
    except OSError as exc:
        sock.close()
        if exc.errno != errno.EADDRINUSE:
            raise HetpipeError(
                f"stage 0 cannot serve its virtual worker's rendezvous on {host}:{port}: {exc}; check the "
                "VW's host in the config (it must be an address of this machine)"
            ) from None
        raise HetpipeError(
            f"stage 0 cannot serve its virtual worker's rendezvous on {host}:{port}: the port is in "
            "use on this machine. `hetpipe worker` uses ps.port + 100 + vw: choose another [ps] "
            "port, or stop what holds this one"
        ) from None
    return sock
