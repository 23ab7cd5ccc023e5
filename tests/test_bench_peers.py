"""launch/bench/peers.py: DDP and the torch pipeline each train a few steps on a tiny emulated cluster."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from hetpipe.core.config.files import load_config
from hetpipe.core.errors import UsageError

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "launch" / "bench"))
import peers  # noqa: E402  (launch/bench is not a package)

pytestmark = pytest.mark.slow

_GIB = 2**30


def _config(tmp_path: Path, big_gib: float, small_gib: float) -> Path:
    """3 emulated GPUs: two "big" ones (fast) and one "small" one (half as fast), a tiny MLP on random
    data."""
    text = f"""name = "peers-test"
seed = 1
[gpu_types.big]
speed = 2.0
memory_gib = {big_gib!r}
[gpu_types.small]
speed = 1.0
memory_gib = {small_gib!r}
[[nodes]]
name = "n0"
gpus = ["big", "small", "big"]
[model]
name = "mlp"
options = {{ image_size = 8, hidden = [16, 16, 16] }}
[data]
name = "synthetic"
options = {{ input_shape = [1, 8, 8], num_classes = 10, n = 256 }}
[train]
batch_size = 8
optimizer = "momentum"
out_dir = "{tmp_path / "runs"}"
[emulation]
time_scale = 1.0
[[virtual_workers]]
gpus = ["n0:0", "n0:1", "n0:2"]
"""
    path = tmp_path / "peers.toml"
    path.write_text(text)
    return path


@pytest.fixture
def cluster(tmp_path: Path):
    """The tiny cluster with memories set from the memory rule: big GPUs hold 2x, the small one half of it."""
    probe = load_config(_config(tmp_path, 1.0, 1.0))
    need = peers.whole_model_bytes(peers.model_profile(probe, 8, tmp_path / "profiles"))
    config = load_config(_config(tmp_path, 2 * need / _GIB, 0.5 * need / _GIB))
    return config, need


@pytest.mark.timeout(60)
def test_ddp_leaves_out_the_small_gpu_and_trains(cluster, tmp_path: Path) -> None:
    config, need = cluster
    devs = peers.devices(config)
    assert [d.slowdown for d in devs] == [1.0, 2.0, 1.0]  # fastest / speed x time_scale 1
    fit, left_out = peers.ddp_members(devs, need)
    assert [d.gpu for d in fit] == ["n0:0", "n0:2"]
    assert [d.gpu for d in left_out] == ["n0:1"]
    run = peers.run_ddp(config, fit, 8, 5, tmp_path / "logs")
    assert len(run.ends) == 5 and run.samples_per_step == 16
    assert run.rate(2) > 0
    assert all(r["compute_s"] > 0 for r in run.ranks)


@pytest.mark.timeout(60)
def test_pipeline_over_all_gpus_trains(cluster, tmp_path: Path) -> None:
    config, _ = cluster
    devs = peers.devices(config)
    layout = peers.pipeline_layout(devs, peers.model_profile(config, 4, tmp_path / "profiles"))
    assert sorted(d.gpu for d in layout.gpus) == ["n0:0", "n0:1", "n0:2"]
    assert sum(layout.split) == 5 and min(layout.split) >= 1
    run = peers.run_pipeline(config, layout, 4, 3, 4, tmp_path / "logs", snapshot_every=2)
    assert len(run.ends) == 4 and run.samples_per_step == 12
    assert run.rate(2) > 0
    assert len(run.losses) == 4
    # every stage kept its part at steps 2 and 4; the parent scored the merged whole model after the run
    assert [e["step"] for e in run.evals] == [2, 4] and all(0 <= e["test_accuracy"] <= 1 for e in run.evals)
    assert run.evals[0]["t"] <= run.evals[1]["t"] <= run.ends[-1] + 1


def test_steady_rate_counts_steps_after_warmup() -> None:
    assert peers.steady_rate([1.0, 2.0, 3.0, 5.0], 10, 2) == pytest.approx(20 / 3)
    with pytest.raises(UsageError):
        peers.steady_rate([1.0, 2.0], 10, 2)


def test_ddp_subsets_offer_the_fastest_types() -> None:
    devs = [
        peers.Device(f"n0:{i}", t, s, 1, 1.0) for i, (t, s) in enumerate([("a", 3.0), ("b", 1.0), ("a", 3.0)])
    ]
    subsets = peers.ddp_subsets(devs)
    assert {k: [d.gpu for d in v] for k, v in subsets.items()} == {
        "fit": ["n0:0", "n0:1", "n0:2"],
        "speed>=3": ["n0:0", "n0:2"],
    }


def _reference_losses(config, batches: list[int], lr: float) -> tuple[float, float]:
    """Rank 0's loss at step 1 after one step on all ranks' step-0 samples at once (the whole batch's mean
    gradient), and after one step on the plain mean of the ranks' own mean gradients (DDP unweighted)."""
    import torch

    from hetpipe.compute import data as datalib
    from hetpipe.compute.build import dataset_of, model_of
    from hetpipe.compute.optim import make_optimizer
    from hetpipe.models import build_stage

    spec, data, t = model_of(config), dataset_of(config), config.train
    shards = [
        datalib.shard_indices(len(data.train.y), len(batches), r, config.seed) for r in range(len(batches))
    ]
    parts = [
        datalib.minibatch(data.train.x, data.train.y, idx, b, config.seed, 0)
        for idx, b in zip(shards, batches, strict=True)
    ]
    x1, y1 = datalib.minibatch(data.train.x, data.train.y, shards[0], batches[0], config.seed, 1)
    out = []
    for weights in ([b / sum(batches) for b in batches], [1 / len(batches)] * len(batches)):
        model = build_stage(spec, 0, spec.num_layers)
        optimizer = make_optimizer(list(model.parameters()), t.optimizer, lr, t.momentum, t.weight_decay)
        loss = sum(w * spec.loss(model(x), y) for w, (x, y) in zip(weights, parts, strict=True))
        loss.backward()
        optimizer.step()
        with torch.no_grad():
            out.append(float(spec.loss(model(x1), y1)))
    return out[0], out[1]


@pytest.mark.timeout(60)
def test_ddp_with_batches_split_by_speed_updates_like_the_whole_batch(cluster, tmp_path: Path) -> None:
    """Two ranks of 3 and 5 samples: rank 0's loss after the first step is the one after a step on all 8
    samples' mean gradient (each rank's loss weighted by its share), not after the plain mean of the two."""
    config, need = cluster
    fit, _ = peers.ddp_members(peers.devices(config), need)
    run = peers.run_ddp(config, fit, [3, 5], 2, tmp_path / "logs", lr=0.5)
    assert run.samples_per_step == 8 and run.setting["batch"] == [3, 5] and run.setting["global_batch"] == 8
    weighted, plain = _reference_losses(config, [3, 5], 0.5)
    assert abs(weighted - plain) > 1e-4  # the test tells the two apart
    assert run.losses[1] == pytest.approx(weighted, rel=1e-5, abs=1e-6)


def test_speed_batches_of_the_tiny_cluster(cluster) -> None:
    config, _ = cluster
    devs = peers.devices(config)  # big, small, big: slowdowns 1, 2, 1
    assert peers.speed_batches(devs, 20) == [8, 4, 8]
