"""What planning needs of a model (name, variant digest, dtype, layer count) without importing torch: the
catalog hetpipe/profiles/models.json for the built-in variants it lists, else the model built."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hetpipe.core.planning.profile import variant_digest

__all__ = [
    "CATALOG",
    "ModelKey",
    "catalog_entry",
    "key_of",
    "model_key",
    "options_text",
    "write_catalog",
]

# written by launch/ship_profiles.py; tests/test_model_catalog.py rebuilds every entry and compares
CATALOG = Path(__file__).resolve().parents[1] / "profiles" / "models.json"


@dataclass(frozen=True)
class ModelKey:
    """A model variant as profiles and calibrations name it: importing torch (~2 s) only to learn these is
    what the catalog saves."""

    name: str
    options_digest: str  # variant_digest of its options and input
    dtype: str  # its parameters' dtype, the one its profiles are measured in by default
    num_layers: int


def options_text(options: Mapping[str, Any]) -> str:
    """The options as the catalog spells them: JSON with sorted keys, without the seed (which changes a
    built-in model's weights, never its input or layers)."""
    return json.dumps({k: v for k, v in options.items() if k != "seed"}, sort_keys=True)


def model_key(name: str, options: Mapping[str, Any], catalog: Path = CATALOG) -> ModelKey:
    """The key of model `name` built with `options` (a seed among them): from the catalog when it lists the
    options, else from the model built (torch imported: a user's model, or options the catalog lacks)."""
    entry = _read(catalog).get(name, {}).get(options_text(options))
    if entry is not None:
        digest = variant_digest(sorted(options.items()), entry["input_shape"], entry["input_dtype"])
        return ModelKey(name, digest, entry["dtype"], entry["num_layers"])
    from hetpipe.models import get_model

    return key_of(get_model(name, **options))


def key_of(spec: Any) -> ModelKey:
    """The key of a built ModelSpec."""
    from hetpipe.compute.profiler import options_digest, profile_dtype

    return ModelKey(spec.name, options_digest(spec), profile_dtype(spec, None), spec.num_layers)


def catalog_entry(name: str, options: Mapping[str, Any]) -> dict[str, Any]:
    """What the catalog says of a built-in model variant, read from the model built now (torch)."""
    from hetpipe.compute.profiler import profile_dtype
    from hetpipe.models import get_model

    spec = get_model(name, **options)
    return {
        "input_shape": list(spec.input_shape),
        "input_dtype": str(spec.input_dtype),
        "dtype": profile_dtype(spec, None),
        "num_layers": spec.num_layers,
    }


def write_catalog(variants: list[tuple[str, Mapping[str, Any]]], catalog: Path = CATALOG) -> None:
    """Write the catalog of `variants` ((name, options) of built-in models), each built to read its entry."""
    table: dict[str, dict[str, dict[str, Any]]] = {}
    for name, options in variants:
        table.setdefault(name, {})[options_text(options)] = catalog_entry(name, options)
    catalog.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")


def _read(catalog: Path) -> dict[str, dict[str, dict[str, Any]]]:
    """The catalog's table, or {} when it is missing or unreadable (then models are built)."""
    try:
        table = json.loads(catalog.read_text())
    except (OSError, ValueError):
        return {}
    return table if isinstance(table, dict) else {}
