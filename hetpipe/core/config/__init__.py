"""Cluster config: one TOML file per cluster -> frozen dataclasses; every error names file, field, bad value,
fix. `schema` holds the dataclasses of a parsed config and the keys each table allows; `table` reads one TOML
table with typed getters, and `messages` words its errors; `parse` turns a decoded document into a
ClusterConfig, through `gpus` ([gpu_types], [[nodes]], [[virtual_workers]]) and `sections` (the settings
sections), then checks across sections; `files` loads a config file (and the one a run directory was started
with); `overrides` applies `--set KEY.PATH=VALUE`; `serialize` hands a parsed config to other processes
(msgpack, TOML text)."""

from __future__ import annotations

from hetpipe.core.config.files import default_config_path, load_config, run_dir_config
from hetpipe.core.config.overrides import apply_overrides
from hetpipe.core.config.parse import parse_config
from hetpipe.core.config.schema import (
    AllocationConfig,
    CheckpointConfig,
    ClusterConfig,
    DataConfig,
    EmulationConfig,
    FrozenMap,
    GpuRef,
    GpuType,
    ModelConfig,
    NetworkConfig,
    Node,
    PsConfig,
    TrainConfig,
    VirtualWorkerSpec,
    WspConfig,
)
from hetpipe.core.config.serialize import config_toml, pack_config, unpack_config

__all__ = [
    "AllocationConfig",
    "CheckpointConfig",
    "ClusterConfig",
    "DataConfig",
    "EmulationConfig",
    "FrozenMap",
    "GpuRef",
    "GpuType",
    "ModelConfig",
    "NetworkConfig",
    "Node",
    "PsConfig",
    "TrainConfig",
    "VirtualWorkerSpec",
    "WspConfig",
    "apply_overrides",
    "config_toml",
    "default_config_path",
    "load_config",
    "pack_config",
    "parse_config",
    "run_dir_config",
    "unpack_config",
]
