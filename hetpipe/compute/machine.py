"""This machine as a profile records it: its CPU model, a host fingerprint and its load. No torch, no raw
hostname."""

from __future__ import annotations

import hashlib
import os
import platform
import socket
from pathlib import Path

__all__ = ["cpu_model", "host_fingerprint", "load_per_core"]


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (Linux), else what platform knows, else "unknown CPU"."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() in ("model name", "Model", "Hardware") and value.strip():
                return value.strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def host_fingerprint() -> str:
    """16 hex digits of sha256(hostname, CPU model, core count): tells machines apart without naming them."""
    text = f"{socket.gethostname()}\n{cpu_model()}\n{os.cpu_count()}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def load_per_core() -> float | None:
    """The 1-minute load average over this process's cores (threads running or waiting per core); None where
    the OS has no load average."""
    from hetpipe.core.hardware.emulate import cpu_cores

    try:
        return os.getloadavg()[0] / cpu_cores()
    except (AttributeError, OSError):
        return None
