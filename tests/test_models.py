"""Tests for hetpipe.models: layer lists build, chain, split without changing weights, and name tensors
globally."""

from __future__ import annotations

import math
import sys
import textwrap

import pytest
import torch
from torch import nn

from hetpipe.core.errors import UsageError
from hetpipe.models import (
    MODELS,
    build_stage,
    even_split,
    get_model,
    named_stage_tensors,
    param_counts,
    stage_state_keys,
)

torch.set_num_threads(1)

SMALL = {"image_size": 32, "num_classes": 4}
# name -> (options, batch): small sizes so the whole set runs in seconds
CASES = {
    "mlp": ({"hidden": (16, 8)}, 3),
    "mnist-cnn": ({"channels": (4, 8), "hidden": 16}, 3),
    "char-gpt": ({"vocab_size": 11, "block_size": 8, "n_layer": 2, "n_head": 2, "n_embd": 16}, 3),
    "resnet18": (SMALL, 2),
    "resnet50": (SMALL, 2),
    "resnet152": (SMALL, 1),
    "vgg11": (SMALL, 2),
    "vgg19": (SMALL, 1),
    "vgg-fc": ({"channels": ((4,), (8, 8)), "fc": (16,), "num_classes": 4}, 3),
}


def chain(layers: list[nn.Module], x: torch.Tensor) -> torch.Tensor:
    for layer in layers:
        x = layer(x)
    return x


def test_every_registered_model_has_a_case() -> None:
    assert set(CASES) == set(MODELS)


@pytest.mark.parametrize("name", list(CASES))
def test_forward_backward_shapes(name: str) -> None:
    options, batch = CASES[name]
    spec = get_model(name, **options)
    assert spec.num_layers == len(spec.layer_names) == len(set(spec.layer_names))
    x = spec.example_input(batch)
    out = chain([spec.build_layer(i) for i in range(spec.num_layers)], x)
    if spec.task == "language":
        assert out.shape == (batch, *spec.input_shape, spec.num_classes)
        target = torch.randint(0, spec.num_classes, (batch, *spec.input_shape))
    else:
        assert out.shape == (batch, spec.num_classes)
        target = torch.randint(0, spec.num_classes, (batch,))
    loss = spec.loss(out, target)
    assert loss.dim() == 0 and torch.isfinite(loss)
    loss.backward()


@pytest.mark.parametrize("name", ["mlp", "mnist-cnn", "char-gpt", "resnet18", "vgg11"])
def test_stages_equal_the_whole_chain(name: str) -> None:
    """Built per stage (fresh, in any order) or whole, the layers have the same weights: same output."""
    options, batch = CASES[name]
    spec = get_model(name, seed=3, **options)
    x = spec.example_input(batch)
    whole = chain([spec.build_layer(i) for i in range(spec.num_layers)], x)
    sizes = even_split(param_counts(spec), 3)
    bounds = [sum(sizes[:k]) for k in range(len(sizes) + 1)]
    stages = [build_stage(spec, a, b) for a, b in reversed(list(zip(bounds, bounds[1:], strict=False)))]
    torch.manual_seed(12345)  # global RNG state must not matter
    assert torch.equal(chain(list(reversed(stages)), x), whole)


def test_seed_changes_weights_and_options_are_recorded() -> None:
    a = get_model("mlp", hidden=8, seed=0)
    b = get_model("mlp", hidden=8, seed=1)
    assert not torch.equal(a.build_layer(1)[0].weight, b.build_layer(1)[0].weight)
    assert torch.equal(a.build_layer(1)[0].weight, get_model("mlp", hidden=8).build_layer(1)[0].weight)
    assert a.options == (("hidden", 8), ("seed", 0))


def test_keys_are_global_and_equal_across_splits() -> None:
    spec = get_model("resnet18", **SMALL)
    whole = stage_state_keys(spec, 0, spec.num_layers)
    assert len(whole) == len(set(whole))
    assert (
        "0.0.weight" in whole
        and "1.body.1.running_mean" in whole
        and f"{spec.num_layers - 1}.2.bias" in whole
    )
    for cuts in ([0, 3, 10], [0, 1, 5, 9, 10]):
        keys = [k for a, b in zip(cuts, cuts[1:], strict=False) for k in stage_state_keys(spec, a, b)]
        assert keys == whole
    stage = build_stage(spec, 4, 6)
    tensors = named_stage_tensors(stage)
    assert set(tensors) == set(stage_state_keys(spec, 4, 6))
    assert set(named_stage_tensors(stage, buffers=False)) == {n for n, _ in stage.named_parameters()}
    assert all(k.split(".")[0] in {"4", "5"} for k in tensors)


def test_param_counts_match_real_layers_and_known_totals() -> None:
    spec = get_model("mnist-cnn")
    real = [sum(p.numel() for p in spec.build_layer(i).parameters()) for i in range(spec.num_layers)]
    assert param_counts(spec) == real
    # ResNet-152 at ImageNet size: 60,192,808 parameters (He et al.; torchvision agrees), counted on meta
    assert sum(param_counts(get_model("resnet152"))) == 60_192_808
    assert sum(param_counts(get_model("resnet50"))) == 25_557_032


def test_vgg_fc_defaults_hold_most_parameters_in_fc_layers_far_above_their_activations() -> None:
    """vgg-fc on MNIST: 1x28x28 -> conv groups 32 | 64 64 | 128, each ending in a 2x2 max-pool
    (28 -> 14 -> 7 -> 3), then fc 1152 -> 512 -> 512 -> 10. Parameter counts from those shapes (3x3 convs
    with bias, linears with bias)."""
    spec = get_model("vgg-fc")
    assert spec.layer_names == ("conv1", "conv2", "conv3", "fc1", "fc2", "head")
    conv = [9 * 1 * 32 + 32, (9 * 32 * 64 + 64) + (9 * 64 * 64 + 64), 9 * 64 * 128 + 128]
    fc = [1152 * 512 + 512, 512 * 512 + 512, 512 * 10 + 10]
    assert param_counts(spec) == conv + fc
    batch = 64
    x = spec.example_input(batch)
    shapes = []
    for i in range(spec.num_layers):
        x = spec.build_layer(i)(x)
        shapes.append(tuple(x.shape[1:]))
    assert shapes == [(32, 14, 14), (64, 7, 7), (128, 3, 3), (512,), (512,), (10,)]
    assert sum(fc) / sum(conv + fc) > 0.85  # VGG-19: 86% of its parameters in the classifier
    # every fc layer holds far more parameters than the activation it hands on for a minibatch of 64
    for params, out_shape in zip(fc[:2], shapes[3:5], strict=True):
        assert params / (batch * math.prod(out_shape)) >= 8


def test_vgg_fc_refuses_more_pools_than_the_image_allows() -> None:
    with pytest.raises(UsageError, match="image_size >= 32"):
        get_model("vgg-fc", channels=((4,),) * 5)


@pytest.mark.parametrize(
    ("counts", "stages", "expected"),
    [
        ([1, 1, 1, 1], 2, [2, 2]),
        ([1, 1, 1, 1], 4, [1, 1, 1, 1]),
        ([5], 1, [1]),
        ([10, 1, 1, 1, 1, 10], 3, [1, 4, 1]),
        ([1, 2, 3, 4, 5, 6], 2, [4, 2]),  # 10 | 11 beats 15 | 6
        ([0, 0, 9, 0, 0], 2, [1, 4]),  # all tie: earlier stages end earliest
        ([8, 1, 1, 1, 1, 1, 1, 1, 1], 2, [1, 8]),
        ([3, 3, 3, 3, 3, 3], 4, [1, 1, 2, 2]),
        ([1, 1, 1, 1, 1, 1, 1], 3, [2, 2, 3]),
    ],
)
def test_even_split(counts: list[int], stages: int, expected: list[int]) -> None:
    assert even_split(counts, stages) == expected


def test_even_split_rejects_impossible() -> None:
    with pytest.raises(UsageError, match="between 1 and 3"):
        even_split([1, 2, 3], 4)
    with pytest.raises(UsageError):
        even_split([1, 2, 3], 0)


def test_unknown_names_and_options_say_what_exists() -> None:
    with pytest.raises(UsageError, match='did you mean "resnet50"'):
        get_model("resnet5")
    with pytest.raises(UsageError, match='did you mean "num_classes"'):
        get_model("vgg11", num_class=3)
    spec = get_model("mlp")
    with pytest.raises(UsageError, match="layers 0..3"):
        spec.build_layer(4)
    with pytest.raises(UsageError):
        build_stage(spec, 2, 2)


def test_user_model_from_function(tmp_path, monkeypatch) -> None:
    (tmp_path / "mymodels.py").write_text(
        textwrap.dedent("""
        from torch import nn

        def tiny(width=4):
            return [nn.Flatten(), nn.Linear(6, width), nn.ReLU(), nn.Linear(width, 3)]
    """)
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        spec = get_model("mymodels:tiny", width=5, input_shape=(2, 3), seed=7)
        again = get_model("mymodels:tiny", width=5, input_shape=(2, 3), seed=7)
        assert spec.num_layers == 4 and spec.num_classes == 3
        x = spec.example_input(2)
        out = chain([spec.build_layer(i) for i in range(4)], x)
        assert out.shape == (2, 3)
        assert torch.equal(out, chain([again.build_layer(i) for i in range(4)], x))
        with pytest.raises(UsageError, match="input_shape"):
            get_model("mymodels:tiny")
        with pytest.raises(UsageError, match="no function"):
            get_model("mymodels:nothing", input_shape=(6,))
        with pytest.raises(UsageError, match="cannot import"):
            get_model("no_such_module_xyz:f")
    finally:
        sys.modules.pop("mymodels", None)


def test_gpt_is_causal() -> None:
    spec = get_model("char-gpt", **CASES["char-gpt"][0])
    layers = [spec.build_layer(i) for i in range(spec.num_layers)]
    x = spec.example_input(1)
    y = x.clone()
    y[0, -1] = (y[0, -1] + 1) % spec.num_classes
    a, b = chain(layers, x), chain(layers, y)
    assert torch.equal(a[:, :-1], b[:, :-1]) and not torch.equal(a[:, -1], b[:, -1])
    assert math.isclose(spec.loss(a, x).item(), math.log(spec.num_classes), rel_tol=0.2)


def test_deep_mlp_keeps_its_activation_scale() -> None:
    # He initialisation: each Linear+ReLU block keeps E[x^2], so a deep MLP neither vanishes nor explodes
    # at the start (PyTorch's default Linear init shrinks it ~6x per block: 1e-6 after 8 blocks).
    spec = get_model("mlp", hidden=[512] * 8)
    x = torch.randn(256, 1, 28, 28)
    second_moments = []
    with torch.no_grad():
        for i in range(spec.num_layers - 1):
            x = spec.build_layer(i, "cpu")(x)
            second_moments.append(float(x.pow(2).mean()))
    first, last = second_moments[1], second_moments[-1]
    assert 0.3 < last / first < 3.0
