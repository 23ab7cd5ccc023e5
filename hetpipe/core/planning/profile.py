"""Per-layer profiles of a model on a GPU type: the numbers the partitioner, planner and simulator use, where
and when they were measured and how noisy, and the rules that derive one profile from another (FLOP rate,
batch).

Data and pure rules only (plus JSON round trip); measuring lives in hetpipe.compute.profiler.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, replace
from datetime import datetime
from pathlib import Path
from typing import Any

from hetpipe.core.errors import UsageError

__all__ = [
    "PROFILER_VERSION",
    "BUSY_LOAD",
    "NOISY_SPREAD",
    "STALE_DAYS",
    "LayerProfile",
    "ModelProfile",
    "ProfileOrigin",
    "batch_time_factor",
    "cache_file_name",
    "variant_digest",
    "derive_profile",
    "noise_flags",
    "origin_warnings",
    "repeat_spread",
]

PROFILER_VERSION = 8  # part of the cache key: bump when what a profile measures changes (8: fixed share)


def variant_digest(options: Iterable[tuple[str, Any]], input_shape: Iterable[int], input_dtype: str) -> str:
    """12 hex digits naming a model variant in profile and calibration names: the options it was built with
    (sorted (name, value) pairs), its input shape and input dtype (str of the torch dtype)."""
    text = json.dumps(
        {
            "options": [[k, repr(v)] for k, v in options],
            "input_shape": list(input_shape),
            "input_dtype": input_dtype,
        },
        sort_keys=True,
    )
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def cache_file_name(
    model: str, digest: str, batch: int, gpu_type: str, dtype: str, optimizer: str, torch_version: str | None
) -> str:
    """The name `hetpipe profile` caches a profile under: model, options digest, batch, GPU type, dtype,
    optimizer, torch and PROFILER_VERSION, each part reduced to [A-Za-z0-9_.+-]; torch_version None: a glob
    pattern matching any torch."""
    parts = [model, digest, f"b{batch}", gpu_type, dtype, optimizer, f"torch{torch_version}"]
    name = "-".join(re.sub(r"[^A-Za-z0-9_.+-]", "_", p) for p in parts)
    if torch_version is None:
        name = name.removesuffix("torchNone") + "torch*"
    return f"{name}-p{PROFILER_VERSION}.json"


# A profile is flagged when either holds while it is measured (the profiler then measures once more and keeps
# the quieter of the two, flagged if that one is still noisy):
NOISY_SPREAD = 0.25  # the layers' repeat spreads, weighted by their times, above 25% of the median
BUSY_LOAD = 1.0  # the 1-minute load average above one runnable thread per core: others shared the cores
STALE_DAYS = (
    30  # `hetpipe plan` warns about a profile measured longer ago (torch, drivers, the machine change)
)


@dataclass(frozen=True)
class LayerProfile:
    """One layer at the profiled batch size on one GPU type."""

    name: str
    forward_s: float  # forward time of one minibatch
    backward_s: float  # backward time of one minibatch, with the optimizer step and update bookkeeping
    param_bytes: int  # weights
    optimizer_bytes: int  # optimizer state for those weights (momentum: = param_bytes, adam: 2x)
    output_bytes: int  # the layer's output activation for one minibatch (what crosses a stage boundary)
    saved_bytes: int  # activations autograd keeps for the backward, per minibatch in flight
    working_bytes: int  # transient peak beyond the above while the layer runs
    spread: float = 0.0  # repeat_spread of its forward+backward times; 0.0 when fewer than 3 repeats


@dataclass(frozen=True)
class ProfileOrigin:
    """When, where and how a profile was measured, how noisy it was, and what it was derived from since."""

    measured_at: str  # UTC, ISO 8601 ("2025-06-01T12:00:00+00:00")
    device: str  # the kind measured on: "cpu" or "cuda"
    device_name: str  # the CPU model (/proc/cpuinfo) or torch.cuda.get_device_name
    host: str  # fingerprint of the measuring host (hash of hostname, CPU model, cores), never the hostname
    profiler_version: int
    optimizer: str  # the optimizer whose step and state were measured
    options_digest: str  # the model's options as profile_cache_path hashes them: which variant of the model
    repeats: int  # timed repeats per layer
    measured_batch: int  # the batch measured at (ModelProfile.batch_size differs after ModelProfile.at_batch)
    device_tflops: (
        float  # dense matmul rate measured on the device in the profile's dtype (one thread on CPU)
    )
    load_per_core: (
        float | None
    )  # 1-minute load average / cores, the larger of before and after; None: unknown
    flags: tuple[str, ...] = ()  # why the measurement is not to be trusted (noise_flags); () when clean
    derived_from: str = ""  # "" when measured; else the label of the measured profile it was derived from
    speed_ratio: float = 1.0  # derived: its FLOP rate / the measured device's (times are the measured / this)
    # CPU profiles: the CPU time of the whole training step run as an emulated device runs it (each block in
    # the emulation's Dilator, asleep between) over the layer-by-layer sum, step_s; the planner's emulated
    # times are the profile's x this (docs/emulation.md#what-dilation-costs). 1.0: not measured (a GPU, an
    # older profile)
    emulation_cost: float = 1.0
    # CPU profiles: of that dilated step's time, the share that does not scale with the batch (fitted from its
    # forward and backward at the measured batch and at a quarter of it: a block's cold start costs the same
    # at any batch)
    emulation_fixed_share: float = 0.0
    # the share of every time that ModelProfile.at_batch keeps as it is: 0.0 (by proportion) but for the
    # emulated types' profiles (emulated_profiles: the step's emulation_fixed_share)
    fixed_share: float = 0.0

    @property
    def flagged(self) -> bool:
        return bool(self.flags)

    def age_days(self, now: datetime) -> float:
        return (now - datetime.fromisoformat(self.measured_at)).total_seconds() / 86400


@dataclass(frozen=True)
class ModelProfile:
    """All layers of a model, in order, on one GPU type; keyed for caching by the fields before `layers`."""

    model: str
    batch_size: int
    gpu_type: str
    dtype: str
    torch_version: str
    input_bytes: int  # one minibatch of the model's input
    layers: tuple[LayerProfile, ...]
    origin: ProfileOrigin | None = None  # None: made by hand or by a hetpipe before profiles recorded it

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def step_s(self) -> float:
        """One minibatch through the whole model, layer by layer: the sum of every layer's forward +
        backward."""
        return sum(layer.forward_s + layer.backward_s for layer in self.layers)

    @property
    def spread(self) -> float:
        """The layers' repeat spreads weighted by their forward+backward times (the big layers set the
        pace)."""
        total = self.step_s
        if total <= 0:
            return 0.0
        return sum(layer.spread * (layer.forward_s + layer.backward_s) for layer in self.layers) / total

    def scaled(self, gpu_type: str, time_factor: float) -> ModelProfile:
        """The same model on another GPU type whose times are `time_factor` x these (memory unchanged)."""
        layers = tuple(
            replace(layer, forward_s=layer.forward_s * time_factor, backward_s=layer.backward_s * time_factor)
            for layer in self.layers
        )
        return replace(self, gpu_type=gpu_type, layers=layers)

    def at_batch(self, batch_size: int) -> ModelProfile:
        """The profile at another batch size: activations (output, saved, working) and the input x
        batch_size / batch_size measured; weights and optimizer state unchanged; times by proportion too, but
        for the share origin.fixed_share of each, which stays (an emulated device's cold start of a block).

        Close on a CPU, whose time per sample barely depends on the batch; on a GPU a small batch leaves the
        device partly idle, so times scaled up from one are pessimistic. origin.measured_batch keeps the
        truth.
        """
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise UsageError(f"batch_size must be an integer >= 1, got {batch_size!r}")
        f = batch_size / self.batch_size
        share = self.origin.fixed_share if self.origin is not None else 0.0
        t = batch_time_factor(f, share)
        layers = tuple(
            replace(
                layer,
                forward_s=layer.forward_s * t,
                backward_s=layer.backward_s * t,
                output_bytes=round(layer.output_bytes * f),
                saved_bytes=round(layer.saved_bytes * f),
                working_bytes=round(layer.working_bytes * f),
            )
            for layer in self.layers
        )
        origin = self.origin if not share else replace(self.origin, fixed_share=share / t)
        return replace(
            self, batch_size=batch_size, input_bytes=round(self.input_bytes * f), layers=layers, origin=origin
        )

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    @classmethod
    def from_json(cls, text: str) -> ModelProfile:
        data = json.loads(text)
        data["layers"] = tuple(LayerProfile(**layer) for layer in data["layers"])
        if data.get("origin") is not None:
            origin = data["origin"]
            data["origin"] = ProfileOrigin(**{**origin, "flags": tuple(origin.get("flags", ()))})
        return cls(**data)

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(self.to_json())

    @classmethod
    def load(cls, path: Path) -> ModelProfile:
        return cls.from_json(path.read_text())


def batch_time_factor(f: float, fixed_share: float) -> float:
    """A time at `f` x the batch, as a multiple of itself, when `fixed_share` of it does not scale with the
    batch; the fixed part is then fixed_share / this of the new time. Pure."""
    return (1 - fixed_share) * f + fixed_share


def derive_profile(
    cpu_profile: ModelProfile,
    gpu_type_speed: float,
    reference_speed: float,
    time_scale: float,
    *,
    gpu_type: str | None = None,
) -> ModelProfile:
    """The profile of another device: times x reference_speed / gpu_type_speed x time_scale, sizes unchanged.

    Emulation: `reference_speed` is the speed the measured CPU stands for (the fastest type,
    docs/emulation.md#slowdowns), so a type half as fast runs 2 x time_scale times slower than the
    measurement. A GPU you do not have: speeds are FLOP rates (the type's and the measured device's,
    origin.device_tflops) and time_scale 1, so compute time scales by the FLOP-rate ratio while memory,
    counted in bytes, stays. Labelled `gpu_type` (default: unchanged); a measured profile's origin records
    what it was derived from and the ratio.
    """
    for what, value in (
        ("gpu_type_speed", gpu_type_speed),
        ("reference_speed", reference_speed),
        ("time_scale", time_scale),
    ):
        if (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or not (value > 0 and math.isfinite(value))
        ):
            raise UsageError(f"derive_profile: {what} must be a finite number > 0, got {value!r}")
    factor = reference_speed / gpu_type_speed * time_scale
    derived = cpu_profile.scaled(gpu_type or cpu_profile.gpu_type, factor)
    origin = cpu_profile.origin
    if origin is not None:
        derived = replace(
            derived,
            origin=replace(
                origin,
                derived_from=origin.derived_from or cpu_profile.gpu_type,
                speed_ratio=origin.speed_ratio / factor,
            ),
        )
    return derived


# ---------------------------------------------------------------------------------------------- trust


def repeat_spread(times: Sequence[float]) -> float:
    """(p90 - p10) / median of one layer's repeated times; 0.0 for fewer than 3 (too few to judge)."""
    if len(times) < 3:
        return 0.0
    median = statistics.median(times)
    deciles = statistics.quantiles(times, n=10, method="inclusive")
    return (deciles[-1] - deciles[0]) / median if median > 0 else 0.0


def noise_flags(profile: ModelProfile, load_per_core: float | None) -> tuple[str, ...]:
    """Why a fresh measurement is not to be trusted: its weighted repeat spread above NOISY_SPREAD, or the
    machine busier than BUSY_LOAD while it ran. () when neither."""
    flags = []
    if profile.spread > NOISY_SPREAD:
        flags.append(
            f"noisy: repeats spread {profile.spread:.0%} (p90-p10 over the median, weighted by time; "
            f"limit {NOISY_SPREAD:.0%})"
        )
    if load_per_core is not None and load_per_core > BUSY_LOAD:
        flags.append(f"busy: load average {load_per_core:.2f} per core while measuring (limit {BUSY_LOAD:g})")
    return tuple(flags)


def origin_warnings(
    profile: ModelProfile, *, now: datetime | None = None, host: str | None = None
) -> list[str]:
    """What a user should know before trusting `profile`: flagged when measured; derived from another
    device's; older than STALE_DAYS at `now` (when given); measured on a host other than `host` (when given:
    the profile must describe that machine, as under emulation); or of unknown origin."""
    origin = profile.origin
    if origin is None:
        return [
            "no record of when, where or how noisily it was measured (made by hand or by an older hetpipe)"
        ]
    warnings = [f"flagged when measured: {flag}" for flag in origin.flags]
    if origin.derived_from:
        warnings.append(
            f"derived, not measured: the {origin.derived_from} profile's times / {origin.speed_ratio:.4g}"
        )
    age = origin.age_days(now) if now is not None else 0.0
    if age > STALE_DAYS:
        warnings.append(
            f"stale: measured {age:.0f} days ago ({origin.measured_at[:10]}; older than {STALE_DAYS} days)"
        )
    if host is not None and origin.host != host:
        warnings.append(
            f"foreign: measured on another machine ({origin.device_name}, host {origin.host}; this is "
            f"{host}), so its times are that machine's"
        )
    return warnings
