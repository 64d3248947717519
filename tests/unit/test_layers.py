"""Imports point down: ``core`` <- ``infra``, ``kernels`` <- ``engines`` <- ``server``,
``streams``, ``learners`` <- ``macaron`` (docs/architecture.md); the applications reach an engine
only through ``core.engine``'s port, wired by ``macaron``. An import that runs upward or sideways
fails here."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROJECT = ("core", "infra", "kernels", "engines", "server", "streams", "learners", "macaron")
MAY_IMPORT: dict[str, frozenset[str]] = {
    "core": frozenset(),
    "kernels": frozenset(),
    "infra": frozenset({"core"}),
    "engines": frozenset({"core", "infra", "kernels"}),
    "server": frozenset({"core", "infra"}),
    "streams": frozenset({"core", "infra"}),
    "learners": frozenset({"core", "infra"}),
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


def upward_imports(root: Path = ROOT) -> list[str]:
    bad = []
    for layer, allowed in MAY_IMPORT.items():
        for path in sorted((root / layer).rglob("*.py")):
            for line, package in imported_packages(path):
                if package != layer and package not in allowed:
                    bad.append(f"{path.relative_to(root)}:{line} imports {package}")
    return bad


def test_imports_point_down() -> None:
    assert upward_imports() == []


def test_the_check_sees_an_upward_import(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text(
        "import os\nfrom server.chat import x\n\ndef f():\n    import learners.loop\n"
    )
    assert imported_packages(module) == [(2, "server"), (5, "learners")]


def test_the_check_sees_a_layer_reaching_past_the_engine_port(tmp_path: Path) -> None:
    """Planted violations: an engine importing the server, and the server importing an engine
    (it must use ``core.engine``'s port)."""
    for layer, text in (
        ("engines", "from server.chat import ChatService\n"),
        ("server", "from engines.local.engine import LocalEngine\n"),
        ("learners", "import engines.grammar\n"),
    ):
        (tmp_path / layer).mkdir()
        (tmp_path / layer / "m.py").write_text(text)
    assert upward_imports(tmp_path) == [
        "engines/m.py:1 imports server",
        "server/m.py:1 imports engines",
        "learners/m.py:1 imports engines",
    ]


SQL_HOME = "infra"
"""The one package whose modules hold SQL; every other package calls its named functions."""
_SQL = re.compile(
    r"^\s*(SELECT\s.*?\bFROM\s|INSERT\s+INTO\s|UPDATE\s+\S+\s+SET\s|DELETE\s+FROM\s"
    r"|LOCK\s+TABLE\s|(CREATE|DROP|ALTER)\s+(UNIQUE\s+)?(TABLE|SCHEMA|INDEX|TRIGGER|VIEW)\s"
    r"|WITH\s+\w+\s+AS\s*\(|SET\s+(LOCAL\s+)?\w+\s+(TO|=)\s|TRUNCATE\s)",
    re.IGNORECASE | re.DOTALL,
)
"""The start of an SQL statement, shaped enough that prose ("set needs a key") is not one."""


def sql_statements(path: Path) -> list[int]:
    """The lines of string constants in ``path`` that are SQL statements (docstrings are not:
    they stand alone as expressions, so a sentence starting "Update ..." there is prose)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    docstrings = {
        id(node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
    }
    return sorted(
        {
            node.lineno
            for node in ast.walk(tree)
            if isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and id(node) not in docstrings
            and _SQL.match(node.value)
        }
    )


def sql_outside_infra() -> list[str]:
    return [
        f"{path.relative_to(ROOT)}:{line}"
        for package in PROJECT
        if package != SQL_HOME
        for path in sorted((ROOT / package).rglob("*.py"))
        for line in sql_statements(path)
    ]


def test_sql_lives_in_infra() -> None:
    assert sql_outside_infra() == []


def test_the_check_sees_sql_and_not_prose(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text(
        '"""Select what to train."""\n'
        "def f(conn):\n"
        '    """Update the runs."""\n'
        '    conn.execute("SELECT 1 FROM t")\n'
        '    conn.execute(\n        "update runs set a = 1 "\n        "WHERE b"\n    )\n'
        '    return f"DELETE FROM {conn}", "set needs key and value", "update: done"\n'
    )
    assert sql_statements(module) == [4, 6, 9]


SETTINGS_READERS = ("macaron",)
"""The one package that reads settings from the environment (the composition root); the model
lives in ``core/settings.py`` so that every layer can be typed against it."""


def settings_read(path: Path) -> list[int]:
    """The lines of ``path`` that build ``Settings`` from the environment: a call without
    arguments (with arguments, a caller builds it from values it was given)."""
    return [
        node.lineno
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path)))
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name | ast.Attribute)
        and (node.func.id if isinstance(node.func, ast.Name) else node.func.attr) == "Settings"
        and not node.args
        and not node.keywords
    ]


def test_only_the_composition_root_reads_settings() -> None:
    found = [
        f"{path.relative_to(ROOT)}:{line}"
        for package in PROJECT
        if package not in SETTINGS_READERS
        for path in sorted((ROOT / package).rglob("*.py"))
        for line in settings_read(path)
    ]
    assert found == []


def test_the_check_sees_settings_read_from_the_environment(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text(
        "from core import settings\na = settings.Settings()\nb = Settings(home=h)\nc = Settings()\n"
    )
    assert settings_read(module) == [2, 4]


RELEASE_LOADER = "infra/artifacts.py"
"""Where a release's adapters reach an engine (``load_release``): the engines themselves aside,
no other module asks an engine to load an adapter."""


def adapter_loads(path: Path) -> list[int]:
    """The lines of ``path`` that call some object's ``load_adapter``."""
    return [
        node.lineno
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path)))
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "load_adapter"
    ]


def adapter_loads_outside_the_loader(root: Path = ROOT) -> list[str]:
    return [
        f"{path.relative_to(root)}:{line}"
        for package in PROJECT
        if package != "engines"
        for path in sorted((root / package).rglob("*.py"))
        if path.relative_to(root).as_posix() != RELEASE_LOADER
        for line in adapter_loads(path)
    ]


def test_release_adapters_reach_an_engine_one_way() -> None:
    assert adapter_loads_outside_the_loader() == []


def test_the_check_sees_an_adapter_loaded_elsewhere(tmp_path: Path) -> None:
    for path, text in (
        ("server/m.py", "def f(engine, ref):\n    engine.load_adapter(ref.name, 'p')\n"),
        ("engines/m.py", "def f(self):\n    self.engine.load_adapter('a@1', 'p')\n"),
        (RELEASE_LOADER, "def f(engine):\n    engine.load_adapter('a@1', 'p')\n"),
    ):
        (tmp_path / path).parent.mkdir(exist_ok=True)
        (tmp_path / path).write_text(text)
    assert adapter_loads_outside_the_loader(tmp_path) == ["server/m.py:2"]


def module_imports(root: Path = ROOT) -> dict[str, set[str]]:
    """Each project module (dotted) and the project modules it imports, anywhere in it (a
    ``TYPE_CHECKING`` import too); ``from a import b`` is the module ``a.b`` when there is one."""
    paths = {
        ".".join(path.relative_to(root).with_suffix("").parts).removesuffix(".__init__"): path
        for package in PROJECT
        for path in (root / package).rglob("*.py")
    }
    graph: dict[str, set[str]] = {}
    for name, path in paths.items():
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                wanted = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                wanted = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
            else:
                continue
            for target in wanted:
                while target and target not in paths:
                    target = target.rpartition(".")[0]
                if target and target != name:
                    targets.add(target)
        graph[name] = targets
    return graph


def import_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The groups of modules that import each other, directly or round a circle (the strongly
    connected components of more than one module, by Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        for target in sorted(graph[module]):
            if target not in index:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in stack:
                low[module] = min(low[module], index[target])
        if low[module] == index[module]:
            group = [stack.pop()]
            while group[-1] != module:
                group.append(stack.pop())
            if len(group) > 1:
                circles.append(sorted(group))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return circles


def test_no_modules_import_each_other() -> None:
    assert import_circles(module_imports()) == []


def test_the_check_sees_an_import_circle(tmp_path: Path) -> None:
    (tmp_path / "core" / "events").mkdir(parents=True)
    (tmp_path / "core" / "events" / "__init__.py").write_text('"""Events."""\n')
    (tmp_path / "core" / "events" / "envelope.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
        "    from core.events.privacy import Cipher\n"
    )
    (tmp_path / "core" / "events" / "privacy.py").write_text(
        "from core.events.envelope import Envelope\n"
    )
    (tmp_path / "core" / "log.py").write_text("from core.events import envelope, privacy\n")
    graph = module_imports(tmp_path)
    assert graph["core.log"] == {"core.events", "core.events.envelope", "core.events.privacy"}
    assert import_circles(graph) == [["core.events.envelope", "core.events.privacy"]]


FRONT_ENDS = "server.entrypoints"
"""The chat server's front ends: they call the services of ``server/``, which never call
back into them (the turn service takes typed commands and streams typed items)."""


def front_end_imports(root: Path = ROOT) -> list[str]:
    """Each import of a front end by a module of ``server/`` outside the front ends."""
    front_ends = root / "server" / "entrypoints"
    found = {
        f"{path.relative_to(root)}:{line}"
        for path in (root / "server").rglob("*.py")
        if front_ends not in path.parents
        for line, name in _imported_names(path)
        if name == FRONT_ENDS or name.startswith(FRONT_ENDS + ".")
    }
    return sorted(found)


def _imported_names(path: Path) -> list[tuple[int, str]]:
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found += [(node.lineno, node.module)]
            found += [(node.lineno, f"{node.module}.{alias.name}") for alias in node.names]
    return found


def test_services_never_call_their_front_ends() -> None:
    assert front_end_imports() == []


def test_the_check_sees_a_service_importing_a_front_end(tmp_path: Path) -> None:
    (tmp_path / "server" / "entrypoints").mkdir(parents=True)
    (tmp_path / "server" / "turns").mkdir()
    (tmp_path / "server" / "entrypoints" / "ws.py").write_text("from server.chat import C\n")
    (tmp_path / "server" / "turns" / "feedback.py").write_text(
        "from server.entrypoints import protocol as wire\n"
    )
    (tmp_path / "server" / "chat.py").write_text("import server.entrypoints.app\n")
    assert front_end_imports(tmp_path) == ["server/chat.py:1", "server/turns/feedback.py:1"]
