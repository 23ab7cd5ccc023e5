"""A parsed config handed to other processes: msgpack for a child process (pack_config, unpack_config) and
TOML text for a run directory's record of the effective config (config_toml)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import msgpack

from hetpipe.core.config.messages import _key
from hetpipe.core.config.parse import parse_config
from hetpipe.core.config.schema import ClusterConfig

__all__ = ["config_toml", "pack_config", "unpack_config"]


def pack_config(config: ClusterConfig) -> bytes:
    """The parsed config for a child process (msgpack of its dict form); unpack_config reverses it."""
    return msgpack.packb({"path": str(config.path), "config": config.to_dict()})


def unpack_config(packed: bytes) -> ClusterConfig:
    """The config a parent packed with pack_config, validated again (cheap) on this side."""
    doc = msgpack.unpackb(packed)
    return parse_config(doc["config"], Path(doc["path"]))


def config_toml(config: ClusterConfig) -> str:
    """The config as TOML text (every field, inline tables): load_config of it equals `config` but for `path`.

    For a run directory's record of the effective config that processes on other hosts or namespaces read
    (the testbed's `hetpipe server`/`hetpipe worker`); not for making variants of a config (use --set).
    """
    return "".join(f"{_key(key)} = {_toml_value(value)}\n" for key, value in config.to_dict().items())


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_toml_value(item) for item in value) + "]"
    if isinstance(value, Mapping):
        if not value:
            return "{}"
        return "{ " + ", ".join(f"{_key(k)} = {_toml_value(v)}" for k, v in value.items()) + " }"
    raise TypeError(f"no TOML form for {type(value).__name__}")
