"""A model's per-layer sizes without measuring it: a ModelProfile with zero times, for the memory check of
`hetpipe train` (hetpipe.core.planning.fit). Not a profile: nothing is timed.

One forward (and the loss) at batch 1 and one at batch 2 on the CPU, one thread, with zeroed weights: each
layer is built on the meta device and given memory only while it runs. What a minibatch holds (output, saved
activations, input, working memory) is affine in its samples (per-channel statistics and the loss do not
grow), so the two runs give it exactly at any batch: the sizes hetpipe.compute.profiler measures there, which
the planner's memory model uses. Milliseconds for small models, about a second for ResNet-152 at 224 x 224.
(The meta device alone would need no memory and no arithmetic, but its first ReLU imports torch._dynamo: a
second, every time.)
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from hetpipe.compute.profiler import OPTIMIZER_STATE, storage_key, tensor_bytes
from hetpipe.core.errors import UsageError
from hetpipe.core.planning.profile import LayerProfile, ModelProfile
from hetpipe.models.spec import ModelSpec

__all__ = ["model_sizes"]


def model_sizes(spec: ModelSpec, batch_size: int, optimizer: str) -> ModelProfile:
    """Sizes of every layer of `spec` at `batch_size` as hetpipe.compute.profiler defines them; times are
    0."""
    if optimizer not in OPTIMIZER_STATE:
        raise UsageError(f'unknown optimizer "{optimizer}"; choose one of: {", ".join(OPTIMIZER_STATE)}')
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise UsageError(f"batch_size must be an integer >= 1, got {batch_size!r}")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # small batches gain nothing from threads, and lose much on a busy machine
    try:
        with torch.random.fork_rng(devices=[]):  # dropout draws: leave the caller's RNG as it was
            one, input_one = _sizes_at(spec, optimizer, 1)
            two, input_two = _sizes_at(spec, optimizer, 2)
    finally:
        torch.set_num_threads(threads)

    def at_batch(size_one: int, size_two: int) -> int:  # a + b x batch, from the two runs
        return size_one + (size_two - size_one) * (batch_size - 1)

    layers = tuple(
        LayerProfile(
            name=a.name,
            forward_s=0.0,
            backward_s=0.0,
            param_bytes=a.param_bytes,
            optimizer_bytes=a.optimizer_bytes,
            output_bytes=at_batch(a.output_bytes, b.output_bytes),
            saved_bytes=at_batch(a.saved_bytes, b.saved_bytes),
            working_bytes=at_batch(a.working_bytes, b.working_bytes),
        )
        for a, b in zip(one, two, strict=True)
    )
    dtype = next(
        (
            str(p.dtype).removeprefix("torch.")
            for i in range(spec.num_layers)
            for p in spec.build_layer(i, "meta").parameters()
            if p.is_floating_point()
        ),
        "float32",
    )
    return ModelProfile(
        model=spec.name,
        batch_size=batch_size,
        gpu_type="sizes",
        dtype=dtype,
        torch_version=torch.__version__,
        input_bytes=at_batch(input_one, input_two),
        layers=layers,
    )


def _sizes_at(spec: ModelSpec, optimizer: str, batch_size: int) -> tuple[list[LayerProfile], int]:
    """Every layer's sizes at `batch_size` (times 0), and the input's bytes."""
    x = spec.example_input(batch_size)
    input_bytes = tensor_bytes(x)
    target_shape = (batch_size,) if spec.task == "classification" else (batch_size, *spec.input_shape)
    target = torch.zeros(target_shape, dtype=torch.long)
    kept: list[Tensor] = []  # every saved activation stays alive, so no storage address is reused
    seen: set[int] = set()
    out_layers = []
    for i in range(spec.num_layers):
        layer = _materialise(spec.build_layer(i, "meta")).train()
        own_tensors = [*layer.parameters(), *layer.buffers()]
        own = {storage_key(t) for t in own_tensors}
        found: dict[int, Tensor] = {}

        def pack(t: Tensor, own: set[int] = own, found: dict[int, Tensor] = found) -> Tensor:
            key = storage_key(t)
            if key not in own and key != 0:
                found[key] = t
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = layer(x)
            if i == spec.num_layers - 1:
                spec.loss(out, target)
        trainable = sum(tensor_bytes(p) for p in layer.parameters() if p.requires_grad)
        input_grad = tensor_bytes(x) if x.requires_grad else 0
        out_layers.append(
            LayerProfile(
                name=spec.layer_names[i],
                forward_s=0.0,
                backward_s=0.0,
                param_bytes=sum(tensor_bytes(t) for t in own_tensors),
                optimizer_bytes=OPTIMIZER_STATE[optimizer] * trainable,
                output_bytes=tensor_bytes(out),
                saved_bytes=sum(t.untyped_storage().nbytes() for key, t in found.items() if key not in seen),
                working_bytes=tensor_bytes(out) + input_grad,
            )
        )
        seen.update(found)
        kept.extend(found.values())
        x = out.detach().requires_grad_(out.is_floating_point())  # drops the graph, and with it the weights
        del layer, own_tensors, out
    return out_layers, input_bytes


def _materialise(layer: nn.Module) -> nn.Module:
    """The meta layer with zeroed CPU memory for its parameters and buffers (tied ones stay tied).

    Not `Module.to_empty`: its empty_like of a meta tensor goes through torch._refs and imports sympy (1 s).
    """
    made: dict[int, Tensor] = {}
    for module in layer.modules():
        for table in (module._parameters, module._buffers):
            for name, t in table.items():
                if t is None:
                    continue
                if id(t) not in made:
                    fresh = torch.zeros(t.shape, dtype=t.dtype)  # not empty: garbage may be denormals (slow)
                    made[id(t)] = (
                        nn.Parameter(fresh, t.requires_grad) if isinstance(t, nn.Parameter) else fresh
                    )
                table[name] = made[id(t)]
    return layer
