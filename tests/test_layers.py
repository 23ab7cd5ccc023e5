"""Dependencies flow one way (docs/architecture.md): core <- compute <- runtime <- app. Walks every import
of the package, function-level ones included, and fails on one that points up or sideways."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# folder on disk -> package it is installed as (setup.cfg's package_dir)
SOURCES = {"hetpipe": "hetpipe", "server": "hetpipe.server", "worker": "hetpipe.worker"}
LAYERS = {  # package prefix -> (rank, layer name); the longest matching prefix wins
    "hetpipe.core": (0, "core"),
    "hetpipe.compute": (1, "compute"),
    "hetpipe.models": (1, "compute"),
    "hetpipe.server": (2, "runtime"),
    "hetpipe.worker": (2, "runtime"),
    "hetpipe.app": (3, "app"),
    "hetpipe.cli": (3, "app"),
    "hetpipe.__main__": (3, "app"),
    "hetpipe": (0, "core"),  # hetpipe/__init__.py: the version only
}
PEERS = ("hetpipe.server", "hetpipe.worker")  # the two runtimes never import each other
NOT_IN_CORE = (
    "torch",
)  # core is pure: plain data and numpy (wire.py also names ZeroMQ frames and socket options)


def module_name(path: Path) -> str:
    folder, *rest = path.relative_to(ROOT).with_suffix("").parts
    parts = [*SOURCES[folder].split("."), *rest]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer_of(module: str) -> tuple[int, str, str] | None:
    for prefix in sorted(LAYERS, key=len, reverse=True):
        if module == prefix or module.startswith(prefix + "."):
            return (*LAYERS[prefix], prefix)
    return None


def imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every import in the file, wherever it stands."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module))
            found += [(node.lineno, f"{node.module}.{alias.name}") for alias in node.names]
    return found


def package_files() -> list[Path]:
    return sorted(p for folder in SOURCES for p in (ROOT / folder).rglob("*.py"))


def violations() -> list[str]:
    problems = []
    for path in package_files():
        me = module_name(path)
        mine = layer_of(me)
        assert mine is not None, (
            f"{path}: module {me} belongs to no layer; add it to LAYERS (and docs/architecture.md)"
        )
        for line, target in imports(path):
            where = f"{path.relative_to(ROOT)}:{line}"
            top = target.split(".")[0]
            if mine[1] == "core" and top in NOT_IN_CORE:
                problems.append(
                    f"{where}: core module {me} imports {top}; "
                    "core stays pure (move it to compute or runtime)"
                )
            theirs = layer_of(target) if top == "hetpipe" else None
            if theirs is None:
                continue
            if theirs[0] > mine[0]:
                problems.append(f"{where}: {me} ({mine[1]}) imports {target} ({theirs[1]}), a layer above it")
            elif mine[2] in PEERS and theirs[2] in PEERS and mine[2] != theirs[2]:
                problems.append(
                    f"{where}: {me} imports {target}: server and worker must not import each other"
                )
    return problems


def test_every_import_points_down() -> None:
    assert violations() == []


def test_the_walk_sees_imports_inside_functions(tmp_path: Path) -> None:
    source = tmp_path / "m.py"
    source.write_text("def f():\n    from hetpipe.app.train import train\n    import torch\n")
    assert (2, "hetpipe.app.train.train") in imports(source) and (3, "torch") in imports(source)


@pytest.mark.parametrize(
    ("module", "layer"),
    [
        ("hetpipe.core.wsp", "core"),
        ("hetpipe.models.gpt", "compute"),
        ("hetpipe.compute.reference", "compute"),
        ("hetpipe.worker.stage", "runtime"),
        ("hetpipe.app.train", "app"),
        ("hetpipe.cli", "app"),
    ],
)
def test_layer_of(module: str, layer: str) -> None:
    assert layer_of(module)[1] == layer
