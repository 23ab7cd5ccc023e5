"""How config errors read: the error line (file, field path, what, fix), values and keys as TOML writes them,
kinds of values, ranges, ordinals."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, NoReturn

from hetpipe.core.errors import ConfigError

_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")


def _fail(file: Path | str, where: str, what: str, fix: str) -> NoReturn:
    head = f"{file}: {where}: {what}" if where else f"{file}: {what}"
    raise ConfigError(f"{head}\n  {fix}")


def _key(key: str) -> str:
    return key if _BARE_KEY.fullmatch(key) else json.dumps(key, ensure_ascii=False)


def _show(value: Any) -> str:
    """A value as TOML would write it, shortened."""
    if isinstance(value, bool):
        text = "true" if value else "false"
    elif isinstance(value, str):
        text = json.dumps(value, ensure_ascii=False)
    elif isinstance(value, list):
        text = "[" + ", ".join(_show(item) for item in value) + "]"
    elif isinstance(value, dict):
        text = "{" + ", ".join(f"{_key(k)} = {_show(v)}" for k, v in value.items()) + "}"
    else:
        text = str(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _kind_of(value: Any) -> str:
    kinds = [
        (bool, "a boolean"),
        (int, "an integer"),
        (float, "a float"),
        (str, "a string"),
        (list, "an array"),
        (dict, "a table"),
    ]
    return next((name for kind, name in kinds if isinstance(value, kind)), "a date/time")


def _in_range(
    value: float,
    *,
    gt: float | None = None,
    ge: float | None = None,
    lt: float | None = None,
    le: float | None = None,
) -> bool:
    return (
        (gt is None or value > gt)
        and (ge is None or value >= ge)
        and (lt is None or value < lt)
        and (le is None or value <= le)
    )


def _range_text(
    *, gt: float | None = None, ge: float | None = None, lt: float | None = None, le: float | None = None
) -> str:
    """ ">= 0", "> 0", "in (0, 1)", "in [1024, 65535]"."""
    low = f"[{ge}" if ge is not None else f"({gt}" if gt is not None else None
    high = f"{le}]" if le is not None else f"{lt})" if lt is not None else None
    if low and high:
        return f"in {low}, {high}"
    if low:
        return f">= {ge}" if ge is not None else f"> {gt}"
    if high:
        return f"<= {le}" if le is not None else f"< {lt}"
    return ""


def _ordinal(n: int) -> str:
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"
