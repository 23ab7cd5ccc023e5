"""Reading one TOML table of a config: typed getters (strings, names, numbers in range, choices, registered
names, arrays, sub-tables) whose errors name the file, field path, bad value and fix."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

from hetpipe.core.config.messages import _fail, _in_range, _key, _kind_of, _ordinal, _range_text, _show
from hetpipe.core.config.schema import _SECTIONS, FrozenMap
from hetpipe.core.errors import UsageError, did_you_mean
from hetpipe.core.registry import Registry

_NAME = re.compile(r"[A-Za-z0-9_-]+")
_REQUIRED: Any = object()
_NAME_FIX = "use only letters, digits, '-' and '_'"


@dataclass(frozen=True)
class _Table:
    """One TOML table being read: where it is (field path) and how a fix line names it."""

    file: str  # how errors name the document: its path, or "path with --set ..."
    where: str  # field path of the table: "", "wsp", "nodes[2]", "gpu_types.titan-v"
    under: str  # how a fix line names the table: "under [wsp]", "in the 3rd [[nodes]] table"
    data: Mapping[str, Any]

    def at(self, key: str) -> str:
        return f"{self.where}.{key}" if self.where else key

    def fail(self, key: str, what: str, fix: str) -> NoReturn:
        _fail(self.file, self.at(key), what, fix)

    def only(self, allowed: Sequence[str]) -> None:
        """Reject the first key (in file order) that is not in `allowed`."""
        for key in self.data:
            if key not in allowed:
                home = [s for s, keys in _SECTIONS.items() if key in keys and s != self.where]
                moved = f" (`{key}` belongs under [{home[0]}])" if len(home) == 1 else ""
                self.fail(
                    _key(key),
                    "unknown key",
                    f"allowed keys {self.under}: {', '.join(allowed)}{did_you_mean(key, allowed)}{moved}",
                )

    def _get(self, key: str, default: Any, placeholder: str) -> Any:
        if key in self.data:
            return self.data[key]
        if default is _REQUIRED:
            self.fail(key, "required field is missing", f"add `{key} = {placeholder}` {self.under}")
        return default

    def _type_error(self, key: str, value: Any, kind: str, placeholder: str) -> NoReturn:
        self.fail(
            key,
            f"expected {kind}, got {_show(value)} ({_kind_of(value)})",
            f"write `{key} = {placeholder}` {self.under}",
        )

    def _check_range(self, key: str, value: float, kind: str, **bounds: float | None) -> None:
        if not _in_range(value, **bounds):
            text = _range_text(**bounds)
            self.fail(
                key, f"must be {text}, got {_show(value)}", f"set `{key}` {self.under} to {kind} {text}"
            )

    def string(self, key: str, default: Any = _REQUIRED, *, nonempty: bool = False) -> str:
        value = self._get(key, default, '"<str>"')
        if not isinstance(value, str):
            self._type_error(key, value, "a string", '"<str>"')
        if nonempty and not value:
            self.fail(key, "must not be empty", f'set `{key} = "<str>"` {self.under}')
        return value

    def name(self, key: str) -> str:
        value = self.string(key)
        if not _NAME.fullmatch(value):
            self.fail(key, f"invalid name {_show(value)}", _NAME_FIX)
        return value

    def integer(
        self, key: str, default: Any = _REQUIRED, *, ge: int | None = None, le: int | None = None
    ) -> int:
        placeholder = f"<int {_range_text(ge=ge, le=le)}>" if ge is not None or le is not None else "<int>"
        value = self._get(key, default, placeholder)
        if not isinstance(value, int) or isinstance(value, bool):
            self._type_error(key, value, "an integer", placeholder)
        self._check_range(key, value, "an integer", ge=ge, le=le)
        return value

    def number(
        self,
        key: str,
        default: Any = _REQUIRED,
        *,
        placeholder: str | None = None,
        kind: str = "a number",
        gt: float | None = None,
        ge: float | None = None,
        lt: float | None = None,
    ) -> float:
        placeholder = placeholder or f"<float {_range_text(gt=gt, ge=ge, lt=lt)}>"
        value = self._get(key, default, placeholder)
        if not isinstance(value, int | float) or isinstance(value, bool):
            self._type_error(key, value, kind, placeholder)
        if not math.isfinite(value):
            self.fail(
                key, f"must be a finite number, got {_show(value)}", f"set `{key}` {self.under} to {kind}"
            )
        self._check_range(key, value, "a number", gt=gt, ge=ge, lt=lt)
        return float(value)

    def boolean(self, key: str, default: Any = _REQUIRED) -> bool:
        value = self._get(key, default, "<true|false>")
        if not isinstance(value, bool):
            self._type_error(key, value, "a boolean", "true or false")
        return value

    def registered(self, key: str, default: Any, registry: Registry[Any]) -> str:
        """A name of `registry` (a schedule, an aggregation rule): one it knows, or "package.module:attr"
        naming one defined outside hetpipe, imported here to check it."""
        names = registry.names()
        placeholder = " | ".join(f'"{c}"' for c in names)
        value = self._get(key, default, placeholder)
        if not isinstance(value, str):
            self._type_error(key, value, "a string", placeholder)
        if ":" in value:
            try:
                registry.get(value)
            except UsageError as exc:
                self.fail(key, f"cannot use {_show(value)}", str(exc).replace("\n", " "))
        elif value not in registry:
            self.fail(
                key,
                f"unknown value {_show(value)}",
                f"choose one of: {', '.join(names)}{did_you_mean(value, names)}, or name one of your own "
                f'as "package.module:attr"',
            )
        return value

    def choice(self, key: str, default: Any, choices: Sequence[str]) -> Any:
        placeholder = " | ".join(f'"{c}"' for c in choices)
        value = self._get(key, default, placeholder)
        if not isinstance(value, str):
            self._type_error(key, value, "a string", placeholder)
        if value not in choices:
            self.fail(
                key,
                f"unknown value {_show(value)}",
                f"choose one of: {', '.join(choices)}{did_you_mean(value, choices)}",
            )
        return value

    def strings(self, key: str, *, placeholder: str, nonempty: bool = False) -> tuple[str, ...]:
        value = self._get(key, _REQUIRED, placeholder)
        if not isinstance(value, list):
            self._type_error(key, value, "an array of strings", placeholder)
        if nonempty and not value:
            self.fail(key, "must not be empty", f"write `{key} = {placeholder}` {self.under}")
        for j, item in enumerate(value):
            if not isinstance(item, str):
                self.fail(
                    f"{key}[{j}]",
                    f"expected a string, got {_show(item)} ({_kind_of(item)})",
                    f"write `{key} = {placeholder}` {self.under} (strings need quotes)",
                )
        return tuple(value)

    def ints(self, key: str, default: Any, *, placeholder: str, ge: int) -> tuple[int, ...] | None:
        value = self._get(key, default, placeholder)
        if value is None:
            return None
        if not isinstance(value, list):
            self._type_error(key, value, "an array of integers", placeholder)
        for j, item in enumerate(value):
            if not isinstance(item, int) or isinstance(item, bool):
                self.fail(
                    f"{key}[{j}]",
                    f"expected an integer, got {_show(item)} ({_kind_of(item)})",
                    f"write `{key} = {placeholder}` {self.under}",
                )
            if item < ge:
                self.fail(
                    f"{key}[{j}]",
                    f"must be >= {ge}, got {item}",
                    f"write `{key} = {placeholder}` {self.under}",
                )
        return tuple(value)

    def options(self, key: str) -> FrozenMap:
        value = self.data.get(key, {})
        if not isinstance(value, dict):
            self._type_error(key, value, "a table", "{ <key> = <value>, ... }")
        return FrozenMap(value)

    def section(self, key: str, allowed: Sequence[str] | None = None) -> _Table:
        """A sub-table (absent: empty), its keys checked against `allowed` when given."""
        value = self.data.get(key, {})
        where = self.at(_key(key))
        if not isinstance(value, dict):
            self.fail(
                _key(key),
                f"expected a table, got {_show(value)} ({_kind_of(value)})",
                f"write it as a [{where}] section",
            )
        table = _Table(self.file, where, f"under [{where}]", value)
        if allowed is not None:
            table.only(allowed)
        return table

    def array(self, key: str) -> list[_Table]:
        """An array of tables (absent: empty)."""
        value = self.data.get(key, [])
        if not isinstance(value, list):
            self.fail(
                key,
                f"expected an array of tables, got {_kind_of(value)}",
                f"write each entry as a [[{key}]] table (double brackets)",
            )
        tables = []
        for i, item in enumerate(value):
            if not isinstance(item, dict):
                self.fail(
                    f"{key}[{i}]",
                    f"expected a table, got {_show(item)} ({_kind_of(item)})",
                    f"write each entry as a [[{key}]] table (double brackets)",
                )
            tables.append(
                _Table(self.file, self.at(f"{key}[{i}]"), f"in the {_ordinal(i + 1)} [[{key}]] table", item)
            )
        return tables
