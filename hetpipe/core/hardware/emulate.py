"""Heterogeneous GPUs emulated on CPU by time dilation: per-device slowdowns, compute dilator, link delays."""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass

from hetpipe.core.config.schema import ClusterConfig
from hetpipe.core.errors import HetpipeError

__all__ = [
    "CORE_SHARE",
    "DilatedBlock",
    "Dilator",
    "device_dilator",
    "EmulationError",
    "LinkEmulator",
    "auto_time_scale",
    "cpu_cores",
    "gpu_speeds",
    "link_delay_s",
    "slowdowns",
    "usable_cores",
]

# Share of the machine's cores the emulated devices may keep busy together. The rest is left to the
# parameter server, the launcher and the progress view, which are mostly idle but must answer promptly
# (a PS that waits for a core stretches every push and pull). Each emulated device is one process
# running one compute thread, so a device that is busy 1/slowdown of the time uses 1/slowdown cores.
CORE_SHARE = 0.75


class EmulationError(HetpipeError):
    """Emulation settings that cannot be honoured on this machine; the message says what to change."""

    exit_code = 2


# ---------------------------------------------------------------------------------------------- slowdowns


def cpu_cores() -> int:
    """Cores this process may run on (its affinity mask where the OS has one), at least 1."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)


def usable_cores(cores: int) -> float:
    """Cores the emulated devices may use together: CORE_SHARE of the machine."""
    if cores < 1:
        raise EmulationError(f"cores must be >= 1, got {cores}: pass cpu_cores() or a positive count")
    return CORE_SHARE * cores


def gpu_speeds(config: ClusterConfig) -> dict[str, float]:
    """Speed of every GPU of the cluster by reference ("n0:1"), the input of slowdowns()."""
    return {str(ref): config.gpu(ref).speed for ref in config.all_gpus()}


def auto_time_scale(speeds: Mapping[str, float], cores: int) -> float:
    """Smallest time_scale >= 1 with sum over devices of 1/slowdown <= usable_cores(cores).

    With relative slowdown r_g = fastest / speed_g and slowdown_g = r_g * time_scale, the devices
    together keep sum(1 / r_g) / time_scale cores busy, so time_scale = max(1, sum(1 / r_g) / usable).
    """
    relative = _relative(speeds)
    demand = sum(1.0 / r for r in relative.values())
    return max(1.0, demand / usable_cores(cores))


def slowdowns(speeds: Mapping[str, float], cores: int, time_scale: float | None) -> dict[str, float]:
    """Slowdown of each emulated GPU: (fastest speed / its speed) * time_scale; None means auto_time_scale.

    A slowdown of s means a block that takes t seconds on this CPU takes s * t when emulated, so the
    fastest type runs at time_scale times this CPU's own duration. Pure.
    """
    if time_scale is None:
        time_scale = auto_time_scale(speeds, cores)
    elif not (math.isfinite(time_scale) and time_scale >= 1.0):
        raise EmulationError(
            f"time_scale = {time_scale} would ask the fastest GPU type to run faster than this CPU runs it: "
            'set time_scale to a number >= 1 under [emulation], or "auto"'
        )
    return {ref: r * time_scale for ref, r in _relative(speeds).items()}


def _relative(speeds: Mapping[str, float]) -> dict[str, float]:
    """fastest / speed for each device (1.0 for the fastest type)."""
    for ref, speed in speeds.items():
        if not (math.isfinite(speed) and speed > 0):
            raise EmulationError(f"GPU {ref} has speed {speed}: give its type a speed > 0 under [gpu_types]")
    if not speeds:
        return {}
    fastest = max(speeds.values())
    return {ref: fastest / speed for ref, speed in speeds.items()}


# ---------------------------------------------------------------------------------------------- compute


@dataclass(frozen=True)
class DilatedBlock:
    """One dilated block: its name ("F3"), measured compute time and the time slept after it, in seconds."""

    name: str
    compute_s: float
    slept_s: float


class Dilator:
    """Stretches blocks of compute to `slowdown` times their measured duration by sleeping after each.

    Usage in a stage executor:

        with tracer.span("F3"), dilator.compute("F3"):
            out = stage(x)
            if on_cuda:
                torch.cuda.synchronize()   # the caller's job: the block must end when the GPU is done

    The block's time t is measured with `clock`; leaving the block sleeps (slowdown - 1) * t. With
    `cpu_clock` (the stages pass time.thread_time), t is the CPU time the block used and the sleep tops its
    wall time up to slowdown * t: time spent waiting for a core under contention then counts against the
    sleep instead of being multiplied by it, so an emulated device keeps its speed on a busy machine
    (as long as the devices together fit the cores; see auto_time_scale). Sleeps that overshoot (the OS wakes
    late) are paid back from the next sleeps, so the long-run dilation stays exact even when single sleeps are
    not. A block that raises is not dilated. slowdown == 1 (emulation off, or the fastest type at
    time_scale 1) never sleeps.
    """

    def __init__(
        self,
        slowdown: float,
        clock: Callable[[], float] = time.perf_counter,
        sleep: Callable[[float], None] = time.sleep,
        cpu_clock: Callable[[], float] | None = None,
    ) -> None:
        if not (math.isfinite(slowdown) and slowdown >= 1.0):
            raise EmulationError(
                f"slowdown must be a finite number >= 1, got {slowdown}: a device cannot be emulated faster "
                "than this CPU runs it (use slowdowns() to compute it)"
            )
        self.slowdown = slowdown
        self._clock = clock
        self._sleep = sleep
        self._cpu_clock = cpu_clock
        self._debt = 0.0  # sleep owed (> 0) or overslept (< 0) by earlier blocks
        self.compute_s = 0.0
        self.slept_s = 0.0
        self.count = 0
        self.last: DilatedBlock | None = None

    @property
    def wall_s(self) -> float:
        """Total time spent in dilated blocks, compute plus sleep."""
        return self.compute_s + self.slept_s

    @contextmanager
    def compute(self, name: str) -> Iterator[None]:
        """Run the block, then sleep so that it takes slowdown times its measured time."""
        start = self._clock()
        cpu_start = self._cpu_clock() if self._cpu_clock else 0.0
        yield
        wall_s = self._clock() - start
        compute_s = self._cpu_clock() - cpu_start if self._cpu_clock else wall_s
        slept_s = self._dilate(compute_s, wall_s)
        self.compute_s += compute_s
        self.slept_s += slept_s
        self.count += 1
        self.last = DilatedBlock(name, compute_s, slept_s)

    def _dilate(self, compute_s: float, wall_s: float) -> float:
        if self.slowdown == 1.0:
            return 0.0
        due = self.slowdown * compute_s - wall_s + self._debt
        if due <= 0.0:
            self._debt = due
            return 0.0
        start = self._clock()
        self._sleep(due)
        slept_s = self._clock() - start
        self._debt = due - slept_s
        return slept_s


def device_dilator(slowdown: float, wall_clock: bool = False) -> Dilator:
    """The emulation wrapper of one emulated device, the same for hetpipe's stages and for every benchmark
    peer: dilation on the thread's CPU time (see Dilator), so a busy machine slows all of them alike. On a
    GPU (`wall_clock`) the block is timed on the wall clock, ending when the device is done (the caller
    synchronizes), since the work is not the thread's CPU time."""
    return Dilator(slowdown) if wall_clock else Dilator(slowdown, cpu_clock=time.thread_time)


# ---------------------------------------------------------------------------------------------- links


def link_delay_s(nbytes: int, gbps: float) -> float:
    """Seconds to move nbytes over a link of gbps Gbit/s: nbytes * 8 / (gbps * 1e9)."""
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes}")
    if not (math.isfinite(gbps) and gbps > 0):
        raise EmulationError(f"link bandwidth must be > 0 Gbit/s, got {gbps}: fix it under [network]")
    return nbytes * 8 / (gbps * 1e9)


class LinkEmulator:
    """Delays each transfer by the time it would take on a link of `gbps` Gbit/s; gbps None: off.

    Off unless EmulationConfig.link_bandwidth (see `for_link`). `time_scale` stretches the delay like
    compute is stretched, so the compute/communication ratio of the emulated cluster is kept.
    """

    def __init__(
        self, gbps: float | None, time_scale: float = 1.0, sleep: Callable[[float], None] = time.sleep
    ) -> None:
        if gbps is not None:
            link_delay_s(0, gbps)  # validates gbps
        self.gbps = gbps
        self.time_scale = time_scale
        self._sleep = sleep
        self.nbytes = 0
        self.delayed_s = 0.0

    @classmethod
    def for_link(
        cls,
        link_bandwidth: bool,
        gbps: float,
        time_scale: float = 1.0,
        sleep: Callable[[float], None] = time.sleep,
    ) -> LinkEmulator:
        """A link as the config asks: emulated when EmulationConfig.link_bandwidth, else off."""
        return cls(gbps if link_bandwidth else None, time_scale, sleep)

    @property
    def enabled(self) -> bool:
        return self.gbps is not None

    def delay(self, nbytes: int) -> float:
        """Sleep as long as nbytes take on this link (nothing when off); returns the seconds asked for."""
        if self.gbps is None:
            return 0.0
        seconds = link_delay_s(nbytes, self.gbps) * self.time_scale
        if seconds > 0:
            self._sleep(seconds)
        self.nbytes += nbytes
        self.delayed_s += seconds
        return seconds
