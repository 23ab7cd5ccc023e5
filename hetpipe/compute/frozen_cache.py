"""[train] freeze_cache_mib: each sample's output of a stage's frozen layers, kept and reused where the data
repeat, as PipeTransformer's AutoCache does (docs/wsp.md#the-frozen-layers-cache).

The rule, which the reference implements on its own (hetpipe.compute.reference):
- a minibatch whose first `frozen` layers run frozen looks up every sample (by its index in the training set);
  the frozen layers run only on the samples not kept (all of them, in the minibatch's order, the first time),
  and their rows are kept while the kept rows fit in the size limit; the frozen layers' output is each
  sample's row, kept or new, stacked in the minibatch's order;
- kept rows belong to one frozen count and to the frozen layers' weights and buffers they were computed with:
  a minibatch that runs another count, or sees any of those tensors changed (a pull brought other values),
  forgets them all first.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from hetpipe.compute.stage_freezing import run_frozen, run_layers

__all__ = ["FrozenCache"]


class FrozenCache:
    """One stage's kept outputs of its frozen layers, by sample index, within `limit_bytes`."""

    def __init__(self, limit_bytes: int) -> None:
        self.limit_bytes = limit_bytes
        self.rows: dict[int, Tensor] = {}
        self.bytes = 0
        self.hits = 0  # minibatches served from kept rows
        self.misses = 0  # minibatches whose frozen layers ran
        self._frozen = 0
        self._made_with: list[Tensor] = []  # the frozen layers' weights and buffers the rows were made with
        # the tensors last seen unchanged, each with its version counter: seen again untouched, no comparison
        # (on CUDA a comparison waits for the device)
        self._seen: list[tuple[Tensor, int]] = []

    def run(self, module: nn.Module, inputs: Tensor, frozen: int, ids: Sequence[int] | None) -> Tensor:
        """`module` on `inputs` as run_layers does, the first `frozen` layers' output taken from the rows kept
        of the samples `ids` (one per row of `inputs`), run on the others."""
        if not frozen or ids is None or self.limit_bytes <= 0:
            return run_layers(module, inputs, frozen)
        layers = list(module.children())
        state = [t for layer in layers[:frozen] for t in (*layer.parameters(), *layer.buffers())]
        untouched = len(state) == len(self._seen) and all(
            t is seen and t._version == version for t, (seen, version) in zip(state, self._seen, strict=True)
        )
        if frozen != self._frozen or not (untouched or _equal(state, self._made_with)):
            self._forget(frozen, state)
        self._seen = [(t, t._version) for t in state]
        rows = [self.rows.get(int(i)) for i in ids]
        missing = [j for j, row in enumerate(rows) if row is None]
        if not missing:
            self.hits += 1
            x = torch.stack(rows)  # type: ignore[arg-type]
        else:
            self.misses += 1
            whole = len(missing) == len(rows)
            x = run_frozen(layers[:frozen], inputs if whole else inputs[missing])
            for j, row in zip(missing, x, strict=True):
                size = row.numel() * row.element_size()
                if self.bytes + size <= self.limit_bytes:
                    self.rows[int(ids[j])] = row.clone()
                    self.bytes += size
                rows[j] = row
            x = x if whole else torch.stack(rows)  # type: ignore[arg-type]
        for layer in layers[frozen:]:
            x = layer(x)
        return x

    def _forget(self, frozen: int, state: list[Tensor]) -> None:
        self.rows.clear()
        self.bytes = 0
        self._frozen = frozen
        self._made_with = [t.detach().clone() for t in state]


def _equal(a: list[Tensor], b: list[Tensor]) -> bool:
    return len(a) == len(b) and all(
        x.shape == y.shape and torch.equal(x, y) for x, y in zip(a, b, strict=True)
    )
