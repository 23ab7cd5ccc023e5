"""WeightSwap: a module computes on given tensors in place of its parameters, as
torch.func.functional_call."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.func import functional_call

from hetpipe.compute.weight_swap import WeightSwap


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(5, 3)
        self.mix = nn.Linear(3, 3)
        self.head = nn.Linear(3, 5, bias=False)
        self.head.weight = self.embed.weight  # one parameter in two modules

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.mix(self.embed(x))))


def test_outputs_and_gradients_equal_functional_call_and_tied_slots_follow():
    torch.manual_seed(0)
    module, x = Tied(), torch.tensor([[0, 3, 4], [1, 2, 2]])
    stash = {k: (w.detach() * 1.5 + 0.1).requires_grad_() for k, w in module.named_parameters()}
    assert set(stash) == {"embed.weight", "mix.weight", "mix.bias"}  # the tied head.weight is embed.weight
    with WeightSwap(module).using(stash):
        out = module(x)
    expected = functional_call(module, stash, (x,), strict=False)
    assert torch.equal(out, expected)
    grads = torch.autograd.grad(out.square().sum(), list(stash.values()))
    reference = torch.autograd.grad(expected.square().sum(), list(stash.values()))
    assert all(torch.equal(a, b) for a, b in zip(grads, reference, strict=True))
    assert module.head.weight is module.embed.weight and isinstance(module.head.weight, nn.Parameter)


def test_parameters_are_back_after_the_block_also_when_it_raises():
    module = nn.Linear(2, 2)
    weight, bias = module.weight, module.bias
    with pytest.raises(RuntimeError, match="boom"), WeightSwap(module).using({"weight": torch.zeros(2, 2)}):
        assert torch.equal(module.weight, torch.zeros(2, 2)) and module.bias is bias
        raise RuntimeError("boom")
    assert module.weight is weight and module.bias is bias
