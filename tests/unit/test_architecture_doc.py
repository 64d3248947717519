"""The map stays true: ``docs/architecture.md`` names every module of the project's packages by
its path, and names no module that is gone."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "architecture.md"
PACKAGES = ("core", "infra", "kernels", "engines", "server", "streams", "learners", "macaron")
_NAMED = re.compile(rf"`((?:{'|'.join(PACKAGES)})/[\w/]*\.py)`")


def modules(root: Path) -> set[str]:
    """Every module of the packages under ``root``; an ``__init__.py`` only when it holds more
    than a docstring (the package's own row names it otherwise)."""
    found = set()
    for package in PACKAGES:
        for path in (root / package).rglob("*.py"):
            if path.name == "__init__.py" and _only_docstring(path):
                continue
            found.add(path.relative_to(root).as_posix())
    return found


def _only_docstring(path: Path) -> bool:
    text = path.read_text().strip()
    return not text or (text.startswith('"""') and text.endswith('"""') and text.count('"""') == 2)


def unnamed_and_stale(root: Path, doc: str) -> tuple[list[str], list[str]]:
    """The modules ``doc`` does not name, and the paths it names that are no module."""
    named = set(_NAMED.findall(doc))
    present = modules(root)
    stale = {path for path in named if not (root / path).is_file()}
    return sorted(present - named), sorted(stale)


def test_the_architecture_doc_names_every_module() -> None:
    assert unnamed_and_stale(ROOT, DOC.read_text()) == ([], [])


def test_the_check_sees_a_missing_and_a_stale_module(tmp_path: Path) -> None:
    (tmp_path / "engines").mkdir()
    (tmp_path / "engines" / "__init__.py").write_text('"""The engines."""\n')
    (tmp_path / "engines" / "local.py").write_text("x = 1\n")
    (tmp_path / "engines" / "new.py").write_text("x = 1\n")
    doc = "| `engines/local.py` | the local engine |\n| `engines/gone.py` | removed |\n"
    assert unnamed_and_stale(tmp_path, doc) == (["engines/new.py"], ["engines/gone.py"])
