"""The runtime on a real CUDA device (issue 11): stages and VWs sharing one GPU, BatchNorm across VWs,
emulated speeds on CUDA, bf16. Skipped without a GPU (CI has none); every other test forces the CPU path."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from hetpipe.app.train import TrainOptions, train
from hetpipe.core.config.files import load_config
from hetpipe.core.config.overrides import apply_overrides

from conftest import write_config

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def events(run_dir: Path, kind: str) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [e for e in map(json.loads, lines) if e.get("event") == kind]


def first_and_last_loss(run_dir: Path) -> tuple[float, float]:
    losses = [e["loss"] for e in sorted(events(run_dir, "minibatch"), key=lambda e: e["p"])]
    return sum(losses[:4]) / 4, sum(losses[-4:]) / 4


def assert_close_to(ref, stage_weights: dict, ps_weights: dict) -> None:
    """Every stage's and the PS's final weights equal the CPU reference's `ref` to float tolerance (ps_weights
    {}: the PS's not compared)."""
    for sid, weights in stage_weights.items():
        for key, value in weights.items():
            torch.testing.assert_close(
                value.cpu(),
                ref.stage_weights[sid][key].cpu(),
                rtol=1e-4,
                atol=1e-5,
                msg=lambda m, sid=sid, key=key: f"stage {sid} {key}: {m}",
            )
    for key, value in ps_weights.items():
        torch.testing.assert_close(
            torch.as_tensor(value), torch.as_tensor(ref.ps_weights[key]), rtol=1e-4, atol=1e-5
        )


def test_two_stages_of_one_vw_share_one_gpu(tmp_path: Path):
    # NCCL refuses two ranks on one device; co-located stages go over gloo with pinned staging
    path = write_config(
        tmp_path,
        vws=[["n0:0", "n0:1"]],
        nm=2,
        staleness=0,
        waves=20,
        device="cuda:0",
        model="mnist-cnn",
        batch_size=32,
    )
    summary = train(load_config(path), TrainOptions(run_dir=tmp_path / "run", progress=False))
    first, last = first_and_last_loss(tmp_path / "run")
    assert summary["waves"] == 20 and last < first


def test_two_vws_with_batchnorm_share_one_gpu(tmp_path: Path):
    # the BN crash of issue 13 on a GPU: ResNet-18 with BatchNorm, 2 VWs, Nm 2, D 1
    path = write_config(
        tmp_path,
        vws=[["n0:0"], ["n0:1"]],
        nm=2,
        staleness=1,
        waves=6,
        device="cuda:0",
        model="resnet18",
        batch_size=16,
    )
    config = apply_overrides(
        load_config(path),
        ["model.options={ in_channels = 1, num_classes = 10, image_size = 32 }", "data.options={ pad = 2 }"],
    )
    summary = train(config, TrainOptions(run_dir=tmp_path / "run", progress=False))
    assert summary["waves"] == 6 and summary["test_accuracy"] >= 0.0


def test_emulated_speeds_slow_a_stage_on_cuda(tmp_path: Path):
    path = write_config(
        tmp_path,
        vws=[["n0:0"], ["n0:1"]],
        nm=2,
        staleness=0,
        waves=6,
        speeds=[4.0, 1.0],
        emulation=True,
        time_scale=1.0,
        model="mnist-cnn",
        device="cuda:0",
    )
    config = apply_overrides(load_config(path), ['emulation.device="cuda"'])
    train(config, TrainOptions(run_dir=tmp_path / "run", progress=False))
    slept = {e["vw"]: e["slept_s"] for e in events(tmp_path / "run", "stage_done")}
    assert slept[1] > slept[0]  # the speed-1 GPU is stretched, the speed-4 one runs as fast as it can


def test_bf16_trains_with_float32_weights_at_the_ps(tmp_path: Path):
    path = write_config(
        tmp_path,
        vws=[["n0:0"]],
        nm=4,
        staleness=0,
        waves=10,
        device="cuda:0",
        model="mnist-cnn",
        batch_size=32,
    )
    # a flush schedule: Nm 4 of local async updates at this lr diverges in fp32 too (the staleness, not bf16)
    config = apply_overrides(load_config(path), ["train.precision=bf16", "train.schedule=1f1b-flush"])
    train(config, TrainOptions(run_dir=tmp_path / "run", progress=False))
    first, last = first_and_last_loss(tmp_path / "run")
    state = torch.load(tmp_path / "run" / "model.pt", weights_only=True)
    assert last < first
    assert all(
        t.dtype == torch.float32 for t in state.values() if torch.is_floating_point(torch.as_tensor(t))
    )


@pytest.mark.parametrize(
    ("agent", "settings"),
    [
        ("process", []),
        ("thread", []),
        ("process", ["ps.node_aggregation=true"]),
        ("process", ["train.freeze=[[2, 2], [4, 3]]"]),
        ("process", ['ps.aggregation="server"']),
    ],
    ids=["process", "thread", "relay", "freeze", "server"],
)
def test_two_vws_on_one_gpu_train_as_the_reference_does(tmp_path: Path, agent: str, settings: list[str]):
    """The PS path on CUDA (pushes copied on a side stream, pulls copied and rebased without a wait) computes
    what the CPU reference computes, to float tolerance: a pull overwritten while its copy was still reading
    it, or a push read before its wave's updates, would be off by whole updates. With the agent in a process
    (the CUDA default) and in a thread; with both VWs (on one node) behind a relay (ps.node_aggregation); and
    with layers frozen at two waves (train.freeze: whole stages that take no gradient); and with the optimizer
    on the PS (ps.aggregation "server": the stages push gradients and pull weights; with momentum: Adam's
    division by sqrt(v) carries rounding-level differences past this tolerance, as a 1e-7 relative nudge to
    W_0 moves the CPU reference's own Adam weights by 2.4e-5 and its momentum weights by 1.8e-7)."""
    from test_train_equivalence import run

    from hetpipe.compute.reference import run_reference

    path = write_config(
        tmp_path, vws=[["n0:0", "n0:1"], ["n0:2", "n0:3"]], nm=2, staleness=1, waves=8, device="cuda:0"
    )
    config = apply_overrides(load_config(path), [f'ps.agent="{agent}"', *settings])
    relay = "ps.node_aggregation=true" in settings
    splits = [(2, 2), (3, 1)]
    _, stage_weights, ps_weights = run(tmp_path, config, splits)
    ref = run_reference(config, splits, order_seed=1)
    relay_logs = "".join(p.read_text() for p in (tmp_path / "run" / "logs").glob("relay-*"))
    assert ("registered upstream for vws" in relay_logs) == relay
    assert_close_to(ref, stage_weights, ps_weights)


def test_a_re_plan_on_one_gpu_trains_as_the_reference_does(tmp_path: Path):
    """Planned spans on CUDA (docs/wsp.md#planned-spans): 2 VWs of 2 stages train waves 0-3, then 3 VWs waves
    4-7 with 2 layers frozen from wave 4 (the later VWs start once the earlier ones pushed their last wave,
    from the global weights); the result is the CPU reference's, to float tolerance."""
    from test_replan import spanned_config
    from test_train_equivalence import run

    from hetpipe.compute.reference import run_reference

    vws = [["n0:0", "n0:1"], ["n0:2", "n0:3"], ["n0:0"], ["n0:1"], ["n0:2", "n0:3"]]
    spans = [(0, 4), (0, 4), (4, 8), (4, 8), (4, 8)]
    path = spanned_config(tmp_path, vws, spans, nm=2, staleness=1, waves=8, device="cuda:0")
    config = apply_overrides(load_config(path), ['ps.agent="process"', "train.freeze=[[4, 2]]"])
    splits = [(2, 2), (3, 1), (4,), (4,), (1, 3)]
    _, stage_weights, ps_weights = run(tmp_path, config, splits)
    ref = run_reference(config, splits, order_seed=1)
    assert_close_to(ref, stage_weights, ps_weights)


def test_the_frozen_layers_cache_on_one_gpu_trains_as_the_reference_does(tmp_path: Path):
    """train.freeze_cache_mib on CUDA (docs/wsp.md#the-frozen-layers-cache): 2 VWs of 2 and 3 stages, the
    first 2 layers frozen from wave 2, each VW's shard repeating every 6 minibatches; the kept rows serve
    (hits reported) and the result is the CPU reference's, to float tolerance."""
    from test_train_equivalence import run

    from hetpipe.compute.reference import run_reference

    path = write_config(
        tmp_path,
        vws=[["n0:0", "n0:1"], ["n0:2", "n0:3", "n0:4"]],
        nm=2,
        staleness=1,
        waves=12,
        batch_size=64,
        device="cuda:0",
    )
    settings = ["data.options={ classes = [5, 6] }", "train.freeze=[[2, 2]]", "train.freeze_cache_mib=16"]
    config = apply_overrides(load_config(path), settings)
    splits = [(2, 2), (1, 2, 1)]
    summary, stage_weights, _ = run(tmp_path, config, splits)
    assert summary["frozen_cache"]["hits"] > 0, summary["frozen_cache"]
    ref = run_reference(config, splits, order_seed=1)
    assert_close_to(ref, stage_weights, {})


@pytest.mark.parametrize("relay", [False, True], ids=["direct", "relay"])
def test_unequal_work_on_two_nodes_under_spread_trains_as_the_reference_does(tmp_path: Path, relay: bool):
    """Per-VW work on CUDA (docs/wsp.md#per-vw-work): 3 VWs at Nm 2 x 16, 5 x 32 and 3 x 16 with 2, 1 and 3
    stages on two nodes, a PS shard on each node holding whole layers (ps.placement = "spread"), with and
    without node relays; the result is the CPU reference's, weighted by each VW's samples, to float
    tolerance."""
    from hetpipe.compute.reference import run_reference

    from equivalence import listed_work, run

    vws = [["n0:0", "n0:1"], ["n1:0"], ["n1:1", "n1:2", "n1:3"]]
    path = write_config(
        tmp_path, vws=vws, nm=2, staleness=1, waves=4, device="cuda:0", work=[(2, 16), (5, 32), (3, 16)]
    )
    text = path.read_text().replace("[wsp]", '[ps]\nshards = 2\nplacement = "spread"\n[wsp]')
    nodes = '\n[[nodes]]\nname = "n1"\ngpus = ["g0", "g0", "g0", "g0"]\n'
    path.write_text(text + nodes + 'devices = ["cuda:0", "cuda:0", "cuda:0", "cuda:0"]\n')
    config = apply_overrides(load_config(path), [f"ps.node_aggregation={str(relay).lower()}"])
    splits = [(2, 2), (4,), (1, 2, 1)]
    summary, stage_weights, ps_weights = run(tmp_path, config, splits)
    assert summary["work"] == [{"nm": 2, "batch": 16}, {"nm": 5, "batch": 32}, {"nm": 3, "batch": 16}]
    ref = run_reference(config, splits, order_seed=1, work=listed_work(config))
    assert_close_to(ref, stage_weights, ps_weights)


@pytest.mark.parametrize("shared", [False, True], ids=["own-pinned", "shared-with-agent-process"])
def test_push_and_pull_staging_move_every_key_through_their_buffers(shared: bool):
    """PushStaging: each wave's arrays hold its tensors once ready() returns, integer buffers converted, the
    two pinned buffers in turn (a wave two back must have left before its buffer is written); PullStaging: the
    device views hold what the agent wrote into the host buffer, pull after pull. Shared: the buffers a stage
    shares with its agent process (worker/shared_host.py), registered with the driver as pinned memory."""
    from hetpipe.worker.flat_layout import FlatLayout
    from hetpipe.worker.shared_host import SharedHost
    from hetpipe.worker.transfer import PullStaging, PushStaging

    device = torch.device("cuda:0")
    shapes = {"w": (3, 4), "b": (5,), "count": (), "k": (2, 3, 2)}
    layout = FlatLayout.of({k: torch.empty(s) for k, s in shapes.items()})
    host = SharedHost.create(layout.numel, "test-cuda") if shared else None
    slots = pull_host = None
    if host is not None:
        host.unlink()
        assert host.pin(), "cudaHostRegister refused the shared buffers"
        slots, pull_host = [torch.from_numpy(a) for a in host.slots], torch.from_numpy(host.pull)
        assert all(t.is_pinned() for t in [*slots, pull_host])
    push, waited = PushStaging(layout, device, slots), []
    for wave in range(4):
        tensors = {
            k: torch.arange(float(torch.tensor(s).prod()), device=device).view(s) + wave
            for k, s in shapes.items()
            if k != "count"
        }
        tensors["count"] = torch.tensor(wave + 7, device=device)  # int64, as BatchNorm's batch counter
        arrays, ready = push.stage(tensors, waited.append)
        ready()
        assert push.slot == wave % 2 and waited[-1] == wave % 2
        for key, t in tensors.items():
            assert arrays[key].shape == shapes[key]
            assert (arrays[key] == t.float().cpu().numpy()).all(), (wave, key)
    pull = PullStaging(layout, device, pull_host)
    for value in (1.5, -2.0):
        pull.wait_free()
        for array in pull.out.values():
            array[...] = value
        got = pull.to_device()
        assert set(got) == set(shapes) and all(t.device.type == "cuda" for t in got.values())
        assert all(torch.equal(t.cpu(), torch.full(shapes[k], value)) for k, t in got.items())
    if host is not None:
        del push, pull, got, arrays, slots, pull_host
        host.close()
