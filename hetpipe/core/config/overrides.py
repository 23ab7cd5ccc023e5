"""`--set KEY.PATH=VALUE` overrides: each VALUE read as TOML, set into the config's document by path, and the
result validated like the file."""

from __future__ import annotations

import tomllib
from collections.abc import Sequence
from typing import Any

from hetpipe.core.config.parse import parse_config
from hetpipe.core.config.schema import ClusterConfig
from hetpipe.core.errors import ConfigError

__all__ = ["apply_overrides"]


def apply_overrides(config: ClusterConfig, settings: Sequence[str]) -> ClusterConfig:
    """The config with `--set KEY.PATH=VALUE` overrides applied and validated like the file.

    VALUE is read as a TOML value (4, 0.01, true, [2, 3], { hidden = [64] }) and otherwise taken as a
    string (gpipe, latest); KEY.PATH walks tables by name and arrays by index (virtual_workers.0.layers).
    Errors name the file, the key and the fix, as for the file itself.
    """
    if not settings:
        return config
    doc = config.to_dict()
    for item in settings:
        key, sep, text = item.partition("=")
        parts = key.strip().split(".")
        if not sep or not all(parts):
            raise ConfigError(
                f"--set {item!r}: write KEY.PATH=VALUE, e.g. --set wsp.nm=4 or --set train.lr=0.01"
            )
        _set_path(doc, parts, _override_value(text.strip()), item)
    shown = " ".join(f"--set {item}" for item in settings)
    return parse_config(doc, config.path, source=f"{config.path} with {shown}")


def _override_value(text: str) -> Any:
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def _set_path(doc: dict[str, Any], parts: list[str], value: Any, item: str) -> None:
    node: Any = doc
    for depth, part in enumerate(parts[:-1]):
        if isinstance(node, list):
            node = node[_index(node, part, parts[:depth], item)]
        elif isinstance(node, dict):
            node = node.setdefault(part, {})
        else:
            raise ConfigError(f"--set {item!r}: {'.'.join(parts[: depth + 1])} is a value, not a table")
    last = parts[-1]
    if isinstance(node, list):
        node[_index(node, last, parts[:-1], item)] = value
    elif isinstance(node, dict):
        node[last] = value
    else:
        raise ConfigError(f"--set {item!r}: {'.'.join(parts[:-1])} is a value, not a table")


def _index(items: list[Any], part: str, where: list[str], item: str) -> int:
    if not part.isdigit() or int(part) >= len(items):
        raise ConfigError(
            f"--set {item!r}: {'.'.join(where)} has {len(items)} entries; "
            f"index them 0..{len(items) - 1}, e.g. {'.'.join(where)}.0"
        )
    return int(part)
