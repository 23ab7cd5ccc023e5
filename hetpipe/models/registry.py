"""Model lookup by name: the built-in models, and users' models given as "package.module:function"."""

from __future__ import annotations

import copy
import importlib
import inspect
from collections.abc import Callable, Sequence
from dataclasses import replace
from functools import partial
from typing import Any

import torch
from torch import nn

from hetpipe.core.errors import UsageError, did_you_mean
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
                raise UsageError(f'model "{name}" has no option "{key}"{did_you_mean(key, accepted)}; '
                                 f"its options are: {', '.join(accepted)}")
        spec = builder(**options)
    elif ":" in name:
        spec = _user_model(name, dict(options))
    else:
        raise UsageError(f'unknown model "{name}"{did_you_mean(name, list(MODELS))}; known models: '
                         f'{", ".join(MODELS)}, or "package.module:function" for your own')
    return replace(spec, options=tuple(sorted(options.items())))


def _import(target: str) -> Callable[..., Any]:
    module_name, _, attr = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise UsageError(f'cannot import "{module_name}" for model "{target}": {exc}; install the package '
                         f"or add its directory to PYTHONPATH") from exc
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise UsageError(f'"{module_name}" has no function "{attr}" for model "{target}"; '
                         f'write it as "package.module:function"')
    return fn


def _user_model(target: str, options: dict[str, Any]) -> ModelSpec:
    """Call the user's function once (seeded) and wrap a returned list of layers as a ModelSpec."""
    fn = _import(target)
    seed = int(options.pop("seed", 0))
    wrap = {k: options.pop(k) for k in ("input_shape", "input_dtype", "task", "num_classes") if k in options}
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
        raise UsageError(f'model function "{target}" returned {type(result).__name__}; return a ModelSpec '
                         f"or a list of nn.Modules (each taking and returning one tensor)")
    if "input_shape" not in wrap:
        raise UsageError(f'model "{target}" returned a list of layers, so hetpipe cannot know its input: '
                         f"pass input_shape=(...) (per sample, without the batch dimension)")
    return from_layers(list(result), name=target, seed=seed, **wrap)


def from_layers(layers: list[nn.Module], *, name: str, input_shape: Sequence[int],
                input_dtype: torch.dtype = torch.float32, task: Task = "classification",
                num_classes: int | None = None, seed: int = 0) -> ModelSpec:
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
