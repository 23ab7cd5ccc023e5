"""Tests of hetpipe.app.export and `hetpipe export`: a run directory's model rebuilt whole, dtypes
restored."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from hetpipe.app.export import load_model
from hetpipe.cli import main
from hetpipe.compute.build import model_of
from hetpipe.core.config.files import load_config
from hetpipe.core.config.serialize import config_toml
from hetpipe.core.errors import UsageError
from hetpipe.models import build_stage

ROOT = Path(__file__).resolve().parents[1]


def fake_run(tmp_path: Path, seed: int = 5) -> tuple[Path, dict[str, torch.Tensor]]:
    """A run dir as `hetpipe train` leaves it: config.toml and model.pt holding what the PS holds (every
    tensor float32), here the example model's weights as built with another seed, BatchNorm counters at 7."""
    config = load_config(ROOT / "examples" / "tiny_convnet.toml")
    other = build_stage(model_of(replace(config, seed=seed)), 0, 5, "cpu")
    state = {
        k: (torch.full_like(v, 7.0) if k.endswith("num_batches_tracked") else v).float()
        for k, v in other.state_dict().items()
    }
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.toml").write_text(config_toml(config))
    torch.save(state, run_dir / "model.pt")
    return run_dir, state


@pytest.fixture
def in_repo(monkeypatch):
    """Run from the repository root, as the example's README says (examples.tiny_convnet imports from
    there)."""
    monkeypatch.chdir(ROOT)
    yield
    for name in [m for m in sys.modules if m == "examples" or m.startswith("examples.")]:
        sys.modules.pop(name)


def test_load_model_restores_weights_and_dtypes(tmp_path: Path, in_repo) -> None:
    run_dir, state = fake_run(tmp_path)
    model = load_model(run_dir)
    assert not model.training
    loaded = model.state_dict()
    assert loaded.keys() == state.keys()
    for key, value in loaded.items():
        assert torch.equal(value.float(), state[key]), key
    assert (
        loaded["0.1.num_batches_tracked"].dtype == torch.int64 and int(loaded["0.1.num_batches_tracked"]) == 7
    )
    assert model(torch.randn(2, 1, 28, 28)).shape == (2, 10)


def test_load_model_names_what_is_missing(tmp_path: Path, in_repo) -> None:
    run_dir, _ = fake_run(tmp_path)
    (run_dir / "model.pt").unlink()
    with pytest.raises(UsageError, match="model.pt .its final weights. is missing"):
        load_model(run_dir)


def test_export_cli_writes_a_loadable_module(tmp_path: Path, in_repo, capsys) -> None:
    run_dir, state = fake_run(tmp_path)
    out = tmp_path / "out" / "m.pt"
    main(["export", str(run_dir), "--out", str(out)])
    assert f"wrote {out}" in capsys.readouterr().out
    module = torch.load(out, weights_only=False)
    assert isinstance(module, torch.nn.Sequential)
    assert torch.equal(module.state_dict()["4.weight"], state["4.weight"])
