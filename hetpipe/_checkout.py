"""server/ and worker/ sit at the top of a source checkout (the layout the project keeps) and install as
hetpipe.server and hetpipe.worker (setup.cfg's package_dir). In a checkout that was never installed, the
finder here maps those two names to the two folders, so `PYTHONPATH=. python -c "import hetpipe.server"`
works; an install (editable or not) is found first and this finder is never asked."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

__all__ = ["CheckoutFolders", "install"]

FOLDERS = ("server", "worker")  # top-level folders of the checkout that are subpackages of hetpipe


class CheckoutFolders(importlib.abc.MetaPathFinder):
    """Finds `hetpipe.<folder>` in `<root>/<folder>` for the folders named; their submodules are then found by
    the ordinary path finder through the package's __path__."""

    def __init__(self, root: Path, folders: Sequence[str] = FOLDERS) -> None:
        self.packages = {f"hetpipe.{name}": root / name for name in folders}

    def find_spec(
        self, fullname: str, path: Sequence[str] | None = None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        folder = self.packages.get(fullname)
        if folder is None or not (folder / "__init__.py").is_file():
            return None
        return importlib.util.spec_from_file_location(
            fullname, folder / "__init__.py", submodule_search_locations=[str(folder)]
        )


def install(package_dir: Path) -> None:
    """Add the finder (last, so any install wins) when `package_dir` (hetpipe/) lies in a checkout whose
    server/ and worker/ are beside it rather than inside it."""
    root = package_dir.parent
    if (package_dir / FOLDERS[0]).is_dir() or not (root / FOLDERS[0] / "__init__.py").is_file():
        return
    if not any(isinstance(finder, CheckoutFolders) for finder in sys.meta_path):
        sys.meta_path.append(CheckoutFolders(root))
