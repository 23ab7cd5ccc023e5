"""Cluster config: one TOML file per cluster -> frozen dataclasses; every error names file, field, bad value,
fix. `schema` holds the dataclasses of a parsed config and the keys each table allows; `table` reads one TOML
table with typed getters, and `messages` words its errors; `parse` turns a decoded document into a
ClusterConfig, through `gpus` ([gpu_types], [[nodes]], [[virtual_workers]]) and `sections` (the settings
sections), then checks across sections; `files` loads a config file (and the one a run directory was started
with); `overrides` applies `--set KEY.PATH=VALUE`; `serialize` hands a parsed config to other processes
(msgpack, TOML text)."""
