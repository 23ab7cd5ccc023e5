"""Config files on disk: the packaged default, loading a file (with hints for a missing file or bad syntax),
and the config a run directory was started with."""

from __future__ import annotations

import re
import tomllib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hetpipe.core.config.messages import _fail
from hetpipe.core.config.overrides import apply_overrides
from hetpipe.core.config.parse import parse_config
from hetpipe.core.config.schema import ClusterConfig
from hetpipe.core.errors import UsageError, did_you_mean

__all__ = ["default_config_path", "load_config", "run_dir_config"]


def default_config_path() -> Path:
    """The packaged default config (2 virtual workers x 2 emulated GPUs on 127.0.0.1)."""
    return Path(__file__).resolve().parents[2] / "clusters" / "local.toml"


def load_config(path: str | Path) -> ClusterConfig:
    """Read and validate one cluster config; any problem raises ConfigError naming the fix."""
    path = Path(path)
    return parse_config(_read_toml(path), path)


def run_dir_config(run_dir: Path, settings: Sequence[str] = ()) -> ClusterConfig:
    """The config a `hetpipe train` run in `run_dir` was started with (its config.toml), `settings`
    applied."""
    path = Path(run_dir) / "config.toml"
    if not path.exists():
        raise UsageError(
            f"{run_dir}: no config.toml there; is it the run dir of a `hetpipe train` run? "
            "Give the cluster config too (the CONFIG argument)"
        )
    return apply_overrides(load_config(path), settings)


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        _fail(path, "", "no such config file", _missing_file_hint(path))
    except IsADirectoryError:
        _fail(path, "", "is a directory, not a config file", _missing_file_hint(path / "x.toml"))
    except OSError as exc:
        _fail(path, "", f"cannot read: {exc.strerror or exc}", "check that the file is readable by this user")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        _fail(path, "", f"not UTF-8 text (bad byte at offset {exc.start})", "save the file as UTF-8")
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        _fail(path, "", f"invalid TOML: {exc}", _syntax_hint(str(exc), text))


def _missing_file_hint(path: Path) -> str:
    folder = path.parent
    known = sorted(p.name for p in folder.glob("*.toml")) if folder.is_dir() else []
    if not known:
        return f"check the path; the packaged default config is {default_config_path()}"
    return f"configs in {folder}: {', '.join(known)}{did_you_mean(path.name, known)}"


def _syntax_hint(message: str, text: str) -> str:
    general = "strings need quotes, sections are [name], repeated tables are [[name]]"
    match = re.search(r"at line (\d+)", message)
    lines = text.splitlines()
    if match is None or not 1 <= int(match[1]) <= len(lines):
        return f"fix the syntax there ({general})"
    return f"line {match[1]} reads `{lines[int(match[1]) - 1].strip()}`; fix its syntax ({general})"
