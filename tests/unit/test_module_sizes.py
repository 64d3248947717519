"""Small modules with one job: no module in ``server/`` over 300 lines and no function over
60 lines anywhere in the project's packages (docs/architecture.md)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("core", "infra", "kernels", "server", "streams", "learners", "macaron")
MAX_SERVER_MODULE_LINES = 300
MAX_FUNCTION_LINES = 60


def long_functions(path: Path, limit: int) -> list[tuple[str, int]]:
    """Each function or method longer than ``limit`` lines, with its length."""
    tree = ast.parse(path.read_text(), filename=str(path))
    return [
        (node.name, length)
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and (length := (node.end_lineno or node.lineno) - node.lineno + 1) > limit
    ]


def test_server_modules_are_small() -> None:
    large = [
        f"{path.relative_to(ROOT)} ({lines} lines)"
        for path in sorted((ROOT / "server").rglob("*.py"))
        if (lines := len(path.read_text().splitlines())) > MAX_SERVER_MODULE_LINES
    ]
    assert large == []


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
