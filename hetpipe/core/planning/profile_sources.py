"""Where the planner's per-GPU-type profiles come from: the CPU's profile dilated by each type's emulated
slowdown, profiles measured on real GPUs (types without one scaled by speed), or profiles derived by FLOP rate
from another device's; and the check that they fit the config. Pure."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

from hetpipe.core.config.schema import ClusterConfig
from hetpipe.core.errors import UsageError
from hetpipe.core.hardware.emulate import auto_time_scale, gpu_speeds
from hetpipe.core.planning.profile import ModelProfile, batch_time_factor, derive_profile

__all__ = ["check_profiles", "derived_profiles", "emulated_profiles", "supplied_profiles"]


def emulated_profiles(
    config: ClusterConfig, cpu_profile: ModelProfile, cores: int
) -> dict[str, ModelProfile]:
    """Every GPU type's profile under emulation: the CPU's times x the type's slowdown
    (hetpipe.core.hardware.emulate.slowdowns).

    The slowdown is (fastest speed / the type's speed) x time_scale, time_scale from [emulation] or, for
    "auto", auto_time_scale over all the cluster's GPUs (the runtime uses the GPUs of the run's VWs: the same
    set when a plan uses every GPU). So predictions are in wall seconds of `hetpipe train` on this machine.
    Times are also x the profile's origin.emulation_cost: what a whole step costs an emulated device in CPU
    time beyond the layer-by-layer profile (docs/emulation.md#what-dilation-costs). Of that, the share
    origin.emulation_fixed_share does not scale with the batch: each type's profile keeps it as its
    origin.fixed_share, so ModelProfile.at_batch moves only the rest (and a CPU profile rescaled from another
    batch before is set back to that share here).
    """

    speeds = gpu_speeds(config)
    time_scale = config.emulation.time_scale or auto_time_scale(speeds, cores)
    fastest = max(speeds.values())
    used = {config.gpu(ref).name for ref in config.all_gpus()}
    origin = cpu_profile.origin
    cost, rebase, share = 1.0, 1.0, 0.0
    if origin is not None:
        f = cpu_profile.batch_size / origin.measured_batch
        t = batch_time_factor(f, origin.emulation_fixed_share)
        cost, rebase, share = origin.emulation_cost, t / f, origin.emulation_fixed_share / t
    out = {}
    for name, gpu_type in config.gpu_types.items():
        if name in used:
            derived = derive_profile(
                cpu_profile, gpu_type.speed, fastest, time_scale * cost * rebase, gpu_type=name
            )
            out[name] = (
                derived
                if origin is None
                else replace(derived, origin=replace(derived.origin, fixed_share=share))
            )
    return out


def supplied_profiles(
    config: ClusterConfig, found: Mapping[str, ModelProfile]
) -> tuple[dict[str, ModelProfile], list[str]]:
    """Profiles for real GPUs: `found` (type -> measured profile) completed by speed ratio for the missing
    types.

    A missing type's times are those of the fastest type that has a profile x (its speed / missing speed),
    memory sizes unchanged; the notes say which were scaled. UsageError when no type has a profile.
    """
    used = _used_types(config)
    have = [name for name in used if name in found]
    if not have:
        raise UsageError(
            f"no profile of {config.model.name} at batch {config.train.batch_size} for any GPU type of "
            f"{config.path} ({', '.join(used)}): on a machine with one of them run "
            f"`hetpipe profile {config.model.name} --batch {config.train.batch_size} --gpu-type {used[0]} "
            f"--device cuda --out DIR/{used[0]}.json` and pass "
            "--profile-dir DIR, or derive one here from a CPU profile: `hetpipe profile ... --gpu-type "
            f"{used[0]} --like cpu --speed RATIO` (RATIO: its FLOP rate over this CPU's); "
            "types without a profile are scaled from one that has it by speed"
        )
    source = max(have, key=lambda name: (config.gpu_types[name].speed, name))
    profiles, notes = {}, []
    for name in used:
        if name in found:
            profiles[name] = found[name]
        else:
            profiles[name] = derive_profile(
                found[source],
                config.gpu_types[name].speed,
                config.gpu_types[source].speed,
                1.0,
                gpu_type=name,
            )
            notes.append(
                f"{name}: no profile given, times scaled from {source} by speed "
                f"{config.gpu_types[source].speed:g}/{config.gpu_types[name].speed:g}"
            )
    return profiles, notes


def derived_profiles(
    config: ClusterConfig, measured: ModelProfile
) -> tuple[dict[str, ModelProfile], list[str]]:
    """Profiles for real GPUs none of which was measured: each type's derived from `measured` (another device)
    by FLOP rate, reading the type's `speed` as its TFLOPS: times x measured.origin.device_tflops / speed,
    memory sizes unchanged (derive_profile). UsageError when `measured` does not record its device's rate.
    """
    origin = measured.origin
    if origin is None or not origin.device_tflops > 0:
        raise UsageError(
            f"the {measured.gpu_type} profile of {measured.model} does not record its device's FLOP rate "
            "(origin.device_tflops): measure it again with `hetpipe profile`"
        )
    used = _used_types(config)
    profiles = {
        name: derive_profile(measured, config.gpu_types[name].speed, origin.device_tflops, 1.0, gpu_type=name)
        for name in used
    }
    speeds = ", ".join(f"{name} {config.gpu_types[name].speed:g}" for name in used)
    note = (
        f"{', '.join(used)}: no profile measured on them; derived from a {origin.device} profile "
        f"({origin.device_name}, {origin.device_tflops:.3g} TFLOPS by its matmul) by FLOP rate, times x "
        f"{origin.device_tflops:.3g} / speed read as TFLOPS ({speeds}), memory unchanged: the predictions' "
        "ratios mean more than their values"
    )
    return profiles, [note]


def _used_types(config: ClusterConfig) -> list[str]:
    """The GPU types some node has, in [gpu_types] order."""
    return [name for name in config.gpu_types if any(name in node.gpus for node in config.nodes)]


def check_profiles(config: ClusterConfig, profiles: Mapping[str, ModelProfile]) -> None:
    """UsageError when a GPU type of the config has no profile, or the profiles disagree on model or batch."""
    used = sorted({name for node in config.nodes for name in node.gpus})
    missing = [name for name in used if name not in profiles]
    if missing:
        raise UsageError(
            f"no profile for GPU type(s) {', '.join(missing)}: profile {config.model.name} on them "
            "(`hetpipe profile`) or scale one from another type"
        )
    first = profiles[used[0]]
    for name in used:
        p = profiles[name]
        if p.batch_size != config.train.batch_size:
            raise UsageError(
                f"the {name} profile is at batch {p.batch_size} but {config.path} trains at batch "
                f"{config.train.batch_size}: profile at batch {config.train.batch_size}"
            )
        if (p.model, p.num_layers) != (first.model, first.num_layers):
            raise UsageError(
                f"the {name} profile is {p.model} with {p.num_layers} layers, the {used[0]} one "
                f"{first.model} with {first.num_layers}: profile the same model on every type"
            )
