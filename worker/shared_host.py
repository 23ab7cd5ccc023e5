"""Host buffers a stage shares with its PS agent process: two push slots, the pull buffer and a progress cell.

One file in /dev/shm (the temp folder where it has no room), mapped by both processes and unlinked as soon as
the agent has mapped it, so nothing is left behind when either process dies. Each buffer starts on a page
boundary; on CUDA the stage registers the mapping with the driver (page-locked, as pinned memory is), so its
device-to-host and host-to-device copies run asynchronously, as they do into buffers it allocates itself.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from hetpipe.core.errors import HetpipeError

__all__ = ["SharedHost", "shared_dir"]

PAGE = mmap.PAGESIZE
# two int64 cells: how many actions the stage has run (the agent's heartbeats report it), and the clock of the
# oldest checkpoint any PS shard keeps (the agent writes it, the stage keeps its snapshots from there)
PROGRESS_BYTES = PAGE


def _free_bytes(folder: Path) -> int:
    stat = os.statvfs(folder)
    return stat.f_bavail * stat.f_frsize


def shared_dir(nbytes: int, candidates: tuple[Path, ...] = (Path("/dev/shm"),)) -> Path:
    """Where a buffer file of `nbytes` goes: /dev/shm (memory, not disk) where it is writable and has room,
    else the temp folder. A file bigger than its filesystem's free space would kill the process that touches
    the missing pages (SIGBUS; a container's /dev/shm is often 64 MiB), so neither with too little room is
    used."""
    for folder in (*candidates, Path(tempfile.gettempdir())):
        if folder.is_dir() and os.access(folder, os.W_OK) and _free_bytes(folder) >= nbytes + (64 << 20):
            return folder
    raise HetpipeError(
        f"no room for the {nbytes >> 20} MiB a stage shares with its PS agent process in "
        f"{', '.join(str(c) for c in candidates)} or {tempfile.gettempdir()}: give the container a "
        "bigger /dev/shm (docker run --shm-size), point TMPDIR at a folder with room, or set "
        '`[ps] agent = "thread"`'
    )


def _pages(nbytes: int) -> int:
    return -(-nbytes // PAGE) * PAGE


@dataclass(frozen=True)
class _Layout:
    numel: int  # float32 elements of each push slot and of the pull buffer

    @property
    def slot_bytes(self) -> int:
        return _pages(max(4, 4 * self.numel))

    def offset(self, index: int) -> int:
        """Byte offset of buffer `index`: 0 and 1 the push slots, 2 the pull buffer."""
        return PROGRESS_BYTES + index * self.slot_bytes

    @property
    def size(self) -> int:
        return self.offset(3)


class SharedHost:
    """The mapped file: `slots` (two float32 arrays), `pull` (one), `progress` and `checkpoint_floor` (int64
    cells), all numpy views."""

    def __init__(self, path: Path, numel: int, create: bool) -> None:
        self.path, self.numel = path, numel
        layout = _Layout(numel)
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(path, flags, 0o600)
        try:
            if create:
                os.ftruncate(fd, layout.size)
            self._map = mmap.mmap(fd, layout.size)
        finally:
            os.close(fd)
        self.progress = np.frombuffer(self._map, np.int64, 1, 0)
        self.checkpoint_floor = np.frombuffer(self._map, np.int64, 1, 8)
        self.slots = [np.frombuffer(self._map, np.float32, numel, layout.offset(i)) for i in range(2)]
        self.pull = np.frombuffer(self._map, np.float32, numel, layout.offset(2))
        self._registered: list[int] = []

    @classmethod
    def create(cls, numel: int, name: str) -> SharedHost:
        """A new file for `numel` float32 values a buffer (`name` makes it recognisable: run, VW, stage,
        pid)."""
        safe = "".join(c if c.isalnum() or c in "-_" else "_" for c in name)
        folder = shared_dir(_Layout(numel).size)
        return cls(folder / f"hetpipe-{safe}-{os.getpid()}", numel, create=True)

    @classmethod
    def attach(cls, path: str | Path, numel: int) -> SharedHost:
        return cls(Path(path), numel, create=False)

    def unlink(self) -> None:
        """Remove the file (the mappings stay valid until closed)."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)

    def pin(self) -> bool:
        """Page-lock the mapping for CUDA copies (cudaHostRegister); False, with a note on stderr, if the
        driver refuses (a locked-memory limit): the copies then still work, synchronously."""
        import torch

        view = torch.frombuffer(self._map, dtype=torch.uint8)
        code = torch.cuda.cudart().cudaHostRegister(view.data_ptr(), view.numel(), 0)
        if int(code) != 0:
            print(
                f"hetpipe: cudaHostRegister of the PS buffers ({view.numel() >> 20} MiB) failed ({code}); "
                "the stage's copies to and from them will wait for the device. Raise `ulimit -l` to let "
                "them overlap",
                file=sys.stderr,
                flush=True,
            )
            return False
        self._registered.append(view.data_ptr())
        return True

    def close(self) -> None:
        """Unregister (CUDA) and unmap; the views must not be used afterwards."""
        if self._registered:
            import torch

            for ptr in self._registered:
                torch.cuda.cudart().cudaHostUnregister(ptr)
            self._registered = []
        self.progress = self.checkpoint_floor = self.pull = None  # type: ignore[assignment]
        self.slots = []
        with contextlib.suppress(
            BufferError
        ):  # a view is still alive somewhere: the mapping goes with the process
            self._map.close()
