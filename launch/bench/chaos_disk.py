"""A small disk to fill, for chaos.py --fault full-disk: a tmpfs mounted on one of a run's directories (root
only), a filler file that takes every byte left on it, and the temporary files a writer left behind."""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

FILLER = ".chaos-filler"


def can_mount() -> str | None:
    """None when this process may mount a tmpfs; else why not."""
    if os.geteuid() != 0:
        return "--fault full-disk mounts a small tmpfs for the run to fill: run it as root"
    return None


@contextlib.contextmanager
def small_disk(path: Path, size_mib: int) -> Iterator[Path]:
    """Mount a tmpfs of `size_mib` MiB on `path` (made empty) for the duration; unmounts it after (lazily:
    a process of the run may still hold a file there)."""
    path.mkdir(parents=True, exist_ok=True)
    if any(path.iterdir()):
        raise SystemExit(f"chaos: {path} is not empty: a small disk is mounted on an empty directory only")
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_mib}m", "tmpfs", str(path)], check=True)
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def fill(disk: Path) -> int:
    """Write zeros to disk/FILLER until the disk is full; the bytes written."""
    written = 0
    block = b"\0" * (1 << 20)
    with open(disk / FILLER, "wb", buffering=0) as f:
        while True:
            try:
                written += f.write(block)
            except OSError:
                break
    with contextlib.suppress(OSError), open(disk / FILLER, "ab", buffering=0) as f:  # what 4 KiB still finds
        while f.write(b"\0" * 4096):
            written += 4096
    return written


def free(disk: Path) -> None:
    (disk / FILLER).unlink(missing_ok=True)


def temporaries(root: Path) -> list[str]:
    """Files a writer left half-written under root (`*.tmp`), as paths relative to root."""
    return sorted(str(p.relative_to(root)) for p in root.rglob("*.tmp"))
