"""Small modules with one job: no module over 400 lines in the project's packages (300 in
``server/``) and no function over 60 lines (docs/architecture.md)."""

from __future__ import annotations

import ast
import re
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


MAX_PARAMETERS = 6
"""Besides the receiver (``self``, ``cls``, an autograd function's ``ctx``): more, and the
caller is unpacking an object that already exists (pass the object)."""
RECEIVERS = ("self", "cls", "ctx")
NO_PARAMETER_CAP = ("kernels",)
"""Kernels take their tensors one by one, as the maths names them."""


def long_parameter_lists(path: Path, limit: int) -> list[tuple[str, int]]:
    """Each function or method with more than ``limit`` parameters besides its receiver, and
    how many, leaving out command-line commands (a parameter that is a ``typer`` option or
    argument: the parameters are the command's options)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        args = [*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs]
        if any(_TYPER.search(ast.unparse(a.annotation)) for a in args if a.annotation):
            continue
        names = [a.arg for a in args]
        if names and names[0] in RECEIVERS:
            names = names[1:]
        if len(names) > limit:
            found.append((node.name, len(names)))
    return found


_TYPER = re.compile(r"\btyper\.(Option|Argument)\(")


def test_functions_take_few_parameters() -> None:
    found = {
        f"{path.relative_to(ROOT)}:{name}"
        for package in PACKAGES
        if package not in NO_PARAMETER_CAP
        for path in sorted((ROOT / package).rglob("*.py"))
        for name, _ in long_parameter_lists(path, MAX_PARAMETERS)
    }
    assert found == set(), "over the cap: pass an object"


def test_the_check_counts_parameters(tmp_path: Path) -> None:
    module = tmp_path / "probe.py"
    module.write_text(
        "import typer\napp = typer.Typer()\n\n"
        "def seven(a, b, c, d, e, f, *, g=1):\n    pass\n\n"
        "class A:\n    def six(self, a, b, c, d, e, f):\n        pass\n\n"
        "def cli(a: Annotated[int, typer.Option()], b, c, d, e, f, g, h):\n    pass\n"
    )
    assert long_parameter_lists(module, MAX_PARAMETERS) == [("seven", 7)]
