"""Character-level GPT as a layer list: token+position embedding, pre-LN blocks, final LN + head."""

from __future__ import annotations

import math
from functools import partial

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from hetpipe.core.errors import UsageError
from hetpipe.models.spec import ModelSpec

__all__ = ["char_gpt", "Embedding", "Block", "Head"]

_STD = 0.02


def _init(module: nn.Module, proj_std: float) -> None:
    """GPT-2 initialisation: N(0, 0.02) weights, zero biases, smaller output projections."""
    for name, sub in module.named_modules():
        if isinstance(sub, nn.Linear):
            nn.init.normal_(sub.weight, 0.0, proj_std if name.endswith("proj") else _STD)
            if sub.bias is not None:
                nn.init.zeros_(sub.bias)
        elif isinstance(sub, nn.Embedding):
            nn.init.normal_(sub.weight, 0.0, _STD)


class Embedding(nn.Module):
    """Token ids (B, T) -> token + learned position embeddings (B, T, C)."""

    def __init__(self, vocab_size: int, block_size: int, n_embd: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab_size, n_embd)
        self.pos = nn.Embedding(block_size, n_embd)
        _init(self, _STD)

    def forward(self, idx: Tensor) -> Tensor:
        positions = torch.arange(idx.shape[1], device=idx.device)
        return self.tok(idx) + self.pos(positions)


class Block(nn.Module):
    """Pre-LN transformer block: x + attn(ln(x)), then x + mlp(ln(x)); causal self-attention."""

    def __init__(self, n_embd: int, n_head: int, n_layer: int) -> None:
        super().__init__()
        self.n_head = n_head
        self.ln1 = nn.LayerNorm(n_embd)
        self.qkv = nn.Linear(n_embd, 3 * n_embd)
        self.attn_proj = nn.Linear(n_embd, n_embd)
        self.ln2 = nn.LayerNorm(n_embd)
        self.fc = nn.Linear(n_embd, 4 * n_embd)
        self.mlp_proj = nn.Linear(4 * n_embd, n_embd)
        _init(self, _STD / math.sqrt(2 * n_layer))

    def forward(self, x: Tensor) -> Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.attn_proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.mlp_proj(F.gelu(self.fc(self.ln2(x))))


class Head(nn.Module):
    """Final LayerNorm and the (untied) projection to vocabulary logits (B, T, V)."""

    def __init__(self, n_embd: int, vocab_size: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(n_embd)
        self.out = nn.Linear(n_embd, vocab_size, bias=False)
        _init(self, _STD)

    def forward(self, x: Tensor) -> Tensor:
        return self.out(self.ln(x))


def char_gpt(
    *,
    seed: int = 0,
    vocab_size: int = 96,
    block_size: int = 64,
    n_layer: int = 4,
    n_head: int = 4,
    n_embd: int = 128,
) -> ModelSpec:
    """A small GPT over characters: n_layer + 2 layers; input (block_size,) int64 ids."""
    if n_embd % n_head:
        raise UsageError(f"char-gpt: n_embd={n_embd} must be a multiple of n_head={n_head}")
    names = ("embed", *(f"block{i}" for i in range(n_layer)), "head")
    factories = (
        partial(Embedding, vocab_size, block_size, n_embd),
        *(partial(Block, n_embd, n_head, n_layer) for _ in range(n_layer)),
        partial(Head, n_embd, vocab_size),
    )
    return ModelSpec("char-gpt", names, factories, (block_size,), torch.int64, "language", vocab_size, seed)
