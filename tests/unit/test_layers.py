"""Imports point down: ``core`` <- ``infra``, ``kernels`` <- ``server``, ``streams``, ``learners``
<- ``macaron`` (docs/architecture.md). An import that runs upward or sideways fails here."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROJECT = ("core", "infra", "kernels", "server", "streams", "learners", "macaron")
MAY_IMPORT: dict[str, frozenset[str]] = {
    "core": frozenset(),
    "kernels": frozenset(),
    "infra": frozenset({"core"}),
    "server": frozenset({"core", "infra", "kernels"}),
    "streams": frozenset({"core", "infra"}),
    "learners": frozenset({"core", "infra", "kernels"}),
    "macaron": frozenset(PROJECT),
}


def imported_packages(path: Path) -> list[tuple[int, str]]:
    """Each project package a module imports, with the line, wherever the import stands."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        found += [(node.lineno, n.split(".")[0]) for n in names if n.split(".")[0] in PROJECT]
    return found


def upward_imports() -> list[str]:
    bad = []
    for layer, allowed in MAY_IMPORT.items():
        for path in sorted((ROOT / layer).rglob("*.py")):
            for line, package in imported_packages(path):
                if package != layer and package not in allowed:
                    bad.append(f"{path.relative_to(ROOT)}:{line} imports {package}")
    return bad


def test_imports_point_down() -> None:
    assert upward_imports() == []


def test_the_check_sees_an_upward_import(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text(
        "import os\nfrom server.chat import x\n\ndef f():\n    import learners.loop\n"
    )
    assert imported_packages(module) == [(2, "server"), (5, "learners")]
