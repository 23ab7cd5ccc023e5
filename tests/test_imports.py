"""Tests of hetpipe.core.imports: users' "package.module:function" found installed or under the working
directory, and errors that say how to fix the name."""

from __future__ import annotations

import os
import sys
import textwrap
from pathlib import Path

import pytest

from hetpipe.core.errors import UsageError
from hetpipe.core.imports import import_target


@pytest.fixture
def project(tmp_path: Path, monkeypatch) -> Path:
    """A user's project directory holding mypkg/models.py, as the working directory, and not on sys.path."""
    (tmp_path / "mypkg").mkdir()
    (tmp_path / "mypkg" / "models.py").write_text(
        textwrap.dedent("""
        def build(width=3):
            return ["layer"] * width
    """)
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", os.getcwd(), str(tmp_path))])
    yield tmp_path
    for name in ("mypkg", "mypkg.models"):
        sys.modules.pop(name, None)


def test_module_under_the_working_directory(project: Path) -> None:
    build = import_target("mypkg.models:build", 'model "mypkg.models:build"')
    assert build(width=2) == ["layer", "layer"]
    assert sys.path[-1] == str(project)  # appended: installed packages of the same name still win


def test_errors_name_the_fix(project: Path) -> None:
    with pytest.raises(UsageError, match='cannot import "nopkg.models" for model "x": .*PYTHONPATH'):
        import_target("nopkg.models:build", 'model "x"')
    assert str(project) not in sys.path  # a module not found here adds nothing to sys.path
    with pytest.raises(UsageError, match='"mypkg.models" has no function "nothing" for model "x"'):
        import_target("mypkg.models:nothing", 'model "x"')
    with pytest.raises(UsageError, match='write it as "package.module:function"'):
        import_target("mypkg.models:", 'model "x"')
