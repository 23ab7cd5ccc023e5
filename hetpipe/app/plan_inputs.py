"""Inputs of `hetpipe profile` and `hetpipe plan`: cached measurements with progress, profile files for
real GPUs, the table a user reads. The CLI calls these; the planner itself stays pure."""

from __future__ import annotations

from pathlib import Path

import click

__all__ = ["default_profile_dir", "measure_profile", "model_options", "plan_profiles", "profile_table"]


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


def measure_profile(spec, batch: int, gpu_type: str, cache_dir: Path, *, optimizer: str, device: str = "cpu",
                     repeats: int = 10):
    """cached_profile with progress lines on stderr (measuring a large model takes minutes)."""
    import time

    import torch

    from hetpipe.compute.profiler import cached_profile, profile_cache_path

    path = profile_cache_path(spec, batch, gpu_type, cache_dir, optimizer=optimizer)
    cached = path.exists()
    if not cached:
        torch.set_num_threads(1)  # as every stage process does (design.md), so times match what stages see
        _say(f"profiling {spec.name} ({spec.num_layers} layers) at batch {batch} on {device}, one thread, "
             f"{repeats} timed repeats per layer ...")
    started = time.monotonic()
    profile = cached_profile(spec, batch, gpu_type, cache_dir, optimizer=optimizer, repeats=repeats, device=device)
    _say(f"profile from the cache: {path}" if cached and path.exists()
         else f"profiled in {time.monotonic() - started:.1f} s; cached at {path}")
    return profile


def profile_table(profile) -> str:
    from hetpipe.core.memory import format_bytes

    header = ("#", "layer", "forward ms", "backward ms", "weights", "optimizer", "output", "saved", "working")
    rows = [(str(i), layer.name, f"{layer.forward_s * 1e3:.3f}", f"{layer.backward_s * 1e3:.3f}",
             format_bytes(layer.param_bytes), format_bytes(layer.optimizer_bytes), format_bytes(layer.output_bytes),
             format_bytes(layer.saved_bytes), format_bytes(layer.working_bytes)) for i, layer in enumerate(profile.layers)]
    layers = profile.layers
    rows.append(("", "total", f"{sum(x.forward_s for x in layers) * 1e3:.3f}", f"{sum(x.backward_s for x in layers) * 1e3:.3f}",
                 format_bytes(sum(x.param_bytes for x in layers)), format_bytes(sum(x.optimizer_bytes for x in layers)),
                 "", format_bytes(sum(x.saved_bytes for x in layers)), format_bytes(max(x.working_bytes for x in layers))))
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(c.rjust(w) if i not in (1,) else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True)))
             for r in [header, *rows]]
    title = (f"{profile.model} at batch {profile.batch_size} on {profile.gpu_type} ({profile.dtype}, torch "
             f"{profile.torch_version}); input {format_bytes(profile.input_bytes)} per minibatch")
    return "\n".join([title, *lines])


def _load_profile(path: Path, model: str, batch: int, num_layers: int | None):
    from hetpipe.core.errors import UsageError
    from hetpipe.core.profile import ModelProfile

    try:
        p = ModelProfile.load(path)
    except (OSError, ValueError, TypeError, KeyError) as exc:
        raise UsageError(f"{path}: not a readable profile ({type(exc).__name__}: {exc}); write one with "
                         "`hetpipe profile --out`") from None
    if (p.model, p.batch_size) != (model, batch) or num_layers not in (None, p.num_layers):
        layers = f" ({num_layers} layers)" if num_layers is not None else ""
        raise UsageError(f"{path}: a profile of {p.model} ({p.num_layers} layers) at batch {p.batch_size}, but the "
                         f"config trains {model}{layers} at batch {batch}: profile again with matching settings")
    return p


def plan_profiles(config, profile_dir: Path) -> tuple[dict, float, object, list[str]]:
    """Profiles per GPU type, PS Gbit/s, the link function and notes, for emulated or real GPUs."""
    from hetpipe.core.emulate import cpu_cores
    from hetpipe.core.planner import EMULATED_P2P_GBPS, EMULATED_PS_GBPS, emulated_profiles, supplied_profiles

    batch, optimizer = config.train.batch_size, config.train.optimizer
    if config.emulation.enabled:
        from hetpipe.models import get_model

        spec = get_model(config.model.name, **config.model.options.to_dict())
        cpu = measure_profile(spec, batch, "cpu", profile_dir, optimizer=optimizer)
        profiles = emulated_profiles(config, cpu, cpu_cores())
        notes = [f"emulated on this CPU ({cpu_cores()} cores): times are the CPU profile x each type's slowdown, links "
                 f"this machine's loopback ({EMULATED_P2P_GBPS:g} Gbit/s between stages, {EMULATED_PS_GBPS:g} to each "
                 "PS shard); samples/s are wall-clock of `hetpipe train` here"]
        return profiles, EMULATED_PS_GBPS, (lambda a, b: EMULATED_P2P_GBPS), notes
    # Files named <type>.json are read first and checked against the config's model name and batch; the model
    # itself (and torch, ~2 s to import) is loaded only to look for `hetpipe profile` cache names.
    found = {}
    for name in config.gpu_types:
        if (profile_dir / f"{name}.json").exists():
            found[name] = _load_profile(profile_dir / f"{name}.json", config.model.name, batch, None)
    if not found:
        from hetpipe.compute.profiler import profile_cache_path
        from hetpipe.models import get_model

        spec = get_model(config.model.name, **config.model.options.to_dict())
        for name in config.gpu_types:
            path = profile_cache_path(spec, batch, name, profile_dir, optimizer=optimizer)
            if path.exists():
                found[name] = _load_profile(path, spec.name, batch, spec.num_layers)
    profiles, notes = supplied_profiles(config, found)
    notes.insert(0, f"real GPUs: profiles from {profile_dir}; links from [network], each PS shard at "
                    f"{config.network.inter_node_gbps:g} Gbit/s")
    return profiles, config.network.inter_node_gbps, config.network.link_gbps, notes
