"""No untyped row leaves ``infra/``: every public function and method of the storage back ends
(``infra/postgres``, ``infra/kafka``) says what it returns, and what it returns is never a row as
a dict (``dict[str, Any]``, ``Mapping[str, Any]``, psycopg's ``DictRow``, or ``Any``). Back ends
map their rows to the records of ``core`` at their own edge (``core.registry``: ``TrainingRun``,
``DatasetSnapshot``, ``AdapterVersion`` ...).

With ``mypy --strict`` that rule is also the rule against ``row["..."]`` lookups outside
``infra/``: a function that returns ``fetchone()``'s dict under a record's name does not type
check, so the applications can only subscript what is a dict by nature (JSON documents, wire
frames), never a row."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BACK_ENDS = ("infra/postgres", "infra/kafka")
UNTYPED = ("dict[str, Any]", "Mapping[str, Any]", "DictRow", "Any")


def _untyped(annotation: ast.expr | None) -> str | None:
    """What about a return annotation lets a row through, if anything."""
    if annotation is None:
        return "no return annotation"
    text = ast.unparse(annotation)
    if text == "Any":
        return "returns Any"
    found = [u for u in UNTYPED[:-1] if u in text]
    return f"returns {found[0]}" if found else None


def _public_functions(tree: ast.Module) -> list[ast.FunctionDef]:
    """Top-level public functions and the public methods of public classes."""
    found: list[ast.FunctionDef] = []
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and not node.name.startswith("_"):
            found.append(node)
        elif isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
            found += [
                item
                for item in node.body
                if isinstance(item, ast.FunctionDef) and not item.name.startswith("_")
            ]
    return found


def untyped_rows(root: Path = ROOT) -> list[str]:
    bad = []
    paths = sorted(p for back_end in BACK_ENDS for p in (root / back_end).rglob("*.py"))
    for path in paths:
        tree = ast.parse(path.read_text(), filename=str(path))
        for function in _public_functions(tree):
            why = _untyped(function.returns)
            if why is not None:
                bad.append(f"{path.relative_to(root)}:{function.lineno} {function.name} {why}")
    return bad


def test_no_untyped_row_leaves_infra() -> None:
    assert untyped_rows() == []


def test_the_check_sees_a_row_returned_as_a_dict(tmp_path: Path) -> None:
    (tmp_path / "infra" / "postgres").mkdir(parents=True)
    (tmp_path / "infra" / "postgres" / "runs.py").write_text(
        "def training_run(conn, run_id) -> dict[str, Any] | None: ...\n"
        "def rows(conn) -> list[DictRow]: ...\n"
        "def anything(conn) -> Any: ...\n"
        "def unsaid(conn): ...\n"
        "def typed(conn) -> TrainingRun | None: ...\n"
        "def document(conn) -> dict[str, JsonValue]: ...\n"
        "def _private(conn) -> dict[str, Any]: ...\n"
        "class Claim:\n"
        "    def acquire(self) -> Mapping[str, Any] | None: ...\n"
    )
    assert untyped_rows(tmp_path) == [
        "infra/postgres/runs.py:1 training_run returns dict[str, Any]",
        "infra/postgres/runs.py:2 rows returns DictRow",
        "infra/postgres/runs.py:3 anything returns Any",
        "infra/postgres/runs.py:4 unsaid no return annotation",
        "infra/postgres/runs.py:9 acquire returns Mapping[str, Any]",
    ]
