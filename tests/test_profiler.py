"""Measuring profiles (hetpipe/compute/profiler.py): fields of real measurements, where and how noisily they
were taken, the JSON cache and --refresh, emulated types."""

from __future__ import annotations

import itertools
import math
import socket
from collections.abc import Iterator
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
import torch

from hetpipe.compute.machine import cpu_model, host_fingerprint
from hetpipe.compute.profiler import (
    MAX_FIXED_SHARE,
    PROFILER_VERSION,
    WARMUP,
    cached_profile,
    emulation_cost,
    fixed_share,
    options_digest,
    profile_cache_path,
    profile_checked,
    profile_model,
)
from hetpipe.core.errors import HetpipeError, UsageError
from hetpipe.core.planning.profile import BUSY_LOAD, NOISY_SPREAD, ModelProfile, derive_profile
from hetpipe.models import get_model

BATCH = 8


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    """As every stage process does (docs/architecture.md#conventions): profile_model leaves the thread count
    to its caller."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def mlp_profile() -> ModelProfile:
    return profile_model(get_model("mlp", image_size=8, hidden=(16,)), BATCH, repeats=2)


@pytest.fixture(scope="module")
def cnn_profile() -> ModelProfile:
    return profile_model(get_model("mnist-cnn"), BATCH, repeats=2)


def test_mlp_fields_follow_the_layers(mlp_profile: ModelProfile) -> None:
    p = mlp_profile
    assert (p.model, p.batch_size, p.gpu_type, p.dtype, p.torch_version) == (
        "mlp",
        BATCH,
        "cpu",
        "float32",
        torch.__version__,
    )
    assert [layer.name for layer in p.layers] == ["flatten", "fc1", "head"]
    assert p.input_bytes == BATCH * 64 * 4
    flatten, fc1, head = p.layers
    assert [layer.param_bytes for layer in p.layers] == [0, (64 * 16 + 16) * 4, (16 * 10 + 10) * 4]
    assert [layer.optimizer_bytes for layer in p.layers] == [
        layer.param_bytes for layer in p.layers
    ]  # momentum
    assert [layer.output_bytes for layer in p.layers] == [BATCH * 64 * 4, BATCH * 16 * 4, BATCH * 10 * 4]
    # flatten saves nothing (a view); fc1's Linear saves its input (the flattened batch), its ReLU its output;
    # the head's Linear saves that same ReLU output (counted once, in fc1) and the loss saves its own
    assert flatten.saved_bytes == 0
    assert fc1.saved_bytes == BATCH * 64 * 4 + BATCH * 16 * 4
    assert head.saved_bytes > 0
    assert all(layer.forward_s > 0 for layer in p.layers)
    assert fc1.backward_s > 0 and head.backward_s > 0
    assert flatten.backward_s == 0.0  # no weights and the data needs no gradient: nothing to run
    # working: output gradient + input gradient (stage 0's first layer gets none for its input)
    assert flatten.working_bytes == BATCH * 64 * 4
    assert fc1.working_bytes == BATCH * 16 * 4 + BATCH * 64 * 4


def test_cnn_fields_positive_where_they_should_be(cnn_profile: ModelProfile) -> None:
    p = cnn_profile
    assert [layer.name for layer in p.layers] == ["conv1", "pool1", "conv2", "pool2", "fc", "head"]
    for layer in p.layers:
        assert layer.forward_s > 0 and layer.backward_s > 0, layer
        assert layer.output_bytes > 0 and layer.working_bytes > 0, layer
        assert layer.saved_bytes > 0, layer  # every layer saves something (pools: the ReLU output, indices)
        has_weights = layer.name not in ("pool1", "pool2")
        assert (layer.param_bytes > 0) == has_weights, layer
        assert layer.optimizer_bytes == layer.param_bytes
    assert p.layers[0].output_bytes == BATCH * 32 * 28 * 28 * 4
    assert p.layers[1].output_bytes == BATCH * 32 * 14 * 14 * 4
    assert p.layers[0].saved_bytes == p.input_bytes  # conv1 saves the image batch (its weight is not counted)
    assert p.layers[2].saved_bytes == p.layers[1].output_bytes  # conv2 saves its input, which pool1 did not


def test_optimizer_state_multiplier() -> None:
    spec = get_model("mlp", image_size=4, hidden=(8,))
    sgd = profile_model(spec, 2, optimizer="sgd", repeats=1)
    adam = profile_model(spec, 2, optimizer="adam", repeats=1)
    assert [layer.optimizer_bytes for layer in sgd.layers] == [0, 0, 0]
    assert [layer.optimizer_bytes for layer in adam.layers] == [
        2 * layer.param_bytes for layer in adam.layers
    ]


def test_language_model_profiles() -> None:
    p = profile_model(get_model("char-gpt", n_layer=1, n_embd=16, n_head=2, block_size=8), 2, repeats=1)
    assert p.input_bytes == 2 * 8 * 8  # int64 token ids
    assert p.dtype == "float32"
    assert all(layer.saved_bytes > 0 and layer.param_bytes > 0 for layer in p.layers)


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"batch_size": 0}, "batch_size"),
        ({"optimizer": "rmsprop"}, "choose one of: sgd, momentum, adam"),
        ({"repeats": 0}, "repeats"),
    ],
)
def test_bad_options(options: dict, match: str) -> None:
    kwargs = {"batch_size": 2, **options}
    with pytest.raises(UsageError, match=match):
        profile_model(get_model("mlp", image_size=4, hidden=(8,)), **kwargs)


# ---------------------------------------------------------------------------------------------- cache


def test_cache_round_trip(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    spec = get_model("mlp", image_size=4, hidden=(8,))
    first = cached_profile(spec, 2, "titan-v", tmp_path, repeats=1)
    assert first.gpu_type == "titan-v"
    path = profile_cache_path(spec, 2, "titan-v", tmp_path)
    assert path.exists() and ModelProfile.load(path) == first

    def no_measuring(*args: object, **kwargs: object) -> ModelProfile:
        raise AssertionError("measured although the cache holds the profile")

    monkeypatch.setattr("hetpipe.compute.profiler.profile_model", no_measuring)
    assert cached_profile(spec, 2, "titan-v", tmp_path, repeats=1) == first
    assert cached_profile(spec, 2, "titan-v", tmp_path, measure=False) == first


def test_measuring_reports_each_layer_through_the_cache(tmp_path: Path) -> None:
    """cached_profile passes `progress` down to every layer measured; a cached profile measures nothing."""
    spec = get_model("mlp", image_size=4, hidden=(8,))
    heard: list[tuple[int, int]] = []
    cached_profile(spec, 2, "cpu", tmp_path, repeats=1, progress=lambda done, n: heard.append((done, n)))
    n = spec.num_layers
    # once per layer, in order; a flagged (noisy) first measurement is measured again from the first layer
    assert heard[:n] == [(i, n) for i in range(1, n + 1)] and len(heard) in (n, 2 * n)
    heard.clear()
    cached_profile(spec, 2, "cpu", tmp_path, repeats=1, progress=lambda done, n: heard.append((done, n)))
    assert heard == []


def test_cache_key_sensitivity(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    spec = get_model("mlp", image_size=4, hidden=(8,))
    base = profile_cache_path(spec, 2, "titan-v", tmp_path)
    others = [
        profile_cache_path(get_model("mlp", image_size=4, hidden=(9,)), 2, "titan-v", tmp_path),
        profile_cache_path(get_model("mnist-cnn"), 2, "titan-v", tmp_path),
        profile_cache_path(spec, 4, "titan-v", tmp_path),
        profile_cache_path(spec, 2, "rtx-2060", tmp_path),
        profile_cache_path(spec, 2, "titan-v", tmp_path, optimizer="adam"),
    ]
    monkeypatch.setattr(torch, "__version__", "9.9.9")
    others.append(profile_cache_path(spec, 2, "titan-v", tmp_path))
    monkeypatch.undo()
    assert base == profile_cache_path(get_model("mlp", image_size=4, hidden=(8,)), 2, "titan-v", tmp_path)
    monkeypatch.setattr("hetpipe.compute.profiler._model_dtype", lambda spec: "bfloat16")
    others.append(profile_cache_path(spec, 2, "titan-v", tmp_path))
    assert len({base, *others}) == len(others) + 1
    assert (
        base.parent == tmp_path
        and base.name.startswith("mlp-")
        and "-b2-titan-v-float32-momentum-" in base.name
    )


def test_cache_refuses_or_remeasures_a_wrong_file(tmp_path: Path) -> None:
    spec = get_model("mlp", image_size=4, hidden=(8,))
    path = profile_cache_path(spec, 2, "titan-v", tmp_path)
    path.write_text("{not json")
    with pytest.raises(HetpipeError, match=r"unreadable.*\n  profile on a machine with that GPU"):
        cached_profile(spec, 2, "titan-v", tmp_path, measure=False)
    measured = cached_profile(spec, 2, "titan-v", tmp_path, repeats=1)  # heals the cache
    assert ModelProfile.load(path) == measured
    with pytest.raises(HetpipeError, match="no such file"):
        cached_profile(spec, 2, "p4000", tmp_path, measure=False)
    # a file for another batch copied to this path is not trusted
    path.write_text(profile_model(spec, 3, repeats=1).to_json())
    with pytest.raises(HetpipeError, match="expected"):
        cached_profile(spec, 2, "titan-v", tmp_path, measure=False)


# ---------------------------------------------------------------------------------------------- emulation


@pytest.mark.parametrize(("budget_s", "dilated"), [(0.0, 1), (1e9, 15)])
def test_emulation_cost_times_the_steps_its_wall_budget_begins(
    budget_s: float, dilated: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """At least one dilated step, and at most 15 (a large model's one step can take the whole budget), at the
    batch and at a quarter of it."""
    from hetpipe.compute.stage_compute import StageCompute

    spec = get_model("mlp", image_size=4, hidden=(8,))
    layers = [spec.build_layer(i, torch.device("cpu")) for i in range(spec.num_layers)]
    x0, target = spec.example_input(4), torch.tensor([1, 2, 3, 4])
    updates = []
    plain_update = StageCompute.update
    monkeypatch.setattr(StageCompute, "update", lambda self, p: (updates.append(p), plain_update(self, p)))
    cost, share = emulation_cost(spec, layers, x0, target, "momentum", 1e-4, slowdown=1.0, budget_s=budget_s)
    assert len(updates) == 2 * (WARMUP + dilated) and 0 < cost < math.inf and 0 <= share <= MAX_FIXED_SHARE


def test_fixed_share_is_the_steps_line_at_batch_zero() -> None:
    # 2.0 s at 64 and 1.2 at 32: 0.025 s a sample, 0.4 s at batch 0, a fifth of the step
    assert fixed_share(2.0, 64, 1.2, 32) == pytest.approx(0.2)
    assert fixed_share(2.0, 64, 1.0, 32) == 0.0  # by proportion
    assert fixed_share(2.0, 64, 0.9, 32) == 0.0  # cheaper a sample at the smaller batch: as proportional
    assert fixed_share(2.0, 64, 2.0, 32) == MAX_FIXED_SHARE  # as costly at half: bounded


def test_derive_profile_scales_times_only(mlp_profile: ModelProfile) -> None:
    # a type half as fast as the reference, emulated at time_scale 3: 6x the measured times
    slow = derive_profile(mlp_profile, 5.0, 10.0, 3.0, gpu_type="half")
    assert slow.gpu_type == "half"
    for a, b in zip(mlp_profile.layers, slow.layers, strict=True):
        assert b.forward_s == pytest.approx(6 * a.forward_s)
        assert b.backward_s == pytest.approx(6 * a.backward_s)
        assert (b.param_bytes, b.saved_bytes, b.output_bytes, b.working_bytes) == (
            a.param_bytes,
            a.saved_bytes,
            a.output_bytes,
            a.working_bytes,
        )
    same = derive_profile(mlp_profile, 10.0, 10.0, 1.0)
    assert same.layers == mlp_profile.layers and same.gpu_type == mlp_profile.gpu_type
    assert same.origin == replace(mlp_profile.origin, derived_from="cpu")
    with pytest.raises(UsageError, match="gpu_type_speed must be a finite number > 0"):
        derive_profile(mlp_profile, 0.0, 10.0, 1.0)
    with pytest.raises(UsageError, match="time_scale"):
        derive_profile(mlp_profile, 1.0, 10.0, float("inf"))


# ---------------------------------------------------------------------------------------- origin and noise


def test_origin_records_the_emulation_cost(monkeypatch: pytest.MonkeyPatch) -> None:
    """A CPU profile measures what a dilated step costs over its layers, and how much of it the batch does
    not scale, and keeps both, rounded, in its origin (not the defaults of a profile that did not measure
    them)."""
    import hetpipe.compute.profiler as profiler

    batches: list[int] = []

    def measured(spec: object, layers: object, x: torch.Tensor, *args: object) -> tuple[float, float]:
        batches.append(len(x))
        # forward + backward: 0.4 s fixed and 0.2 s a sample; an update of 0.5 s at any batch
        return {BATCH: (2.0, 0.5), BATCH // 4: (0.8, 0.5)}[len(x)]

    monkeypatch.setattr(profiler, "dilated_step_s", measured)
    got = profile_model(get_model("mlp", image_size=8, hidden=(16,)), BATCH, repeats=2)
    assert got.origin is not None and got.origin.emulation_cost == round(2.5 / got.step_s, 3)
    assert got.origin.emulation_fixed_share == 0.16  # 0.4 of the whole step's 2.5 s
    assert batches == [BATCH, BATCH // 4] and got.origin.fixed_share == 0.0  # the CPU's own: by proportion


def test_origin_says_when_where_and_how(mlp_profile: ModelProfile) -> None:
    o = mlp_profile.origin
    assert o is not None
    age = datetime.now(UTC) - datetime.fromisoformat(o.measured_at)
    assert timedelta(0) <= age < timedelta(hours=1)
    assert (o.device, o.device_name, o.host) == ("cpu", cpu_model(), host_fingerprint())
    assert len(o.host) == 16 and int(o.host, 16) >= 0
    assert (o.profiler_version, o.optimizer, o.repeats, o.measured_batch) == (
        PROFILER_VERSION,
        "momentum",
        2,
        BATCH,
    )
    assert o.options_digest == options_digest(get_model("mlp", image_size=8, hidden=(16,)))
    assert o.device_tflops > 0 and (o.load_per_core is None or o.load_per_core >= 0)
    assert (o.derived_from, o.speed_ratio) == ("", 1.0)
    # the whole step dilated over its layers. This MLP's blocks take ~0.1 ms, and on a 2-core VM each one
    # after a sleep ran 1-100x slower (cold caches and clocks; 0.8-135 seen, once 1.000 to its 3 decimals):
    # no bound on a timing here. That the origin keeps what was measured: the test above.
    assert 0 < o.emulation_cost < math.inf
    assert all(layer.spread == 0.0 for layer in mlp_profile.layers)  # 2 repeats: too few to judge
    hostname = socket.gethostname()
    if len(hostname) >= 6:  # a very short name could appear by chance
        assert hostname not in mlp_profile.to_json()
    assert ModelProfile.from_json(mlp_profile.to_json()) == mlp_profile


def test_bfloat16_profile_halves_the_weights() -> None:
    spec = get_model("mlp", image_size=4, hidden=(8,))
    fp32 = profile_model(spec, 2, repeats=1)
    bf16 = profile_model(spec, 2, repeats=1, dtype="bfloat16")
    assert (fp32.dtype, bf16.dtype) == ("float32", "bfloat16")
    assert [2 * layer.param_bytes for layer in bf16.layers] == [layer.param_bytes for layer in fp32.layers]
    assert profile_cache_path(spec, 2, "cpu", "c", dtype="bfloat16") != profile_cache_path(
        spec, 2, "cpu", "c"
    )
    with pytest.raises(UsageError, match="choose one of: float32, bfloat16"):
        profile_model(spec, 2, dtype="float16")


def steady_steps(monkeypatch: pytest.MonkeyPatch, times: Iterator[tuple[float, float]] | None = None) -> None:
    """Every timed forward+backward takes what `times` says (default 1 ms + 2 ms): the repeats are
    injected."""
    from hetpipe.compute import profiler

    real = profiler._Step.__call__
    source = times if times is not None else itertools.repeat((0.001, 0.002))

    def call(self: object) -> tuple[float, float]:
        real(self)  # run it for real (the warm-up and the CUDA peak need that), report the injected time
        return next(source)

    monkeypatch.setattr(profiler._Step, "__call__", call)


def loads(monkeypatch: pytest.MonkeyPatch, *values: float) -> None:
    """load_per_core returns `values` in turn (two per measurement: before and after), then the last
    forever."""
    sequence = itertools.chain(values, itertools.repeat(values[-1]))
    monkeypatch.setattr("hetpipe.compute.profiler.load_per_core", lambda: next(sequence))


def test_noisy_repeats_are_flagged(monkeypatch: pytest.MonkeyPatch) -> None:
    # every layer alternates 3 ms and 9 ms per repeat: p90 - p10 over the median far above NOISY_SPREAD
    steady_steps(monkeypatch, itertools.cycle([(0.001, 0.002), (0.003, 0.006)]))
    loads(monkeypatch, 0.0)
    p = profile_model(get_model("mlp", image_size=4, hidden=(8,)), 2, repeats=10)
    assert p.spread > NOISY_SPREAD
    assert p.origin.flagged and p.origin.flags[0].startswith("noisy: repeats spread")


def test_busy_machine_is_measured_again_then_flagged(monkeypatch: pytest.MonkeyPatch) -> None:
    steady_steps(monkeypatch)
    spec = get_model("mlp", image_size=4, hidden=(8,))
    measured: list[ModelProfile] = []
    real = profile_model

    def counting(*args: object, **kwargs: object) -> ModelProfile:
        measured.append(real(*args, **kwargs))
        return measured[-1]

    monkeypatch.setattr("hetpipe.compute.profiler.profile_model", counting)
    heard: list[ModelProfile] = []
    loads(monkeypatch, 3 * BUSY_LOAD)  # busy throughout: measured twice, kept flagged
    busy = profile_checked(spec, 2, repeats=3, on_flagged=heard.append)
    assert len(measured) == 2 and heard == [measured[0]]
    assert busy.origin.flags == (
        f"busy: load average {3 * BUSY_LOAD:.2f} per core while measuring (limit {BUSY_LOAD:g})",
    )
    measured.clear()
    loads(
        monkeypatch, 3 * BUSY_LOAD, 3 * BUSY_LOAD, 0.1
    )  # quiet again for the second measurement: that one is kept
    quiet = profile_checked(spec, 2, repeats=3)
    assert len(measured) == 2 and quiet is measured[1] and not quiet.origin.flagged
    measured.clear()
    loads(monkeypatch, 0.1)  # quiet from the start: measured once
    assert not profile_checked(spec, 2, repeats=3).origin.flagged and len(measured) == 1


def test_refresh_replaces_a_flagged_cache_entry(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    steady_steps(monkeypatch)
    spec = get_model("mlp", image_size=4, hidden=(8,))
    path = profile_cache_path(spec, 2, "cpu", tmp_path)
    loads(monkeypatch, 3 * BUSY_LOAD)
    flagged = cached_profile(spec, 2, "cpu", tmp_path, repeats=3)
    assert flagged.origin.flagged and ModelProfile.load(path) == flagged
    loads(monkeypatch, 0.1)
    assert cached_profile(spec, 2, "cpu", tmp_path, repeats=3) == flagged  # the cache is read as it is ...
    fresh = cached_profile(spec, 2, "cpu", tmp_path, repeats=3, refresh=True)  # ... until refreshed
    assert not fresh.origin.flagged and ModelProfile.load(path) == fresh


def test_cli_profile_refresh_replaces_the_entry(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from click.testing import CliRunner

    from hetpipe.cli import cli

    steady_steps(monkeypatch)
    args = [
        "profile",
        "mlp",
        "--batch",
        "2",
        "--option",
        "image_size=4",
        "--option",
        "hidden=[8]",
        "--repeats",
        "3",
        "--cache",
        str(tmp_path),
    ]
    loads(monkeypatch, 3 * BUSY_LOAD)
    first = CliRunner().invoke(cli, args)
    assert first.exit_code == 0, first.output
    assert "flagged: busy: load average 3.00 per core" in first.output
    assert "not trusted (busy: load average 3.00" in first.output  # said while measuring once more
    loads(monkeypatch, 0.1)
    cached = CliRunner().invoke(cli, args)
    assert "profile from the cache" in cached.output and "flagged: busy" in cached.output
    refreshed = CliRunner().invoke(cli, [*args, "--refresh"])
    assert refreshed.exit_code == 0, refreshed.output
    assert "profiled in" in refreshed.output and "flagged" not in refreshed.output
    path = profile_cache_path(
        get_model("mlp", image_size=4, hidden=[8]), 2, "cpu", tmp_path
    )  # a list, as parsed
    assert not ModelProfile.load(path).origin.flagged
