"""Inputs of `hetpipe profile` and `hetpipe plan`: cached measurements with progress, the profiles shipped in
the package, profiles derived for GPUs this machine lacks, warnings about profiles not to trust, the table a
user reads. The CLI calls these; the planner itself stays pure."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING

import click

from hetpipe.app.progress_line import ProgressLine

if TYPE_CHECKING:
    from hetpipe.app.model_catalog import ModelKey
    from hetpipe.core.config.schema import ClusterConfig
    from hetpipe.core.planning.profile import ModelProfile

__all__ = [
    "SHIPPED_DIR",
    "default_profile_dir",
    "like_profile",
    "measure_profile",
    "model_options",
    "plan_profiles",
    "profile_table",
    "shipped_name",
    "shipped_profile",
]

# Measured profiles shipped in the package, one folder per device measured on (hetpipe/profiles/README.md):
# `hetpipe plan` derives the GPU types of a real cluster from them when nothing was measured on those GPUs.
SHIPPED_DIR = Path(__file__).resolve().parents[1] / "profiles"

# what plan_profiles returns: profiles per GPU type, the PS's Gbit/s, the link function, notes
PlanInputs = tuple[dict, float, object, list[str]]


def default_profile_dir() -> Path:
    """Where profiles are cached: $XDG_CACHE_HOME/hetpipe/profiles (default ~/.cache/hetpipe/profiles)."""
    import os

    return Path(os.environ.get("XDG_CACHE_HOME") or "~/.cache").expanduser() / "hetpipe" / "profiles"


def model_options(pairs: tuple[str, ...]) -> dict:
    """KEY=VALUE pairs, each value read as a TOML value (32, 1e-3, true, [3, 32, 32]) or else as a string."""
    import tomllib

    from hetpipe.core.errors import UsageError

    options = {}
    for pair in pairs:
        key, sep, text = pair.partition("=")
        if not sep or not key.strip():
            raise UsageError(f"--option {pair!r}: write KEY=VALUE, e.g. --option image_size=32")
        try:
            options[key.strip()] = tomllib.loads(f"v = {text}")["v"]
        except tomllib.TOMLDecodeError:
            options[key.strip()] = text
    return options


def _say(message: str) -> None:
    click.echo(message, err=True)


def measure_profile(
    spec,
    batch: int,
    gpu_type: str,
    cache_dir: Path,
    *,
    optimizer: str,
    device: str = "cpu",
    repeats: int = 10,
    dtype: str | None = None,
    refresh: bool = False,
):
    """cached_profile with progress lines on stderr (measuring a large model takes minutes); refresh=True
    measures again and replaces the cache entry."""
    import time

    import torch

    from hetpipe.compute.profiler import cached_profile, profile_cache_path

    path = profile_cache_path(spec, batch, gpu_type, cache_dir, optimizer=optimizer, dtype=dtype)
    cached = path.exists() and not refresh
    if not cached:
        torch.set_num_threads(
            1
        )  # as every stage process does (docs/architecture.md#conventions), so times match what stages see
        _say(
            f"profiling {spec.name} ({spec.num_layers} layers) at batch {batch} on {device}, one thread, "
            f"{repeats} timed repeats per layer ..."
        )

    def again(first) -> None:
        _say(f"  not trusted ({'; '.join(first.origin.flags)}): measuring once more ...")

    started = time.monotonic()
    line = ProgressLine(_say)

    def measured(done: int, layers: int) -> None:
        line(f"  {done} of {layers} layers measured ({time.monotonic() - started:.0f} s)")

    profile = cached_profile(
        spec,
        batch,
        gpu_type,
        cache_dir,
        optimizer=optimizer,
        repeats=repeats,
        device=device,
        dtype=dtype,
        refresh=refresh,
        on_flagged=again,
        progress=measured,
    )
    _say(
        f"profile from the cache: {path}"
        if cached and path.exists()
        else f"profiled in {time.monotonic() - started:.1f} s; cached at {path}"
    )
    return profile


def shipped_name(profile) -> str:
    """The file name a shipped profile has under its device folder: model, options digest, batch, dtype,
    optimizer."""
    return (
        f"{profile.model}-{profile.origin.options_digest}-b{profile.batch_size}-{profile.dtype}-"
        f"{profile.origin.optimizer}.json"
    )


def shipped_profile(
    key: ModelKey,
    batch: int,
    *,
    optimizer: str,
    dtype: str | None = None,
    device: str | None = None,
    root: Path | None = None,
):
    """(file, profile) of the measured profile shipped for this model variant (a model_catalog key), optimizer
    and dtype (default: the model's), or None. Among several: measured on CUDA before CPU, at `batch` before
    others, then the nearest batch; one measured at another batch comes rescaled to `batch` by
    ModelProfile.at_batch. `device`: only profiles measured on that kind ("cpu" or "cuda"). `root`: default
    SHIPPED_DIR."""
    import math

    from hetpipe.core.planning.profile import ModelProfile

    want = (key.name, key.options_digest, dtype or key.dtype, optimizer)
    found = []
    for path in sorted((root or SHIPPED_DIR).glob("*/*.json")):
        try:
            p = ModelProfile.load(path)
        except (OSError, ValueError, TypeError, KeyError):
            continue  # the shipping test names broken files; a user's plan goes on with the others
        o = p.origin
        if (
            o is None
            or (p.model, o.options_digest, p.dtype, o.optimizer) != want
            or p.num_layers != key.num_layers
        ):
            continue
        if device is None or o.device == device:
            found.append(
                (o.device != "cuda", p.batch_size != batch, abs(math.log(p.batch_size / batch)), str(path), p)
            )
    if not found:
        return None
    *_, path, p = min(found)
    return Path(path), p if p.batch_size == batch else p.at_batch(batch)


def _shipped_label(path: Path) -> str:
    return f"{path.parent.name}/{path.name}"


def like_profile(
    spec,
    batch: int,
    gpu_type: str,
    cache_dir: Path,
    *,
    like: str,
    speed: float,
    optimizer: str,
    dtype: str | None = None,
):
    """A profile for a GPU type this machine does not have: a measured profile of device kind `like` (this
    machine's cached one, else the shipped one, else for "cpu" one measured now) with times / `speed` (the
    type's FLOP rate over the measured device's), memory unchanged; stored in the cache under `gpu_type`."""
    from hetpipe.compute.profiler import cached_profile, profile_cache_path, write_profile
    from hetpipe.core.errors import HetpipeError, UsageError
    from hetpipe.core.planning.profile import derive_profile

    try:
        source = cached_profile(spec, batch, like, cache_dir, optimizer=optimizer, dtype=dtype, measure=False)
        where = f"this machine's cached {like} profile"
    except HetpipeError:
        from hetpipe.app.model_catalog import key_of
        from hetpipe.compute.profiler import profile_dtype

        shipped = shipped_profile(
            key_of(spec), batch, optimizer=optimizer, dtype=profile_dtype(spec, dtype), device=like
        )
        if shipped is not None:
            source, where = shipped[1], f"the shipped {like} profile {_shipped_label(shipped[0])}"
        elif like == "cpu":
            source = measure_profile(spec, batch, "cpu", cache_dir, optimizer=optimizer, dtype=dtype)
            where = "this machine's cpu profile"
        else:
            raise UsageError(
                f"no measured {like} profile of {spec.name} at batch {batch} ({optimizer}) here or "
                f"shipped: measure one on a machine with a GPU (`hetpipe profile {spec.name} --batch "
                f"{batch} --device cuda`) and copy its cache file to {cache_dir}, or use --like cpu"
            ) from None
    derived = derive_profile(source, speed, 1.0, 1.0, gpu_type=gpu_type)
    path = profile_cache_path(spec, batch, gpu_type, cache_dir, optimizer=optimizer, dtype=dtype)
    write_profile(path, derived)
    _say(f"derived {gpu_type} from {where}: times / {speed:g}, memory unchanged; cached at {path}")
    return derived


def profile_table(profile) -> str:
    from hetpipe.core.planning.memory import format_bytes

    header = ("#", "layer", "forward ms", "backward ms", "weights", "optimizer", "output", "saved", "working")
    rows = [
        (
            str(i),
            layer.name,
            f"{layer.forward_s * 1e3:.3f}",
            f"{layer.backward_s * 1e3:.3f}",
            format_bytes(layer.param_bytes),
            format_bytes(layer.optimizer_bytes),
            format_bytes(layer.output_bytes),
            format_bytes(layer.saved_bytes),
            format_bytes(layer.working_bytes),
        )
        for i, layer in enumerate(profile.layers)
    ]
    layers = profile.layers
    rows.append(
        (
            "",
            "total",
            f"{sum(x.forward_s for x in layers) * 1e3:.3f}",
            f"{sum(x.backward_s for x in layers) * 1e3:.3f}",
            format_bytes(sum(x.param_bytes for x in layers)),
            format_bytes(sum(x.optimizer_bytes for x in layers)),
            "",
            format_bytes(sum(x.saved_bytes for x in layers)),
            format_bytes(max(x.working_bytes for x in layers)),
        )
    )
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = [
        "  ".join(
            c.rjust(w) if i not in (1,) else c.ljust(w)
            for i, (c, w) in enumerate(zip(r, widths, strict=True))
        )
        for r in [header, *rows]
    ]
    title = (
        f"{profile.model} at batch {profile.batch_size} on {profile.gpu_type} ({profile.dtype}, torch "
        f"{profile.torch_version}); input {format_bytes(profile.input_bytes)} per minibatch"
    )
    return "\n".join([title, *lines, *origin_lines(profile)])


def origin_lines(profile) -> list[str]:
    """Where, when and how noisily `profile` was measured, what it was derived from, and its flags."""
    o = profile.origin
    if o is None:
        return ["origin: unknown (made by hand or by an older hetpipe)"]
    lines = [
        f"measured {o.measured_at} on {o.device} ({o.device_name}, host {o.host}, "
        f"{o.device_tflops:.3g} TFLOPS matmul) at batch {o.measured_batch}, {o.repeats} repeats per layer, "
        f"spread {profile.spread:.1%}, load "
        + ("unknown" if o.load_per_core is None else f"{o.load_per_core:.2f} per core")
    ]
    if o.derived_from:
        lines.append(
            f"derived from the {o.derived_from} profile: times / {o.speed_ratio:.4g}, memory unchanged"
        )
    lines += [f"flagged: {flag}" for flag in o.flags]
    return lines


def _load_profile(path: Path, model: str, batch: int, num_layers: int | None):
    from hetpipe.core.errors import UsageError
    from hetpipe.core.planning.profile import ModelProfile

    try:
        p = ModelProfile.load(path)
    except (OSError, ValueError, TypeError, KeyError) as exc:
        raise UsageError(
            f"{path}: not a readable profile ({type(exc).__name__}: {exc}); write one with "
            "`hetpipe profile --out`"
        ) from None
    if (p.model, p.batch_size) != (model, batch) or num_layers not in (None, p.num_layers):
        layers = f" ({num_layers} layers)" if num_layers is not None else ""
        raise UsageError(
            f"{path}: a profile of {p.model} ({p.num_layers} layers) at batch {p.batch_size}, but the "
            f"config trains {model}{layers} at batch {batch}: profile again with matching settings"
        )
    return p


def plan_profiles(config: ClusterConfig, profile_dir: Path, *, refresh: bool = False) -> PlanInputs:
    """Profiles per GPU type, PS Gbit/s, the link function and notes, for emulated or real GPUs.

    Emulated: this machine's CPU profile (measured once, cached; refresh=True measures again). Real GPUs:
    files <type>.json or `hetpipe profile` cache names in profile_dir, types without one scaled by speed from
    one with it; with none at all, every type derived from the model's shipped profile by FLOP rate. The notes
    warn about profiles not to trust: flagged when measured, stale, from another machine where it matters.
    """
    from hetpipe.core.errors import UsageError

    batch, optimizer = config.train.batch_size, config.train.optimizer
    now = datetime.now(UTC)
    if config.emulation.enabled:
        return _emulated_inputs(config, profile_dir, refresh, now)
    if refresh:
        raise UsageError(
            f"--refresh re-measures this machine's CPU profile, but {config.path} has emulation off: "
            f"measure its GPUs on their machines (`hetpipe profile {config.model.name} --batch {batch} "
            "--device cuda --refresh`) and pass --profile-dir"
        )
    # Files named <type>.json are read first and checked against the config's model name and batch; then
    # `hetpipe profile` cache names, then the shipped profiles. The model's key comes from the catalog, so a
    # built-in model is not built (nor torch imported, ~2 s) to plan.
    found = _typed_files(config, profile_dir)
    if not found:
        from hetpipe.app.model_catalog import model_key

        key = model_key(config.model.name, config.model.options.to_dict())
        found = _cached_files(config, key, profile_dir)
        shipped = None if found else shipped_profile(key, batch, optimizer=optimizer)
        if shipped is not None:
            return _shipped_inputs(config, key, *shipped)
    return _supplied_inputs(config, profile_dir, found, now)


def _emulated_inputs(config: ClusterConfig, profile_dir: Path, refresh: bool, now: datetime) -> PlanInputs:
    """plan_profiles for an emulated cluster: this machine's CPU profile (measured now unless cached) times
    each type's slowdown, the loopback's links, and a note per warning about the CPU profile."""
    from hetpipe.compute.machine import host_fingerprint
    from hetpipe.core.hardware.emulate import cpu_cores
    from hetpipe.core.planning.planner import EMULATED_P2P_GBPS, EMULATED_PS_GBPS, emulated_profiles
    from hetpipe.core.planning.profile import origin_warnings
    from hetpipe.models import get_model

    batch, optimizer = config.train.batch_size, config.train.optimizer
    spec = get_model(config.model.name, **config.model.options.to_dict())
    cpu = measure_profile(spec, batch, "cpu", profile_dir, optimizer=optimizer, refresh=refresh)
    profiles = emulated_profiles(config, cpu, cpu_cores())
    notes = [
        f"emulated on this CPU ({cpu_cores()} cores): times are the CPU profile x each type's slowdown, "
        f"links this machine's loopback ({EMULATED_P2P_GBPS:g} Gbit/s between stages, "
        f"{EMULATED_PS_GBPS:g} to each PS shard); samples/s are wall-clock of `hetpipe train` here"
    ]
    notes += [
        (
            f"cpu profile: {w}; measure it again (when the machine is quiet): "
            f"hetpipe plan {config.path} --refresh"
        )
        for w in origin_warnings(cpu, now=now, host=host_fingerprint())
    ]
    return profiles, EMULATED_PS_GBPS, (lambda a, b: EMULATED_P2P_GBPS), notes


def _typed_files(config: ClusterConfig, profile_dir: Path) -> dict[str, ModelProfile]:
    """The profiles in profile_dir named <type>.json, per GPU type of the config, checked against its model
    name and batch."""
    found = {}
    for name in config.gpu_types:
        if (profile_dir / f"{name}.json").exists():
            found[name] = _load_profile(
                profile_dir / f"{name}.json", config.model.name, config.train.batch_size, None
            )
    return found


def _cached_files(config: ClusterConfig, key: ModelKey, profile_dir: Path) -> dict[str, ModelProfile]:
    """The profiles in profile_dir under `hetpipe profile` cache names, per GPU type of the config, checked
    against the model, its layers and the batch. The names carry torch's version: torch is imported only when
    a file of some version is there."""
    from hetpipe.core.planning.profile import cache_file_name

    batch, optimizer = config.train.batch_size, config.train.optimizer
    found = {}
    for name in config.gpu_types:
        parts = (key.name, key.options_digest, batch, name, key.dtype, optimizer)
        if not any(profile_dir.glob(cache_file_name(*parts, None))):
            continue
        import torch

        path = profile_dir / cache_file_name(*parts, torch.__version__)
        if path.exists():
            found[name] = _load_profile(path, key.name, batch, key.num_layers)
    return found


def _shipped_inputs(config: ClusterConfig, key: ModelKey, path: Path, measured: ModelProfile) -> PlanInputs:
    """plan_profiles for real GPUs none of which was measured: every type derived from the shipped profile at
    `path` by FLOP rate, the [network] links, and notes saying where the profile came from and how to measure
    one's own."""
    from hetpipe.core.planning.planner import derived_profiles
    from hetpipe.core.planning.profile import origin_warnings

    batch = config.train.batch_size
    profiles, notes = derived_profiles(config, measured)
    o = measured.origin
    rescaled = (
        f", measured at batch {o.measured_batch} and scaled to {batch} by proportion"
        if o.measured_batch != batch
        else ""
    )
    notes.insert(
        0,
        f"real GPUs, none measured: profiles from the shipped {_shipped_label(path)} "
        f"(measured {o.measured_at[:10]} on {o.device_name}{rescaled}); measure yours with "
        f"`hetpipe profile {key.name} --batch {batch} --device cuda --gpu-type TYPE` on each GPU "
        f"type, or derive one with `--gpu-type TYPE --like cpu --speed RATIO`; links from "
        f"[network], each PS shard at {config.network.inter_node_gbps:g} Gbit/s",
    )
    notes += [f"shipped profile: {w}" for w in origin_warnings(measured)]
    return profiles, config.network.inter_node_gbps, config.network.link_gbps, notes


def _supplied_inputs(
    config: ClusterConfig, profile_dir: Path, found: dict[str, ModelProfile], now: datetime
) -> PlanInputs:
    """plan_profiles for real GPUs from the profiles found in profile_dir (types without one scaled by speed
    from one with it), the [network] links, and a note per warning about each profile."""
    from hetpipe.core.planning.planner import supplied_profiles
    from hetpipe.core.planning.profile import origin_warnings

    profiles, notes = supplied_profiles(config, found)
    notes.insert(
        0,
        f"real GPUs: profiles from {profile_dir}; links from [network], each PS shard at "
        f"{config.network.inter_node_gbps:g} Gbit/s",
    )
    notes += [f"{name} profile: {w}" for name in sorted(found) for w in origin_warnings(found[name], now=now)]
    return profiles, config.network.inter_node_gbps, config.network.link_gbps, notes
