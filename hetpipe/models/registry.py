"""Model lookup by name: the built-in models, and users' models given as "package.module:function"."""

from __future__ import annotations

import copy
import inspect
from collections.abc import Callable, Sequence
from dataclasses import replace
from functools import partial
from typing import Any

import torch
from torch import nn

from hetpipe.core.errors import UsageError, did_you_mean
from hetpipe.core.imports import import_target
from hetpipe.models.cnn import mnist_cnn
from hetpipe.models.gpt import char_gpt
from hetpipe.models.mlp import mlp
from hetpipe.models.resnet import resnet
from hetpipe.models.spec import ModelSpec, Task
from hetpipe.models.vgg import vgg, vgg_fc

__all__ = ["MODELS", "get_model", "model_names", "from_layers"]

MODELS: dict[str, Callable[..., ModelSpec]] = {
    "mlp": mlp,
    "mnist-cnn": mnist_cnn,
    "char-gpt": char_gpt,
    "resnet18": partial(resnet, 18),
    "resnet50": partial(resnet, 50),
    "resnet152": partial(resnet, 152),
    "vgg11": partial(vgg, 11),
    "vgg19": partial(vgg, 19),
    "vgg-fc": vgg_fc,
}


def model_names() -> list[str]:
    return list(MODELS)


def _accepted(fn: Callable[..., Any]) -> tuple[list[str], bool]:
    """Keyword names `fn` accepts, and whether it also takes **kwargs."""
    params = inspect.signature(fn).parameters.values()
    names = [p.name for p in params if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return names, any(p.kind is p.VAR_KEYWORD for p in params)


def get_model(name: str, **options: Any) -> ModelSpec:
    """The ModelSpec called `name` built with `options` (seed=0 by default; see each builder's keywords)."""
    if name in MODELS:
        builder = MODELS[name]
        accepted, _ = _accepted(builder)
        for key in options:
            if key not in accepted:
                raise UsageError(
                    f'model "{name}" has no option "{key}"{did_you_mean(key, accepted)}; '
                    f"its options are: {', '.join(accepted)}"
                )
        spec = builder(**options)
    elif ":" in name:
        spec = _user_model(name, dict(options))
    else:
        raise UsageError(
            f'unknown model "{name}"{did_you_mean(name, list(MODELS))}; known models: '
            f'{", ".join(MODELS)}, or "package.module:function" for your own'
        )
    return replace(spec, options=tuple(sorted(options.items())))


def _input_dtype(target: str, value: Any) -> torch.dtype:
    """A dtype given in TOML as its name ("float32", "int64") or already a torch.dtype."""
    if isinstance(value, torch.dtype):
        return value
    found = getattr(torch, str(value), None)
    if not isinstance(found, torch.dtype):
        raise UsageError(
            f'model "{target}": input_dtype {value!r} is not a torch dtype; use e.g. "float32" for '
            'images or "int64" for token ids'
        )
    return found


def _user_model(target: str, options: dict[str, Any]) -> ModelSpec:
    """Call the user's function once (seeded) and wrap a returned list of layers or nn.Sequential as a
    ModelSpec.

    The contract (README "Your own model"): `function(**options)` returns a ModelSpec, an nn.Sequential, or a
    list of nn.Modules, each layer taking one tensor and returning one (the last returns logits: (B, classes),
    or (B, T, vocab) for language); the layers are hetpipe's split points. The options input_shape (one
    sample, without the batch dimension; required for layers), input_dtype (default "float32"), task
    ("classification" or "language") and num_classes (default: the last nn.Linear's out_features) describe the
    model to hetpipe and are not passed on; `seed` is passed when the function takes it. Every process calls
    the function with torch's default generator seeded from `seed`, so initial weights drawn from it agree
    everywhere.
    """
    fn = import_target(target, f'model "{target}"')
    seed = int(options.pop("seed", 0))
    wrap = {k: options.pop(k) for k in ("input_shape", "input_dtype", "task", "num_classes") if k in options}
    if "input_dtype" in wrap:
        wrap["input_dtype"] = _input_dtype(target, wrap["input_dtype"])
    accepted, any_kw = _accepted(fn)
    if any_kw or "seed" in accepted:
        options["seed"] = seed
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        result = fn(**options)
    if isinstance(result, ModelSpec):
        return result
    if isinstance(result, nn.Module) and not isinstance(result, nn.Sequential):
        result = [result]
    if not isinstance(result, Sequence | nn.Sequential):
        raise UsageError(
            f'model function "{target}" returned {type(result).__name__}; return a ModelSpec, '
            f"an nn.Sequential or a list of nn.Modules (each taking and returning one tensor)"
        )
    if "input_shape" not in wrap:
        raise UsageError(
            f'model "{target}" returned a list of layers, so hetpipe cannot know its input: '
            f"pass input_shape=(...) (per sample, without the batch dimension), e.g. "
            f"options = {{ input_shape = [1, 28, 28] }}"
        )
    return from_layers(list(result), name=target, seed=seed, **wrap)


def from_layers(
    layers: list[nn.Module],
    *,
    name: str,
    input_shape: Sequence[int],
    input_dtype: torch.dtype = torch.float32,
    task: Task = "classification",
    num_classes: int | None = None,
    seed: int = 0,
) -> ModelSpec:
    """A ModelSpec over already-built layers; build_layer(i) returns a deep copy of layers[i].

    Determinism across processes then rests on the function that built `layers` (get_model calls it
    with torch seeded from `seed`).
    """
    for i, layer in enumerate(layers):
        if not isinstance(layer, nn.Module):
            raise UsageError(f"model {name}: layer {i} is a {type(layer).__name__}, not an nn.Module")
    if num_classes is None:
        linears = [m for layer in layers for m in layer.modules() if isinstance(m, nn.Linear)]
        if not linears:
            raise UsageError(f"model {name}: cannot tell the number of classes; pass num_classes=...")
        num_classes = linears[-1].out_features
    names = tuple(f"{type(layer).__name__.lower()}{i}" for i, layer in enumerate(layers))
    factories = tuple(partial(copy.deepcopy, layer) for layer in layers)
    return ModelSpec(name, names, factories, tuple(input_shape), input_dtype, task, num_classes, seed)
