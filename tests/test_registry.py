"""Tests of hetpipe/core/registry.py: names in registration order, "package.module:attr" imported and checked,
errors that list the known names, no name taken twice."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from hetpipe.core.errors import UsageError
from hetpipe.core.registry import Registry


def numbers() -> Registry[int]:
    return Registry("number", "numbers", lambda item: isinstance(item, int), "mypkg.numbers:SEVEN")


def test_names_keep_registration_order_and_refuse_a_second_definition() -> None:
    reg = numbers()
    reg.register("two", 2)
    reg.register("one", 1)
    assert reg.names() == ["two", "one"] and list(reg) == ["two", "one"] and len(reg) == 2
    assert reg.get("one") == 1 and reg["two"] == 2 and "one" in reg and "three" not in reg
    with pytest.raises(ValueError, match="registered twice"):
        reg.register("one", 1)
    with pytest.raises(ValueError, match='may not hold ":"'):
        reg.register("a:b", 3)
    with pytest.raises(TypeError, match="is not a number"):
        reg.register("text", "3")  # type: ignore[arg-type]
    reg.unregister("one")
    assert reg.names() == ["two"]


def test_an_unknown_name_lists_the_known_ones_and_the_closest() -> None:
    reg = numbers()
    reg.register("seven", 7)
    reg.register("eleven", 11)
    with pytest.raises(UsageError) as info:
        reg.get("sevn")
    message = str(info.value)
    assert message.startswith('unknown number "sevn"')
    assert "known numbers: eleven, seven" in message and 'did you mean "seven"' in message


@pytest.fixture
def plugin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A user's module on the path: mypkg_numbers.py with SEVEN = 7 and TEXT = "7"."""
    (tmp_path / "mypkg_numbers.py").write_text('SEVEN = 7\nTEXT = "7"\n')
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "mypkg_numbers"
    sys.modules.pop("mypkg_numbers", None)


def test_a_module_attr_name_is_imported_once_and_checked(plugin: str) -> None:
    reg = numbers()
    assert reg.get(f"{plugin}:SEVEN") == 7
    assert reg.names() == []  # an imported name is not a registered one: known lists stay the registered
    sys.modules[plugin].SEVEN = 8
    assert reg.get(f"{plugin}:SEVEN") == 7  # resolved once per process
    with pytest.raises(UsageError, match='"mypkg_numbers:TEXT" is not a number'):
        reg.get(f"{plugin}:TEXT")
    with pytest.raises(UsageError, match='has no "NINE"'):
        reg.get(f"{plugin}:NINE")
    with pytest.raises(UsageError, match='cannot import "no_such_module_here"'):
        reg.get("no_such_module_here:SEVEN")
