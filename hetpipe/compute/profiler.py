"""Measuring a model's per-layer profile (times, weights, activations) on one device, with a JSON cache.

Not pure: it builds and runs the model. The caller sets torch.set_num_threads(1) first, as every stage process
does (docs/architecture.md#conventions), so that the times match what a stage will see. Each profile records
where, when and how noisily it was measured (hetpipe.core.planning.profile.ProfileOrigin); a noisy one is
measured once more.
"""

from __future__ import annotations

import math
import os
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from pathlib import Path

import torch
from torch import Tensor, nn

from hetpipe.compute.heap import keep_freed_memory
from hetpipe.compute.machine import cpu_model, host_fingerprint, load_per_core
from hetpipe.core.errors import HetpipeError, UsageError
from hetpipe.core.planning.profile import (
    PROFILER_VERSION,
    LayerProfile,
    ModelProfile,
    ProfileOrigin,
    cache_file_name,
    noise_flags,
    repeat_spread,
    variant_digest,
)
from hetpipe.models.spec import ModelSpec

__all__ = [
    "DTYPES",
    "OPTIMIZER_STATE",
    "PROFILER_VERSION",
    "cached_profile",
    "device_tflops",
    "options_digest",
    "profile_cache_path",
    "profile_checked",
    "profile_dtype",
    "profile_model",
    "write_profile",
]

OPTIMIZER_STATE = {"sgd": 0, "momentum": 1, "adam": 2}  # copies of the trainable weights each optimizer keeps
DTYPES = ("float32", "bfloat16")  # what a model may be profiled in besides its own dtype


# ---------------------------------------------------------------------------------------------- measuring


WARMUP = 3  # untimed forward+backward runs per layer before the timed ones
COST_SLOWDOWN = 10.0  # the dilation emulation_cost is measured at: bench.toml's fastest type's on 2 cores
COST_BUDGET_S = 2.0  # wall seconds of dilated steps at each of emulation_cost's two batches (1 to 15 steps)


def profile_model(
    spec: ModelSpec,
    batch_size: int,
    *,
    optimizer: str = "momentum",
    repeats: int = 10,
    device: str = "cpu",
    gpu_type: str | None = None,
    dtype: str | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> ModelProfile:
    """Measure every layer of `spec` at `batch_size` on `device`; label the result `gpu_type` (default:
    device). `progress(done, layers)` hears after each layer measured.

    dtype: one of DTYPES to convert the weights and floating-point inputs to (default: the model's own).

    Times: each layer alone on the previous layer's real output, WARMUP untimed forward+backward runs, then
    the median of `repeats` timed forwards and backwards (backward with the optimizer step, as a stage runs
    it); the last layer's forward and backward include the loss. On CUDA the device is synchronised around
    each timing. Each layer's `spread` is repeat_spread of its forward+backward times.

    Sizes (bytes, one minibatch):
    - param_bytes: parameters and buffers; optimizer_bytes: OPTIMIZER_STATE[optimizer] x trainable ones.
    - output_bytes: the layer's output, what crosses a stage boundary.
    - saved_bytes: storages autograd saves during the layer's forward (saved_tensors_hooks), without the
      layer's own weights and without storages an earlier layer already saved: a ReLU output that the next
      Linear saves again counts once, in the ReLU's layer, so a layer that only saves an input its
      predecessor saved shows 0 (the last layer still shows the loss's saved tensors). When a stage starts
      at a layer that saves its input (a conv after a pool, the first layer on the model input), the
      memory model counts that input twice, as input buffer and as saved: conservative by one activation
      per in-flight minibatch.
    - working_bytes: the gradient of the output plus the gradient of the input (alive together in the
      backward) - an estimate. On CUDA it is the larger of that and the measured peak of a forward+backward
      (torch.cuda.max_memory_allocated) beyond what was allocated before, the saved tensors and the
      parameter gradients (those the memory model counts on their own).

    The origin records when (UTC), where (device kind and name, host fingerprint), the device's matmul rate
    (device_tflops), the load per core before and after, and noise_flags: the caller decides what to do with
    a flagged profile (profile_checked measures once more).
    """
    _check_options(spec, batch_size, optimizer, repeats)
    keep_freed_memory()  # as every stage process does: freed tensors are reused, not faulted in again
    dev = torch.device(device)
    dtype_name = profile_dtype(spec, dtype)
    cast = getattr(torch, dtype_name)
    load_before = load_per_core()
    layers, x0, target = _built_model(spec, batch_size, dev, cast if dtype is not None else None)
    traced = _trace(spec, layers, x0, target)
    measured = _measure_layers(spec, layers, x0, target, traced, dev, optimizer, repeats, progress)
    profile = ModelProfile(
        model=spec.name,
        batch_size=batch_size,
        gpu_type=gpu_type or str(dev),
        dtype=dtype_name,
        torch_version=torch.__version__,
        input_bytes=tensor_bytes(x0),
        layers=measured,
    )
    cost, share = (
        emulation_cost(spec, layers, x0, target, optimizer, profile.step_s)
        if dev.type == "cpu"
        else (1.0, 0.0)
    )
    origin = _origin(profile, spec, dev, cast, optimizer, repeats, load_before, cost, share)
    return replace(profile, origin=origin)


def _built_model(
    spec: ModelSpec, batch_size: int, device: torch.device, cast: torch.dtype | None
) -> tuple[list[nn.Module], Tensor, Tensor]:
    """The model's layers in training mode, an example input and its target on `device`; the layers and a
    floating-point input converted to `cast` when one is given."""
    layers = [spec.build_layer(i, device).train() for i in range(spec.num_layers)]
    x0 = spec.example_input(batch_size).to(device)
    if cast is not None:
        layers = [layer.to(cast) for layer in layers]
        x0 = x0.to(cast) if x0.is_floating_point() else x0
    target = _example_target(spec, batch_size).to(device)
    return layers, x0, target


def _measure_layers(
    spec: ModelSpec,
    layers: Sequence[nn.Module],
    x0: Tensor,
    target: Tensor,
    traced: _Trace,
    device: torch.device,
    optimizer: str,
    repeats: int,
    progress: Callable[[int, int], None] | None = None,
) -> tuple[LayerProfile, ...]:
    """Every layer measured alone, in order, on the previous layer's output from the chained forward;
    `progress(done, layers)` after each."""
    profiles = []
    for i, layer in enumerate(layers):
        x = (
            x0
            if i == 0
            else traced.outputs[i - 1].detach().requires_grad_(traced.outputs[i - 1].is_floating_point())
        )
        profiles.append(_measure_layer(spec, i, layer, x, target, traced, device, optimizer, repeats))
        if progress is not None:
            progress(i + 1, len(layers))
    return tuple(profiles)


def _measure_layer(
    spec: ModelSpec,
    i: int,
    layer: nn.Module,
    x: Tensor,
    target: Tensor,
    traced: _Trace,
    device: torch.device,
    optimizer: str,
    repeats: int,
) -> LayerProfile:
    """Layer `i`'s times (WARMUP untimed steps, then the median of `repeats` timed ones) and sizes, as
    profile_model documents them; the last layer's step includes the loss."""
    last = i == spec.num_layers - 1
    grad_out = None if last else torch.ones_like(traced.outputs[i])
    step = _Step(
        i, layer, x, grad_out, spec.loss if last else None, target if last else None, device, optimizer
    )
    for _ in range(WARMUP):  # lazy initialisation, allocator caches, kernel selection
        step()
    trainable = sum(tensor_bytes(p) for p in layer.parameters() if p.requires_grad)
    input_grad = tensor_bytes(x) if x.requires_grad else 0
    working = tensor_bytes(traced.outputs[i]) + input_grad
    if device.type == "cuda":
        working = max(working, _measured_working(step, device, traced.raw_saved[i] + trainable))
    times = [step() for _ in range(repeats)]
    return LayerProfile(
        name=spec.layer_names[i],
        forward_s=statistics.median(t[0] for t in times),
        backward_s=statistics.median(t[1] for t in times),
        param_bytes=sum(tensor_bytes(t) for t in _own_tensors(layer)),
        optimizer_bytes=OPTIMIZER_STATE[optimizer] * trainable,
        output_bytes=tensor_bytes(traced.outputs[i]),
        saved_bytes=traced.saved[i],
        working_bytes=working,
        spread=round(repeat_spread([f + b for f, b in times]), 4),
    )


def _origin(
    profile: ModelProfile,
    spec: ModelSpec,
    device: torch.device,
    cast: torch.dtype,
    optimizer: str,
    repeats: int,
    load_before: float | None,
    cost: float,
    fixed_share: float,
) -> ProfileOrigin:
    """Where, when and how noisily `profile` was measured: the load per core is the higher of before and now,
    the device's matmul rate is measured now, and the flags are noise_flags'."""
    loads = [load for load in (load_before, load_per_core()) if load is not None]
    load = round(max(loads), 3) if loads else None
    return ProfileOrigin(
        measured_at=datetime.now(UTC).isoformat(timespec="seconds"),
        device=device.type,
        device_name=torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_model(),
        host=host_fingerprint(),
        profiler_version=PROFILER_VERSION,
        optimizer=optimizer,
        options_digest=options_digest(spec),
        repeats=repeats,
        measured_batch=profile.batch_size,
        device_tflops=round(device_tflops(device, cast), 4),
        load_per_core=load,
        flags=noise_flags(profile, load),
        emulation_cost=round(cost, 3),
        emulation_fixed_share=round(fixed_share, 3),
    )


def emulation_cost(
    spec: ModelSpec,
    layers: Sequence[nn.Module],
    x0: Tensor,
    target: Tensor,
    optimizer: str,
    step_s: float,
    slowdown: float = COST_SLOWDOWN,
    budget_s: float = COST_BUDGET_S,
) -> tuple[float, float]:
    """What emulation costs a whole training step beyond the layer-by-layer profile, and how much of it the
    batch does not scale: (the dilated step's CPU time over `step_s`, the layers' sum; the fixed part of its
    forward and backward, from fixed_share of them at `x0`'s batch and at a quarter of it (a long lever: the
    steps are noisy), as a share of the whole step). The update, the same at any batch, stays by proportion
    as the profile has it (a flushing schedule runs it once a wave). Each a dilated_step_s in `budget_s` of
    wall time."""
    full_fb, full_u = dilated_step_s(spec, layers, x0, target, optimizer, slowdown, budget_s)
    batch, part = len(x0), len(x0) // 4
    share = 0.0
    if part >= 1:
        part_fb, _ = dilated_step_s(spec, layers, x0[:part], target[:part], optimizer, slowdown, budget_s)
        share = fixed_share(full_fb, batch, part_fb, part) * full_fb / (full_fb + full_u)
    return (full_fb + full_u) / max(step_s, 1e-12), share


MAX_FIXED_SHARE = 0.9  # a step as costly at a smaller batch still scales a little: no batch is free


def fixed_share(full_s: float, batch: int, part_s: float, part: int) -> float:
    """Of a step's `full_s` at `batch`, the share that does not scale with the batch: the line through
    (part, part_s) and (batch, full_s) at batch 0, over full_s; within [0, MAX_FIXED_SHARE] (a step that
    cost less per sample at the smaller batch is taken as proportional). Pure."""
    per_sample = (full_s - part_s) / (batch - part)
    fixed = full_s - per_sample * batch
    return min(max(fixed / full_s, 0.0), MAX_FIXED_SHARE) if full_s > 0 else 0.0


def dilated_step_s(
    spec: ModelSpec,
    layers: Sequence[nn.Module],
    x0: Tensor,
    target: Tensor,
    optimizer: str,
    slowdown: float = COST_SLOWDOWN,
    budget_s: float = COST_BUDGET_S,
) -> tuple[float, float]:
    """The CPU time of the whole model's training step run as an emulated device runs it, as (forward +
    backward, update): each a block in the emulation's own Dilator at `slowdown`, as a stage runs them
    (worker/stage.py), so the step pays what emulation costs beyond the profile (caches and clocks cold after
    each sleep, the whole step's own overheads). The median of the steps begun within `budget_s` of wall
    time, 1 to 15, after WARMUP undilated ones: a dilated step sleeps about slowdown x its CPU time, so a
    large model's one step (where cold caches weigh little) can take the whole budget, a small one's takes a
    few ms (where they weigh most, and the median of many is needed); on one thread, like the profile."""
    from hetpipe.compute.stage_compute import StageCompute, StageRules
    from hetpipe.core.hardware.emulate import device_dilator

    compute = StageCompute(nn.Sequential(*layers), optimizer, 0.0, 0.9, 0.0, StageRules(nm=1))
    dilator = device_dilator(slowdown)

    def step(dilated: bool) -> list[float]:
        blocks = (
            lambda: compute.forward(0, x0, target, spec.loss, input_grad=False),
            lambda: compute.backward(0, None, target, spec.loss),
            lambda: compute.update(0),
        )
        spent = []
        for name, block in zip("FBU", blocks, strict=True):
            before = dilator.compute_s
            if dilated:
                with dilator.compute(name):
                    block()
            else:
                block()
            spent.append(dilator.compute_s - before)
        compute.sums.clear()
        return spent

    for _ in range(WARMUP):
        step(dilated=False)
    costs: list[list[float]] = []
    deadline = (
        time.perf_counter() + budget_s
    )  # wall time, measured: a costly emulation takes far over slowdown x
    while len(costs) < 15 and (not costs or time.perf_counter() < deadline):
        costs.append(step(dilated=True))
    return statistics.median(f + b for f, b, _ in costs), statistics.median(u for *_, u in costs)


def profile_checked(
    spec: ModelSpec,
    batch_size: int,
    *,
    optimizer: str = "momentum",
    repeats: int = 10,
    device: str = "cpu",
    gpu_type: str | None = None,
    dtype: str | None = None,
    on_flagged: Callable[[ModelProfile], None] | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> ModelProfile:
    """profile_model; when its origin is flagged (noisy or busy), measured once more and the quieter of the
    two kept (the second on a tie), still flagged if it is. `on_flagged(first)` is called before measuring
    again; `progress` goes to each profile_model."""

    def measure() -> ModelProfile:
        return profile_model(
            spec,
            batch_size,
            optimizer=optimizer,
            repeats=repeats,
            device=device,
            gpu_type=gpu_type,
            dtype=dtype,
            progress=progress,
        )

    first = measure()
    if not _flags(first):
        return first
    if on_flagged is not None:
        on_flagged(first)
    second = measure()
    return min((second, first), key=lambda p: (len(_flags(p)), p.spread))


def _flags(profile: ModelProfile) -> tuple[str, ...]:
    return profile.origin.flags if profile.origin is not None else ()


def device_tflops(device: torch.device, dtype: torch.dtype, *, runs: int = 5) -> float:
    """The device's dense matmul rate in `dtype` (TFLOP/s): the fastest of `runs` n x n products after one
    warm-up (n = 512 on CPU, 8192 on CUDA), on the threads the caller allows."""
    n = 8192 if device.type == "cuda" else 512
    gen = torch.Generator().manual_seed(0)
    a, b = (torch.randn(n, n, generator=gen).to(device, dtype) for _ in range(2))
    fastest = math.inf
    for _ in range(runs + 1):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        torch.mm(a, b)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        fastest = min(fastest, time.perf_counter() - start)
    return 2 * n**3 / max(fastest, 1e-9) / 1e12


def _check_options(spec: ModelSpec, batch_size: int, optimizer: str, repeats: int) -> None:
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise UsageError(f"profiling {spec.name}: batch_size must be an integer >= 1, got {batch_size!r}")
    if optimizer not in OPTIMIZER_STATE:
        raise UsageError(
            f'profiling {spec.name}: unknown optimizer "{optimizer}"; '
            f"choose one of: {', '.join(OPTIMIZER_STATE)}"
        )
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise UsageError(f"profiling {spec.name}: repeats must be an integer >= 1, got {repeats!r}")


def profile_dtype(spec: ModelSpec, dtype: str | None) -> str:
    """The dtype a profile is measured in: `dtype` (one of DTYPES) or the model's own."""
    if dtype is None:
        return _model_dtype(spec)
    if dtype not in DTYPES:
        raise UsageError(
            f'profiling {spec.name}: dtype "{dtype}" is not supported; choose one of: {", ".join(DTYPES)}'
        )
    return dtype


def _example_target(spec: ModelSpec, batch_size: int) -> Tensor:
    shape = (batch_size,) if spec.task == "classification" else (batch_size, *spec.input_shape)
    return torch.randint(0, spec.num_classes, shape, generator=torch.Generator().manual_seed(1))


@dataclass(frozen=True)
class _Trace:
    outputs: list[Tensor]  # each layer's output on the chained forward
    saved: list[int]  # saved_bytes as profile_model documents it
    raw_saved: list[int]  # everything the layer saved except its weights and its input (for CUDA working)


def _trace(spec: ModelSpec, layers: Sequence[nn.Module], x0: Tensor, target: Tensor) -> _Trace:
    """One forward through the whole model, the graph kept alive so storage addresses stay unique."""
    seen: set[int] = set()
    outputs: list[Tensor] = []
    saved: list[int] = []
    raw_saved: list[int] = []
    x = x0
    keep: list[Tensor] = []  # the loss, so its saved tensors stay alive until the end
    for i, layer in enumerate(layers):
        own = {storage_key(t) for t in _own_tensors(layer)}
        found: dict[int, int] = {}

        def pack(t: Tensor, own: set[int] = own, found: dict[int, int] = found) -> Tensor:
            key = storage_key(t)
            if key not in own and key != 0:
                found[key] = _storage_bytes(t)
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, _identity):
            out = layer(x)
            if i == len(layers) - 1:
                keep.append(spec.loss(out, target))
        saved.append(sum(size for key, size in found.items() if key not in seen))
        raw_saved.append(sum(size for key, size in found.items() if key != storage_key(x)))
        seen.update(found)
        outputs.append(out)
        x = out
    return _Trace(outputs, saved, raw_saved)


class _Step:
    """One timed forward and backward of one layer as a stage runs it: returns (forward_s, backward_s).

    Through the runtime's own StageCompute, so the times include what a stage pays besides the layer's
    kernels: the stashed weight copy and functional call in the forward, the optimizer step and the update
    bookkeeping (Δ, wave sum, baseline) after the backward. Those scale with the weights and are dilated
    like the kernels under emulation; leaving them out made small models look twice as fast as they run.
    """

    def __init__(
        self,
        index: int,
        layer: nn.Module,
        x: Tensor,
        grad_out: Tensor | None,
        loss: Callable[[Tensor, Tensor], Tensor] | None,
        target: Tensor | None,
        device: torch.device,
        optimizer: str,
    ) -> None:
        from hetpipe.compute.stage_compute import StageCompute, StageRules

        module = nn.Sequential()
        module.add_module(str(index), layer)
        self.compute = StageCompute(module, optimizer, 0.0, 0.9, 0.0, StageRules(nm=1))
        self.x, self.grad_out, self.loss, self.target, self.device = x, grad_out, loss, target, device
        self.input_grad = index > 0

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def __call__(self) -> tuple[float, float]:
        self._sync()
        start = time.perf_counter()
        self.compute.forward(0, self.x, self.target, self.loss, input_grad=self.input_grad)
        self._sync()
        middle = time.perf_counter()
        flight = self.compute.in_flight[0]
        if not (flight.output.requires_grad or (flight.loss is not None and flight.loss.requires_grad)):
            self.compute.in_flight.clear()  # no weights, and the input needs no gradient: no backward to run
            return middle - start, 0.0
        self.compute.backward(0, self.grad_out, self.target, self.loss)
        self.compute.update(0)
        self.compute.sums.clear()
        self._sync()
        return middle - start, time.perf_counter() - middle


def _measured_working(step: _Step, device: torch.device, accounted: int) -> int:
    """Peak allocated during one forward+backward beyond the start, minus what is counted elsewhere."""
    step.compute.module.zero_grad(set_to_none=True)
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    step()
    return max(0, torch.cuda.max_memory_allocated(device) - base - accounted)


def _identity(t: Tensor) -> Tensor:
    return t


def _own_tensors(layer: nn.Module) -> Iterator[Tensor]:
    yield from layer.parameters()
    yield from layer.buffers()


def tensor_bytes(t: Tensor) -> int:
    return t.nelement() * t.element_size()


def storage_key(t: Tensor) -> int:
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # tensors without a plain storage
        return id(t)


def _storage_bytes(t: Tensor) -> int:
    try:
        return t.untyped_storage().nbytes()
    except (RuntimeError, NotImplementedError):
        return tensor_bytes(t)


def _model_dtype(spec: ModelSpec) -> str:
    """The dtype of the model's first floating-point parameter (built on meta: no memory, no time)."""
    for i in range(spec.num_layers):
        for p in spec.build_layer(i, "meta").parameters():
            if p.is_floating_point():
                return str(p.dtype).removeprefix("torch.")
    return str(torch.get_default_dtype()).removeprefix("torch.")


# ---------------------------------------------------------------------------------------------- cache


def options_digest(spec: ModelSpec) -> str:
    """12 hex digits naming the model's variant: its options, input shape and input dtype."""
    return variant_digest(spec.options, spec.input_shape, str(spec.input_dtype))


def profile_cache_path(
    spec: ModelSpec,
    batch_size: int,
    gpu_type: str,
    cache_dir: str | Path,
    *,
    optimizer: str = "momentum",
    dtype: str | None = None,
) -> Path:
    """Where cached_profile keeps (or looks for) this profile: one JSON file per model, options, batch,
    GPU type, dtype, optimizer, torch version and PROFILER_VERSION. Copy a profile measured elsewhere to this
    path to use it."""
    name = cache_file_name(
        spec.name,
        options_digest(spec),
        batch_size,
        gpu_type,
        dtype or _model_dtype(spec),
        optimizer,
        torch.__version__,
    )
    return Path(cache_dir) / name


def cached_profile(
    spec: ModelSpec,
    batch_size: int,
    gpu_type: str,
    cache_dir: str | Path,
    *,
    optimizer: str = "momentum",
    repeats: int = 10,
    device: str = "cpu",
    dtype: str | None = None,
    measure: bool = True,
    refresh: bool = False,
    on_flagged: Callable[[ModelProfile], None] | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> ModelProfile:
    """The profile from the cache when there, else measured on `device` (labelled `gpu_type`) and stored.

    Measuring is profile_checked's: a flagged measurement is taken once more (`on_flagged` hears of it, and
    `progress` of each layer measured) and the quieter one stored, its flags kept. refresh=True measures
    even when the cache holds the profile and replaces the entry. measure=False only reads: a GPU type this
    machine does not have needs a profile file measured there (or one made with derive_profile);
    HetpipeError names the path it looked for.
    """
    _check_options(spec, batch_size, optimizer, repeats)
    dtype = profile_dtype(spec, dtype)
    path = profile_cache_path(spec, batch_size, gpu_type, cache_dir, optimizer=optimizer, dtype=dtype)
    problem = "no such file"
    if path.exists() and not refresh:
        try:
            found = ModelProfile.load(path)
        except (OSError, ValueError, TypeError, KeyError) as exc:
            problem = f"unreadable ({type(exc).__name__}: {exc})"
        else:
            expected = (spec.name, batch_size, gpu_type, dtype, torch.__version__, spec.num_layers)
            actual = (
                found.model,
                found.batch_size,
                found.gpu_type,
                found.dtype,
                found.torch_version,
                found.num_layers,
            )
            if actual == expected:
                return found
            problem = f"holds model/batch/gpu/dtype/torch/layers {actual}, expected {expected}"
    if not measure:
        raise HetpipeError(
            f"no usable profile of {spec.name} at batch {batch_size} for GPU type {gpu_type}: "
            f"{path}: {problem}\n  profile on a machine with that GPU and copy the file there, "
            f"or derive one: hetpipe profile {spec.name} --batch {batch_size} --gpu-type {gpu_type} "
            "--like cuda --speed RATIO"
        )
    profile = profile_checked(
        spec,
        batch_size,
        optimizer=optimizer,
        repeats=repeats,
        device=device,
        gpu_type=gpu_type,
        dtype=dtype,
        on_flagged=on_flagged,
        progress=progress,
    )
    write_profile(path, profile)
    return profile


def write_profile(path: Path, profile: ModelProfile) -> None:
    """Store `profile` at `path` atomically (a reader never sees half a file)."""
    _write_atomic(path, profile.to_json())


def _write_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
