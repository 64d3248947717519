"""Small modules with one job: no module over 400 lines in the project's packages (300 in
``server/``) and no function over 60 lines (docs/architecture.md)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("core", "infra", "kernels", "engines", "server", "streams", "learners", "macaron")
MAX_MODULE_LINES = 400
MAX_SERVER_MODULE_LINES = 300
MAX_FUNCTION_LINES = 60


def large_modules(root: Path, packages: tuple[str, ...], limit: int) -> list[str]:
    """Each module of ``packages`` under ``root`` longer than ``limit`` lines, with its length."""
    return [
        f"{path.relative_to(root)} ({lines} lines)"
        for package in packages
        for path in sorted((root / package).rglob("*.py"))
        if (lines := len(path.read_text().splitlines())) > limit
    ]


def long_functions(path: Path, limit: int) -> list[tuple[str, int]]:
    """Each function or method longer than ``limit`` lines, with its length."""
    tree = ast.parse(path.read_text(), filename=str(path))
    return [
        (node.name, length)
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and (length := (node.end_lineno or node.lineno) - node.lineno + 1) > limit
    ]


def test_modules_are_small() -> None:
    assert large_modules(ROOT, PACKAGES, MAX_MODULE_LINES) == []


def test_server_modules_are_smaller() -> None:
    assert large_modules(ROOT, ("server",), MAX_SERVER_MODULE_LINES) == []


def test_the_check_measures_a_long_module(tmp_path: Path) -> None:
    (tmp_path / "engines").mkdir()
    (tmp_path / "engines" / "big.py").write_text("x = 1\n" * 401)
    (tmp_path / "engines" / "small.py").write_text("x = 1\n" * 400)
    assert large_modules(tmp_path, ("engines",), MAX_MODULE_LINES) == ["engines/big.py (401 lines)"]


def test_functions_are_short() -> None:
    found = [
        f"{path.relative_to(ROOT)}:{name} ({length} lines)"
        for package in PACKAGES
        for path in sorted((ROOT / package).rglob("*.py"))
        for name, length in long_functions(path, MAX_FUNCTION_LINES)
    ]
    assert found == []


def test_the_check_measures_a_long_function(tmp_path: Path) -> None:
    module = tmp_path / "probe.py"
    body = "\n".join(f"    x{i} = {i}" for i in range(61))
    module.write_text(f"def long():\n{body}\n\n\nasync def short():\n    return 1\n")
    assert long_functions(module, MAX_FUNCTION_LINES) == [("long", 62)]
