"""Fine-tuning: `[model] init` starts a run from a state dict (an earlier run's model.pt), and MNIST's
`classes` option keeps some digits only, so a model trained on some digits fine-tunes on others."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hetpipe.compute.build import check_init, model_of
from hetpipe.compute.data import load_dataset
from hetpipe.compute.reference import run_reference
from hetpipe.core.config.files import load_config
from hetpipe.core.config.overrides import apply_overrides
from hetpipe.core.errors import UsageError
from hetpipe.models import build_stage

from conftest import write_config
from equivalence import assert_equals_reference, listed_work


def test_mnist_classes_keeps_those_digits_with_their_labels() -> None:
    some = load_dataset("mnist", test_fraction=0.2, seed=0, classes=[5, 6, 7, 8, 9])
    every = load_dataset("mnist", test_fraction=0.2, seed=0)
    assert set(some.train.y.tolist()) == set(some.test.y.tolist()) == {5, 6, 7, 8, 9}
    assert some.num_classes == 10 and 0 < len(some.train.y) < len(every.train.y)
    for bad in ([], [3, 3], [10], "5"):
        with pytest.raises(UsageError, match="classes must be distinct digits 0-9"):
            load_dataset("mnist", test_fraction=0.2, seed=0, classes=bad)


def _config(tmp_path: Path, init: Path | None, extra: list[str]):
    path = write_config(tmp_path, vws=[["n0:0", "n0:1"], ["n0:2", "n0:3"]], nm=2, staleness=1, waves=6)
    settings = ["data.options={ classes = [5, 6, 7, 8, 9] }", *extra]
    if init is not None:
        settings.append(f'model.init="{init}"')
    return apply_overrides(load_config(path), settings)


def test_a_run_from_an_init_state_equals_the_reference_and_starts_from_it(tmp_path: Path) -> None:
    """A state made here (the builder's weights, changed) as model.init: the run equals the reference, which
    loads the file on its own, bit for bit, with two layers frozen from wave 2 (a fine-tuning run); starting
    from the builder's weights instead ends elsewhere."""
    plain = _config(tmp_path, None, [])
    spec = model_of(plain)
    state = {k: v * 0.5 + 0.01 for k, v in build_stage(spec, 0, spec.num_layers).state_dict().items()}
    init = tmp_path / "pretrained.pt"
    torch.save(state, init)
    config = _config(tmp_path, init, ["train.freeze=[[2, 2]]"])
    splits = [(2, 2), (3, 1)]
    _, stage_weights = assert_equals_reference(tmp_path, config, splits, order=1)
    frozen = [k for k in state if int(k.split(".")[0]) < 2]  # trained in waves 0-1, then frozen
    assert frozen and all(not torch.equal(stage_weights[(0, 0)][k], state[k]) for k in frozen)
    other = run_reference(apply_overrides(config, ['model.init=""']), splits, 1, work=listed_work(config))
    assert any(not torch.equal(stage_weights[(0, 0)][k], other.stage_weights[(0, 0)][k]) for k in frozen)


def test_an_init_that_is_not_the_models_state_is_refused_naming_the_field(tmp_path: Path) -> None:
    plain = _config(tmp_path, None, [])
    spec = model_of(plain)
    state = build_stage(spec, 0, spec.num_layers).state_dict()
    cases = {
        "missing.pt": (None, "cannot be read"),
        "short.pt": ({k: v for k, v in list(state.items())[1:]}, "lacks"),
        "extra.pt": ({**state, "9.weight": torch.zeros(1)}, "has keys the model does not"),
        "shape.pt": ({k: v[:1] if v.dim() else v for k, v in state.items()}, "has other shapes for"),
    }
    for name, (content, says) in cases.items():
        if content is not None:
            torch.save(content, tmp_path / name)
        with pytest.raises(UsageError, match=f"model.init = .*{name}.* {says}"):
            check_init(_config(tmp_path, tmp_path / name, []), spec)


def test_the_benchmark_peers_start_from_the_init_state_with_the_same_layers_frozen(tmp_path: Path) -> None:
    """launch/bench/peers.py's DDP, pipeline and solo runs fine-tune as hetpipe does: from model.init, with
    train.freeze's layers frozen (no gradient, eval mode) from their first step; a later freeze is refused."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "launch" / "bench"))
    import peers

    plain = _config(tmp_path, None, [])
    spec = model_of(plain)
    state = {k: v + 1.0 for k, v in build_stage(spec, 0, spec.num_layers).state_dict().items()}
    torch.save(state, tmp_path / "pre.pt")
    config = _config(tmp_path, tmp_path / "pre.pt", ["train.freeze=[[1, 2]]"])
    module = peers._fine_tuned(build_stage(spec, 0, spec.num_layers), config)
    assert all(torch.equal(module.state_dict()[k], state[k]) for k in state)
    trains = {k: p.requires_grad for k, p in module.named_parameters()}
    assert trains == {k: int(k.split(".")[0]) >= 2 for k in trains} and not all(trains.values())
    assert not module[1].training and module[2].training
    late = _config(tmp_path, None, ["train.freeze=[[2, 2]]"])
    with pytest.raises(UsageError, match="the peers freeze from their first step only"):
        peers._fine_tuned(build_stage(spec, 0, spec.num_layers), late)
