"""The CPU local optimizers are torch.optim's updates bit for bit, without importing torch._dynamo."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from torch import nn

from hetpipe.compute.optim import LocalOptimizer, make_optimizer


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3, bias=False))


@pytest.mark.parametrize(
    ("name", "weight_decay"),
    [("sgd", 0.0), ("sgd", 1e-2), ("momentum", 0.0), ("momentum", 1e-3), ("adam", 0.0), ("adam", 1e-2)],
)
def test_the_same_updates_as_torch_optim_bit_for_bit(name: str, weight_decay: float) -> None:
    ours, theirs = _model(0), _model(0)
    opt_ours = LocalOptimizer(list(ours.parameters()), name, 0.05, 0.9, weight_decay)
    kwargs = {"lr": 0.05, "weight_decay": weight_decay}
    opt_theirs = (
        torch.optim.Adam(theirs.parameters(), **kwargs)
        if name == "adam"
        else torch.optim.SGD(theirs.parameters(), momentum=0.9 if name == "momentum" else 0.0, **kwargs)
    )
    gen = torch.Generator().manual_seed(1)
    for _ in range(6):
        x = torch.randn(4, 5, generator=gen)
        for model, opt in ((ours, opt_ours), (theirs, opt_theirs)):
            model(x).pow(2).sum().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    for a, b in zip(ours.parameters(), theirs.parameters(), strict=True):
        assert torch.equal(a, b)


def test_a_parameter_without_gradient_is_left_alone() -> None:
    w = nn.Parameter(torch.ones(3))
    opt = make_optimizer([w], "adam", 0.1, 0.9, 0.0)
    opt.step()
    assert torch.equal(w, torch.ones(3)) and make_optimizer([], "sgd", 0.1, 0.9, 0.0) is None
    with pytest.raises(ValueError, match="unknown optimizer 'rmsprop'"):
        make_optimizer([w], "rmsprop", 0.1, 0.9, 0.0)


def test_a_cpu_stage_never_imports_dynamo() -> None:
    probe = (
        "import sys, torch\nfrom hetpipe.compute.optim import make_optimizer\n"
        "w = torch.nn.Parameter(torch.ones(3)); o = make_optimizer([w], 'adam', 0.1, 0.9, 0.0)\n"
        "w.sum().backward(); o.step(); o.zero_grad()\nprint('torch._dynamo' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
