"""Tests of hetpipe/_checkout.py: hetpipe.server and hetpipe.worker import from a source checkout that was
never installed (server/ and worker/ beside hetpipe/), and an install's own layout is left alone."""

from __future__ import annotations

import shutil
import site
import subprocess
import sys
from pathlib import Path

from hetpipe._checkout import CheckoutFolders

ROOT = Path(__file__).resolve().parents[1]


def _copy_checkout(dest: Path) -> None:
    for folder in ("hetpipe", "server", "worker"):
        shutil.copytree(ROOT / folder, dest / folder, ignore=shutil.ignore_patterns("__pycache__"))


def test_a_checkout_that_was_never_installed_imports_server_and_worker(tmp_path: Path) -> None:
    """`PYTHONPATH=. python -c "import hetpipe.server, hetpipe.worker"` in a copy of the tree; -S keeps this
    environment's own (editable) install of hetpipe out, the dependencies stay reachable by path."""
    _copy_checkout(tmp_path)
    code = (
        "import hetpipe.server, hetpipe.worker, hetpipe.server.launch, hetpipe.worker.jobs\n"
        "print(hetpipe.server.__file__); print(hetpipe.worker.jobs.__file__)"
    )
    path = [str(tmp_path), *site.getsitepackages()]
    result = subprocess.run(
        [sys.executable, "-S", "-c", code],
        cwd=tmp_path,
        env={"PYTHONPATH": ":".join(path), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == [
        str(tmp_path / "server" / "__init__.py"),
        str(tmp_path / "worker" / "jobs.py"),
    ]


def test_the_finder_maps_only_the_two_folders(tmp_path: Path) -> None:
    (tmp_path / "server").mkdir()
    (tmp_path / "server" / "__init__.py").write_text("")
    finder = CheckoutFolders(tmp_path)
    spec = finder.find_spec("hetpipe.server")
    assert spec is not None and spec.submodule_search_locations == [str(tmp_path / "server")]
    assert finder.find_spec("hetpipe.worker") is None  # no such folder here
    assert finder.find_spec("hetpipe.tests") is None and finder.find_spec("server") is None
