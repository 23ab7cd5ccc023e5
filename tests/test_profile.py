"""Profile data and rules (hetpipe/core/planning/profile.py): origin round trip, repeat spread, noise flags,
warnings, scaling."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime, timedelta

import pytest

from hetpipe.core.errors import UsageError
from hetpipe.core.planning.profile import (
    BUSY_LOAD,
    NOISY_SPREAD,
    STALE_DAYS,
    LayerProfile,
    ModelProfile,
    ProfileOrigin,
    derive_profile,
    noise_flags,
    origin_warnings,
    repeat_spread,
)

NOW = datetime(2025, 6, 1, 12, 0, tzinfo=UTC)
HOST = "0123456789abcdef"


def origin(**changes: object) -> ProfileOrigin:
    base = ProfileOrigin(
        measured_at=NOW.isoformat(timespec="seconds"),
        device="cpu",
        device_name="Some CPU",
        host=HOST,
        profiler_version=6,
        optimizer="momentum",
        options_digest="abc",
        repeats=10,
        measured_batch=8,
        device_tflops=0.1,
        load_per_core=0.2,
    )
    return replace(base, **changes)


def profile(
    spreads: tuple[float, ...] = (0.0, 0.0), times: tuple[float, ...] = (0.01, 0.03), **origin_changes: object
) -> ModelProfile:
    """Layers with forward = backward = times[i] / 2, 1 KiB of everything per sample at batch 8."""
    layers = tuple(
        LayerProfile(f"l{i}", t / 2, t / 2, 4096, 4096, 8192, 16384, 8192, s)
        for i, (t, s) in enumerate(zip(times, spreads, strict=True))
    )
    return ModelProfile("toy", 8, "cpu", "float32", "2.x", 8 * 1024, layers, origin(**origin_changes))


def test_origin_round_trips_through_json() -> None:
    p = profile((0.1, 0.2), flags=("busy: load 3.00 per core",), derived_from="cpu", speed_ratio=150.0)
    back = ModelProfile.from_json(p.to_json())
    assert back == p
    assert (
        back.origin is not None and back.origin.flags == ("busy: load 3.00 per core",) and back.origin.flagged
    )


def test_a_profile_written_before_origins_loads_without_one() -> None:
    old = (
        '{"model": "toy", "batch_size": 2, "gpu_type": "cpu", "dtype": "float32", "torch_version": "2.x", '
        '"input_bytes": 8, "layers": [{"name": "l0", "forward_s": 0.1, "backward_s": 0.2, "param_bytes": 4, '
        '"optimizer_bytes": 4, "output_bytes": 8, "saved_bytes": 8, "working_bytes": 8}]}'
    )
    p = ModelProfile.from_json(old)
    assert p.origin is None and p.layers[0].spread == 0.0
    assert origin_warnings(p, now=NOW, host=HOST) == [
        "no record of when, where or how noisily it was measured (made by hand or by an older hetpipe)"
    ]


@pytest.mark.parametrize(
    ("times", "spread"),
    [
        ([1.0, 1.0, 1.0, 1.0], 0.0),
        ([1.0, 2.0], 0.0),  # fewer than 3 repeats: too few to judge
        ([1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 2.0], 0.1),  # p90 = 1 + 0.1 x (2 - 1) by interpolation
        ([0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0], 8.0 / 5.0),  # (9 - 1) / 5
    ],
)
def test_repeat_spread(times: list[float], spread: float) -> None:
    assert repeat_spread(times) == pytest.approx(spread)


def test_spread_is_weighted_by_layer_time() -> None:
    # a tiny layer's jitter matters less than a big layer's: (0.01 x 1.0 + 0.03 x 0.0) / 0.04
    assert profile((1.0, 0.0)).spread == pytest.approx(0.25)
    assert profile((0.0, 1.0)).spread == pytest.approx(0.75)


def test_noise_flags_name_spread_and_load() -> None:
    quiet = profile((NOISY_SPREAD, NOISY_SPREAD))
    assert noise_flags(quiet, BUSY_LOAD) == ()
    assert noise_flags(quiet, None) == ()
    noisy = profile((0.0, 2 * NOISY_SPREAD))
    (flag,) = noise_flags(noisy, 0.1)
    assert flag.startswith("noisy: repeats spread 38%")
    both = noise_flags(noisy, 2.5)
    assert len(both) == 2 and both[1].startswith("busy: load average 2.50 per core")


def test_origin_warnings_stale_foreign_flagged() -> None:
    fresh = profile()
    assert origin_warnings(fresh, now=NOW + timedelta(days=STALE_DAYS - 1), host=HOST) == []
    old = origin_warnings(fresh, now=NOW + timedelta(days=STALE_DAYS + 10))
    assert old == [f"stale: measured {STALE_DAYS + 10} days ago (2025-06-01; older than {STALE_DAYS} days)"]
    (foreign,) = origin_warnings(fresh, now=NOW, host="fedcba9876543210")
    assert foreign.startswith("foreign: measured on another machine (Some CPU, host 0123456789abcdef")
    assert origin_warnings(fresh) == []  # no clock, no host: nothing to compare with
    (flagged,) = origin_warnings(profile(flags=("busy: load average 2.50 per core",)))
    assert flagged == "flagged when measured: busy: load average 2.50 per core"
    (derived,) = origin_warnings(profile(derived_from="cpu", speed_ratio=150.0))
    assert derived == "derived, not measured: the cpu profile's times / 150"


def test_at_batch_scales_per_minibatch_quantities_only() -> None:
    p = profile()
    q = p.at_batch(32)
    assert (q.batch_size, q.input_bytes, q.origin) == (
        32,
        4 * p.input_bytes,
        p.origin,
    )  # origin keeps batch 8
    for a, b in zip(p.layers, q.layers, strict=True):
        assert (b.forward_s, b.backward_s) == pytest.approx((4 * a.forward_s, 4 * a.backward_s))
        assert (b.output_bytes, b.saved_bytes, b.working_bytes) == (
            4 * a.output_bytes,
            4 * a.saved_bytes,
            4 * a.working_bytes,
        )
        assert (b.param_bytes, b.optimizer_bytes) == (a.param_bytes, a.optimizer_bytes)
    with pytest.raises(UsageError, match="batch_size"):
        p.at_batch(0)


def test_at_batch_keeps_the_fixed_share_of_every_time() -> None:
    """An emulated type's profile with a quarter of each time fixed (each block's cold start): at half the
    batch a time is 0.75 / 2 + 0.25 = 0.625 of itself, at twice 1.75, and the fixed part, the same seconds,
    is then a larger or smaller share of the new times; back at the first batch, the first times."""
    p = profile(fixed_share=0.25)
    half, double = p.at_batch(4), p.at_batch(16)
    for a, h, d in zip(p.layers, half.layers, double.layers, strict=True):
        assert (h.forward_s, h.backward_s) == pytest.approx((0.625 * a.forward_s, 0.625 * a.backward_s))
        assert d.forward_s == pytest.approx(1.75 * a.forward_s)
        assert (h.output_bytes, d.output_bytes) == (a.output_bytes // 2, 2 * a.output_bytes)  # memory x batch
    assert half.origin.fixed_share == pytest.approx(0.4)
    assert double.origin.fixed_share == pytest.approx(0.25 / 1.75)
    back = half.at_batch(8)
    assert [x.forward_s for x in back.layers] == pytest.approx([x.forward_s for x in p.layers])
    assert back.origin.fixed_share == pytest.approx(0.25)


def test_derive_by_flop_rate_records_where_it_came_from() -> None:
    # a 15 TFLOPS GPU from a profile measured on a 0.1 TFLOPS device: times / 150, memory unchanged
    p = profile()
    gpu = derive_profile(p, 15.0, 0.1, 1.0, gpu_type="titan-v")
    assert gpu.gpu_type == "titan-v"
    assert gpu.layers[1].forward_s == pytest.approx(p.layers[1].forward_s / 150)
    assert gpu.layers[1].saved_bytes == p.layers[1].saved_bytes
    assert gpu.origin == replace(p.origin, derived_from="cpu", speed_ratio=pytest.approx(150))
    # derived again (a slower type from the derived one): still names the measured profile, ratios multiply
    slower = derive_profile(gpu, 5.0, 15.0, 1.0, gpu_type="p4000")
    assert slower.origin.derived_from == "cpu" and slower.origin.speed_ratio == pytest.approx(50)
    assert slower.layers[0].backward_s == pytest.approx(p.layers[0].backward_s / 50)
