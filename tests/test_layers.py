"""Dependencies flow one way (docs/architecture.md): core <- compute <- runtime <- app. Walks every import
of the package, function-level ones included, and fails on one that points up or sideways."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# folder on disk -> package it is installed as (setup.cfg's package_dir); launch/ holds scripts, not a package
SOURCES = {"hetpipe": "hetpipe", "server": "hetpipe.server", "worker": "hetpipe.worker", "launch": "launch"}
# package prefix -> (rank, layer name); the longest matching prefix wins. Core's subpackages are ranked among
# themselves too (hetpipe/core/__init__.py lists them in this order): each imports only those below it.
LAYERS = {
    "hetpipe": (0, "core"),  # hetpipe/__init__.py (the version) and _checkout.py
    "hetpipe.core": (0, "core"),  # errors, imports, registry
    "hetpipe.core.wsp": (1, "core/wsp"),
    "hetpipe.core.protocol": (1, "core/protocol"),
    "hetpipe.core.pipeline": (2, "core/pipeline"),
    "hetpipe.core.config": (3, "core/config"),
    "hetpipe.core.hardware": (4, "core/hardware"),
    "hetpipe.core.planning": (5, "core/planning"),
    "hetpipe.core.runs": (6, "core/runs"),
    "hetpipe.compute": (10, "compute"),
    "hetpipe.models": (10, "compute"),
    "hetpipe.server": (20, "runtime"),
    "hetpipe.worker": (20, "runtime"),
    "hetpipe.app": (30, "app"),
    "hetpipe.cli": (30, "app"),
    "hetpipe.__main__": (30, "app"),
    "launch": (40, "launch"),  # scripts and benchmarks: they may use every layer, and no layer uses them
}
CORE_RANKS = 7  # ranks below this are core: pure, no torch
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
            if mine[0] < CORE_RANKS and top in NOT_IN_CORE:
                problems.append(
                    f"{where}: core module {me} imports {top}; "
                    "core stays pure (move it to compute or runtime)"
                )
            theirs = layer_of(target) if top in ("hetpipe", "launch") else None
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
        ("hetpipe.core.errors", "core"),
        ("hetpipe.core.wsp.state", "core/wsp"),
        ("hetpipe.core.pipeline.schedule", "core/pipeline"),
        ("hetpipe.core.config", "core/config"),
        ("hetpipe.core.planning.planner", "core/planning"),
        ("hetpipe.models.gpt", "compute"),
        ("hetpipe.compute.reference", "compute"),
        ("hetpipe.worker.stage", "runtime"),
        ("hetpipe.app.train", "app"),
        ("hetpipe.cli", "app"),
        ("launch.bench.gpu", "launch"),
    ],
)
def test_layer_of(module: str, layer: str) -> None:
    assert layer_of(module)[1] == layer


def test_core_subpackages_rank_in_the_order_of_core_init() -> None:
    """The rules go one way inside core too: the WSP state under the schedules, the schedules under the
    config, the config under the planner; and every core subpackage is a package on disk that LAYERS knows."""
    order = [
        "hetpipe.core.wsp.state",
        "hetpipe.core.pipeline.schedule",
        "hetpipe.core.config",
        "hetpipe.core.hardware.devices",
        "hetpipe.core.planning.planner",
        "hetpipe.core.runs.testbed",
    ]
    ranks = [layer_of(m)[0] for m in order]
    assert ranks == sorted(ranks) and len(set(ranks)) == len(ranks)
    on_disk = {f"hetpipe.core.{p.parent.name}" for p in (ROOT / "hetpipe" / "core").glob("*/__init__.py")}
    assert on_disk == {prefix for prefix in LAYERS if prefix.startswith("hetpipe.core.")}
