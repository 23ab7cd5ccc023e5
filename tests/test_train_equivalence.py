"""Bit-for-bit equivalence of the multi-process runtime (`exact` pulls, fixed seed) with plain single-process
training and with the single-process reference, for every schedule, aggregation rule and buffer policy."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from hetpipe.compute import data as datalib
from hetpipe.compute.build import dataset_of, model_of
from hetpipe.compute.reference import run_reference
from hetpipe.core.config.files import load_config
from hetpipe.core.config.overrides import apply_overrides
from hetpipe.core.config.schema import ClusterConfig
from hetpipe.core.pipeline.lr_schedule import lr_at
from hetpipe.core.pipeline.schedule import SCHEDULES
from hetpipe.core.protocol.wire import from_bfloat16_bits, to_bfloat16_bits
from hetpipe.models import build_stage

from conftest import write_config
from equivalence import assert_bitwise, assert_equals_reference, layout, run

pytestmark = pytest.mark.slow

SPLITS = {1: [(4,), (4,)], 3: [(1, 2, 1), (2, 1, 1)]}  # the MLP's 4 layers; two VWs split them differently


def plain_training(config: ClusterConfig, steps: int, accumulate: int) -> dict[str, torch.Tensor]:
    """One model, one process: `accumulate` minibatches' gradients summed, divided, one optimizer step."""
    torch.set_num_threads(1)
    spec, dataset = model_of(config), dataset_of(config)
    model = build_stage(spec, 0, spec.num_layers)
    opt = torch.optim.SGD(model.parameters(), lr=config.train.lr, momentum=config.train.momentum)
    indices = datalib.shard_indices(len(dataset.train.y), 1, 0, config.seed)
    for p in range(steps):
        x, y = datalib.minibatch(
            dataset.train.x, dataset.train.y, indices, config.train.batch_size, config.seed, p
        )
        spec.loss(model(x), y).backward()
        if p % accumulate == accumulate - 1:
            if accumulate > 1:
                for w in model.parameters():
                    w.grad = w.grad / accumulate
            opt.step()
            opt.zero_grad(set_to_none=True)
    return dict(model.named_parameters())


def test_wsp_one_vw_three_stages_nm1_equals_plain_training(tmp_path: Path):
    config = load_config(write_config(tmp_path, vws=layout(1, 3), nm=1, staleness=0, waves=12))
    summary, stage_weights, _ = run(tmp_path, config, [(2, 1, 1)])
    merged = {k: v for w in stage_weights.values() for k, v in w.items()}
    assert_bitwise(merged, plain_training(config, 12, 1), "pipelined vs plain")
    assert summary["test_accuracy"] > 0.2  # it learned something in 12 steps


@pytest.mark.parametrize(
    ("schedule", "recompute"), [("1f1b-flush", False), ("gpipe", False), ("gpipe", True)]
)
def test_flush_schedules_equal_plain_training_with_gradient_accumulation(
    tmp_path: Path, schedule: str, recompute: bool
):
    config = apply_overrides(
        load_config(write_config(tmp_path, vws=layout(1, 3), nm=3, staleness=0, waves=3)),
        [f"train.schedule={schedule}", f"train.recompute={str(recompute).lower()}"],
    )
    _, stage_weights, _ = run(tmp_path, config, [(1, 2, 1)])
    merged = {k: v for w in stage_weights.values() for k, v in w.items()}
    assert_bitwise(merged, plain_training(config, 9, 3), f"{schedule} vs plain with accumulation over 3")


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
@pytest.mark.parametrize(("vws", "stages"), [(1, 1), (1, 3), (2, 1), (2, 3)])
def test_every_schedule_equals_its_reference(tmp_path: Path, schedule: str, vws: int, stages: int):
    config = apply_overrides(
        load_config(write_config(tmp_path, vws=layout(vws, stages), nm=2, staleness=0, waves=3)),
        [f"train.schedule={schedule}"],
    )
    assert_equals_reference(tmp_path, config, SPLITS[stages][:vws], order=vws + stages)


def test_pipedream_beyond_the_pipes_depth_equals_its_reference_and_one_vw_trains_as_wsp_at_the_depth(
    tmp_path: Path,
):
    """Nm 4 on 2 stages: 2 VWs equal the reference; one VW trains the weights wsp trains at Nm 2 (the same F,
    B and U; only its pushes, which it never pulls back, fall elsewhere:
    hetpipe.core.planning.convergence.canonical)."""
    deep = apply_overrides(
        load_config(write_config(tmp_path, vws=layout(2, 2), nm=4, staleness=1, waves=3)),
        ['train.schedule="pipedream"'],
    )
    assert_equals_reference(tmp_path, deep, [(2, 2), (3, 1)], order=1)
    (tmp_path / "one").mkdir()
    one = apply_overrides(
        load_config(write_config(tmp_path / "one", vws=layout(1, 2), nm=4, staleness=0, waves=3)),
        ['train.schedule="pipedream"'],
    )
    _, pipedream, _ = run(tmp_path / "one", one, [(2, 2)])
    wsp = apply_overrides(one, ["wsp.nm=2", "train.waves=6", 'train.schedule="wsp"'])
    _, at_depth, _ = run(tmp_path / "wsp", wsp, [(2, 2)])
    for sid in pipedream:
        assert_bitwise(pipedream[sid], at_depth[sid], f"stage {sid}: pipedream at Nm 4 vs wsp at Nm 2")


@pytest.mark.parametrize(
    ("setting", "staleness"),
    [
        ("ps.aggregation=mean", 1),
        ("ps.aggregation=server", 0),
        ("train.weight_stashing=false", 0),
    ],
)
def test_aggregation_rules_and_unstashed_wsp_equal_the_reference(
    tmp_path: Path, setting: str, staleness: int
):
    path = write_config(tmp_path, vws=layout(2, 2), nm=2, staleness=staleness, waves=4)
    config = apply_overrides(load_config(path), [setting])
    assert_equals_reference(tmp_path, config, [(2, 2), (3, 1)], order=staleness)


@pytest.mark.parametrize(("staleness", "buffers"), [(0, "average"), (1, "average"), (0, "local")])
def test_batchnorm_model_equals_the_reference(tmp_path: Path, staleness: int, buffers: str):
    """The rebase after a pull replaced BatchNorm statistics in place (a crash in the next backward);
    now buffers are averaged at the PS and replaced out of place, or kept per VW."""
    path = write_config(tmp_path, vws=layout(2, 2), nm=2, staleness=staleness, waves=4, model="mnist-cnn")
    config = apply_overrides(
        load_config(path),
        ["model.options={ batch_norm = true, channels = [4, 8], hidden = 16 }", f"ps.buffers={buffers}"],
    )
    summary, stage_weights = assert_equals_reference(tmp_path, config, [(3, 3), (2, 4)], order=staleness)
    first = {k: v for k, v in stage_weights[(0, 0)].items() if "running_mean" in k}
    assert first and all(v.abs().sum() > 0 for v in first.values())  # the statistics did move


@pytest.mark.parametrize("relay", [False, True], ids=["to-the-ps", "through-a-relay"])
def test_bfloat16_on_the_wire_equals_its_reference_and_rounds(tmp_path: Path, relay: bool):
    """[ps] wire_dtype = "bfloat16": weights cross the wire rounded, BatchNorm statistics do not; the run is
    the reference's with the same rounding, bit for bit, and not the float32 run. Through a node's relay the
    relay rounds the sum of its group's rounded pushes again (the reference did not: the runs differed)."""
    path = write_config(tmp_path, vws=layout(2, 2), nm=2, staleness=1, waves=4, model="mnist-cnn")
    fp32 = apply_overrides(
        load_config(path),
        [
            "model.options={ batch_norm = true, channels = [4, 8], hidden = 16 }",
            f"ps.node_aggregation={str(relay).lower()}",
        ],
    )
    bf16 = apply_overrides(fp32, ['ps.wire_dtype="bfloat16"'])
    _, stage_weights = assert_equals_reference(tmp_path, bf16, [(3, 3), (2, 4)])
    unrounded = run_reference(fp32, [(3, 3), (2, 4)]).stage_weights[(0, 0)]
    differs = [k for k, w in stage_weights[(0, 0)].items() if not torch.equal(w, unrounded[k])]
    assert any("running" not in k for k in differs), "bfloat16 on the wire changed no weight"


@pytest.mark.parametrize(
    ("model", "options"),
    [
        ("resnet18", "{ in_channels = 1, num_classes = 10, image_size = 32 }"),
        ("vgg11", "{ in_channels = 1, num_classes = 10, image_size = 32, batch_norm = true }"),
    ],
)
def test_the_papers_batchnorm_models_equal_the_reference(tmp_path: Path, model: str, options: str):
    """Issue 13's crash: ResNet (BN in the blocks and the shortcuts) and VGG-BN, 2 VWs x 2 stages, Nm 2, D 1;
    launch/bench/batchnorm.py runs the whole matrix (Nm 2 and 4, D 0 and 1, exact and latest) on the
    emulated cluster."""
    path = write_config(tmp_path, vws=layout(2, 2), nm=2, staleness=1, waves=2, model=model, batch_size=4)
    config = apply_overrides(load_config(path), [f"model.options={options}", "data.options={ pad = 2 }"])
    _, stage_weights = assert_equals_reference(
        tmp_path, config, [(6, 4), (4, 6)] if model == "resnet18" else [(5, 4), (4, 5)], order=1
    )
    stats = [v for sid in stage_weights for k, v in stage_weights[sid].items() if k.endswith("running_var")]
    assert stats and all(
        not torch.equal(v, torch.ones_like(v)) for v in stats
    )  # every BN layer's statistics moved


def test_reference_is_independent_of_the_global_order(tmp_path: Path):
    path = write_config(tmp_path, vws=layout(2, 2), nm=2, staleness=1, waves=4)
    config = load_config(path)
    one = run_reference(config, [(2, 2), (1, 3)], order_seed=0)
    two = run_reference(config, [(2, 2), (1, 3)], order_seed=99)
    for sid in one.stage_weights:
        assert_bitwise(one.stage_weights[sid], two.stage_weights[sid], f"stage {sid}")
    assert all(np.array_equal(one.ps_weights[k], two.ps_weights[k]) for k in one.ps_weights)


# Each staleness mitigation (hetpipe.core.pipeline.mitigation) in the runtime equals the reference's
# independent arithmetic, 1 and 2 VWs; each case also differs from the same run without it (the mitigation
# acted).
@pytest.mark.parametrize(
    ("vws", "settings"),
    [
        (2, ['train.mitigation="spectrain"']),  # momentum's buffer predicts the stash, wsp
        (1, ['train.mitigation="spectrain"', 'train.optimizer="sgd"']),  # plain SGD: the last update
        (
            2,
            ['train.mitigation="pipemare+warmup"', "train.weight_stashing=false", "train.warmup_waves=2"],
        ),  # T1+T2
        (2, ['train.mitigation="average"', 'ps.aggregation="mean"']),
        (
            1,
            ['train.mitigation="spectrain"', 'ps.aggregation="server"', 'train.optimizer="adam"'],
        ),  # pulls predicted
    ],
)
def test_each_mitigation_equals_the_reference(tmp_path: Path, vws: int, settings: list[str]):
    path = write_config(tmp_path, vws=layout(vws, 2), nm=3, staleness=0, waves=4)
    config = apply_overrides(load_config(path), settings)
    splits = [(2, 2), (3, 1)][:vws]
    _, stage_weights = assert_equals_reference(tmp_path, config, splits, order=vws)
    plain = run_reference(apply_overrides(config, ['train.mitigation="none"']), splits, order_seed=vws)
    assert any(
        not torch.equal(stage_weights[sid][k], plain.stage_weights[sid][k])
        for sid in stage_weights
        for k in stage_weights[sid]
    ), "the mitigation changed nothing"


@pytest.mark.parametrize(("staleness", "buffers"), [(1, "average"), (0, "local")])
def test_ps_agent_in_a_process_equals_the_reference(tmp_path: Path, staleness: int, buffers: str):
    """[ps] agent = "process" (a CUDA stage's default, here on the CPU): pushes staged into buffers shared
    with the agent process, pulls and W_0 back through them; the run is the reference's bit for bit, as the
    thread's is."""
    path = write_config(tmp_path, vws=layout(2, 2), nm=2, staleness=staleness, waves=4, model="mnist-cnn")
    config = apply_overrides(
        load_config(path),
        [
            "model.options={ batch_norm = true, channels = [4, 8], hidden = 16 }",
            f"ps.buffers={buffers}",
            'ps.agent="process"',
        ],
    )
    summary, _ = assert_equals_reference(tmp_path, config, [(3, 3), (2, 4)], order=staleness)
    assert all(part["push"] > 0 for part in summary["wave_breakdown_ms"].values()), summary[
        "wave_breakdown_ms"
    ]


def test_trainer_controls_equal_the_reference_and_each_one_acts(tmp_path: Path, monkeypatch):
    """[train] lr_schedule (cosine warm-up), clip_grad_norm and loss: 2 VWs equal the reference bit for bit;
    the reference without each control, or with the schedule one wave late, is another run."""
    path = write_config(tmp_path, vws=layout(2, 2), nm=3, staleness=1, waves=4)
    schedule = ['train.lr_schedule="cosine"', "train.warmup_steps=1", "train.min_lr=0.005"]
    clip, loss = ["train.clip_grad_norm=0.05"], ['train.loss="mse"']
    config = apply_overrides(load_config(path), schedule + clip + loss)
    splits, work = [(2, 2), (3, 1)], [(3, 16), (3, 16)]
    _, stage_weights = assert_equals_reference(tmp_path, config, splits, order=1)

    def differs(ref) -> bool:
        return any(
            not torch.equal(stage_weights[sid][k], ref.stage_weights[sid][k])
            for sid in stage_weights
            for k in stage_weights[sid]
        )

    for without in (clip + loss, schedule + loss, schedule + clip):
        assert differs(run_reference(apply_overrides(load_config(path), without), splits, 1, work=work)), (
            without
        )
    import hetpipe.compute.reference as reference

    monkeypatch.setattr(reference, "lr_at", lambda schedule, wave: lr_at(schedule, wave + 1))
    assert differs(run_reference(config, splits, 1, work=work)), "the schedule one wave late changed nothing"


@pytest.mark.parametrize(
    ("model", "settings", "splits", "frozen_from"),
    [
        (
            "mlp",
            ["wsp.staleness=1", 'ps.wire_dtype="bfloat16"', "train.freeze=[[2, 2], [4, 3]]"],
            [(1, 2, 1), (2, 1, 1)],
            {1: 2, 2: 4},
        ),
        ("mlp", ["ps.node_aggregation=true", "train.freeze=[[3, 2]]"], [(2, 2), (3, 1)], {1: 3}),
        (
            "mnist-cnn",
            [
                "model.options={ batch_norm = true, channels = [4, 8], hidden = 16 }",
                "train.schedule=gpipe",
                "train.recompute=true",
                "train.freeze=[[2, 1], [4, 3]]",
            ],
            [(2, 3, 1), (4, 2)],
            {0: 2, 2: 4},
        ),
    ],
)
def test_freezing_at_two_points_equals_the_reference_and_fixes_the_frozen_layers(
    tmp_path: Path, model: str, settings: list[str], splits: list[tuple[int, ...]], frozen_from: dict
):
    """[train] freeze at waves 2 and 4 (bfloat16 on the wire; or at 3, behind a node's relay): whole stages
    and parts of stages frozen, in 2 VWs split differently; frozen weights left off the wire (a shard refuses
    a push that carries one); the run equals the reference bit for bit; a frozen layer's weights end, in every
    stage and at the PS, at W_f (the last version that folds its updates, which did change them; the stages
    hold it as the wire rounded it); without freezing the run differs."""
    firsts = [sum(len(s) for s in splits[:v]) for v in range(len(splits))]
    gpus = [[f"n0:{firsts[v] + j}" for j in range(len(split))] for v, split in enumerate(splits)]
    path = write_config(tmp_path, vws=gpus, nm=2, staleness=0, waves=7, model=model)
    config = apply_overrides(load_config(path), settings)
    _, stage_weights = assert_equals_reference(tmp_path, config, splits, order=1)
    versions: dict[int, dict[str, np.ndarray]] = {}
    work = [(2, config.train.batch_size)] * 2
    ref = run_reference(config, splits, 1, lambda t, w: versions.__setitem__(t, w), work=work)
    spec = model_of(config)
    params = dict(build_stage(spec, 0, spec.num_layers, "meta").named_parameters())
    for layer, wave in frozen_from.items():  # the layers with weights that freeze, and from which wave
        keys = [k for k in params if k.split(".")[0] == str(layer)]
        assert keys
        for key in keys:
            assert np.array_equal(ref.ps_weights[key], versions[wave][key]), key
            assert not np.array_equal(versions[wave - 1][key], versions[wave][key]), key
            held = versions[wave][key]
            if config.ps.wire_dtype == "bfloat16":
                held = from_bfloat16_bits(to_bfloat16_bits(held))
            holders = [sid for sid, weights in stage_weights.items() if key in weights]
            assert len(holders) == 2
            for sid in holders:
                assert np.array_equal(stage_weights[sid][key].numpy(), held), (sid, key)
    other = run_reference(apply_overrides(config, ["train.freeze=[]"]), splits, 1, work=work)
    assert any(
        not torch.equal(weights[k], other.stage_weights[sid][k])
        for sid, weights in stage_weights.items()
        for k in weights
    )


def autofreeze_oracle(
    versions: dict[int, dict[str, np.ndarray]], every: int, layers: int, staleness: int, waves: int
) -> list[tuple[int, int]]:
    """PipeTransformer's rule (docs/wsp.md#adaptive-freezing) worked out here on the PS's versions: at every
    `every`-th version, the least-moved trainable layer (relative to its size) bounds the frozen prefix,
    capped at half the trainable layers and at 3/4 of the model, from D + 1 waves later."""
    frozen, points = 0, []
    for b in range(every, max(versions) + 1, every):
        moved: dict[int, list[float]] = {}
        for key, new in versions[b].items():
            layer = int(key.split(".")[0])
            q = sum(
                float(((versions[t][key].astype(np.float64) - versions[t - 1][key]) ** 2).sum())
                for t in range(b - every + 1, b + 1)
            )
            sums = moved.setdefault(layer, [0.0, 0.0])
            sums[0] += q
            sums[1] += float((new.astype(np.float64) ** 2).sum())
        trainable = [
            (np.sqrt(q / n), layer) for layer, (q, n) in moved.items() if frozen <= layer < layers - 1
        ]
        if not trainable:
            continue
        least = min(trainable)
        n = max(frozen, min(least[1] + 1, frozen + (layers - frozen) // 2, (3 * layers) // 4, layers - 1))
        if n > frozen and b + staleness + 1 < waves:
            points.append((b + staleness + 1, n))
            frozen = n
    return points


@pytest.mark.parametrize(
    ("model", "settings", "splits"),
    [
        ("mlp", ["ps.shards=2"], [(1, 2, 1), (2, 2)]),
        ("mlp", [], [(2, 2)]),
        (
            "mnist-cnn",
            [
                "model.options={ batch_norm = true, channels = [4, 8], hidden = 16 }",
                "train.schedule=gpipe",
                'ps.agent="process"',
            ],
            [(2, 3, 1), (4, 2)],
        ),
    ],
)
def test_autofreeze_decides_from_the_movement_and_equals_the_reference(
    tmp_path: Path, model: str, settings: list[str], splits: list[tuple[int, ...]]
):
    """[train] autofreeze_every = 2 with D = 1, two VWs split differently (and two shards, whose movement
    records every stage adds up; or PS agents as processes, BatchNorm), or one VW (whose WAITs, skipped
    without the rule, ask for the records alone: its weights are its own): the freeze points are those
    PipeTransformer's rule gives on the PS's own versions (worked out in the test), at least two of them;
    the run equals the reference bit for bit; a frozen layer's weights stay at W_f; without the rule the
    run differs."""
    firsts = [sum(len(s) for s in splits[:v]) for v in range(len(splits))]
    gpus = [[f"n0:{firsts[v] + j}" for j in range(len(split))] for v, split in enumerate(splits)]
    path = write_config(tmp_path, vws=gpus, nm=2, staleness=1, waves=10, model=model)
    config = apply_overrides(load_config(path), [*settings, "train.autofreeze_every=2"])
    summary, stage_weights = assert_equals_reference(tmp_path, config, splits, order=1)
    versions: dict[int, dict[str, np.ndarray]] = {}
    work = [(2, 16)] * len(splits)
    ref = run_reference(config, splits, 1, lambda t, w: versions.__setitem__(t, w), work=work)
    spec = model_of(config)
    params = {k: w.detach().numpy() for k, w in build_stage(spec, 0, spec.num_layers).named_parameters()}
    weights = {0: params, **{t: {k: v[k] for k in params} for t, v in versions.items()}}
    points = autofreeze_oracle(weights, 2, spec.num_layers, 1, 10)
    assert len(points) >= 2 and list(ref.freeze) == points
    assert summary["autofreeze"] == [list(p) for p in points]  # what the run says it chose
    for wave, frozen in points:
        for key in [k for k in params if int(k.split(".")[0]) < frozen]:
            assert all(np.array_equal(versions[t][key], versions[wave][key]) for t in range(wave, 11)), key
    other = run_reference(apply_overrides(config, ["train.autofreeze_every=0"]), splits, 1)
    assert any(
        not torch.equal(weights[k], other.stage_weights[sid][k])
        for sid, weights in stage_weights.items()
        for k in weights
    )
