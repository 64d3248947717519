"""Output grammars as JSON Schemas a decoder can enforce, and the bounds rule they must pass.

A constrained answer has to end within its token budget, so every enforced schema is *bounded*:
every array has ``maxItems``, every string that is not an ``enum``, a ``const`` or a
``pattern`` (which must bound its own length) has ``maxLength``, every number has ``minimum`` and
``maximum`` (xgrammar then bounds its digits, and a number's fraction to 6 digits), no value is
left free (``{}``, ``true``, ``additionalProperties`` other than ``false``), and no ``$ref`` is
recursive.
``genui_schema`` and ``tool_call_schema`` build bounded schemas from the GenUI catalogue and the
tool specs; ``unbounded_paths`` is the rule's check; ``output_constraint`` is what a harness
enforces on a specialist's answers.
"""

from __future__ import annotations

import copy
import functools
import json
from collections.abc import Sequence
from typing import Any

from core.engine import OutputConstraint
from core.harness.actions import EXPRESSION_CHARACTERS, NOTES_OPS, TODO_OPS, TOOLS, ToolSpec
from core.harness.artifact import HarnessSpec, OutputKind
from core.harness.genui import ID_PATTERN, catalogue_schema

GENUI_DEPTH = 2
"""Cards nested at most this deep in a constrained GenUI tree (a root Card is depth 1)."""
GENUI_MAX_ITEMS = 6
"""Children, list items, options, columns, rows, labels and series per component."""
GENUI_MAX_TEXT = 40
"""Characters per string in a constrained GenUI tree (xgrammar's compile time grows fast with
``maxLength``: a small answer's strings stay short)."""
GENUI_ID = r"^[A-Za-z][A-Za-z0-9_-]{0,23}$"
"""Component ids in a constrained tree: at most 24 characters (the catalogue allows 64; a long
id spent a small answer's budget before its tree was complete)."""
ARGS_MAX_TEXT = 40
"""Characters per string argument of a constrained tool call."""
EXPRESSION_PATTERN = rf"^[{EXPRESSION_CHARACTERS}]{{1,{ARGS_MAX_TEXT}}}$"
"""A constrained ``calculator`` expression: arithmetic, at most ``ARGS_MAX_TEXT`` characters."""
NUMBER_LIMIT = 10**6
"""The range a number in a constrained answer keeps where its schema names none (a random
model wrote a todo id of 60 digits and ran out of tokens)."""

_DROPPED = frozenset(("title", "description", "default", "discriminator", "$schema"))
_KEYWORDS_WITH_SCHEMAS = ("properties", "$defs", "definitions", "patternProperties")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")


def unbounded_paths(schema: Any) -> list[str]:
    """Where ``schema`` lets output grow without bound (empty: it is bounded), as readable paths
    (``$.children[].text: string without maxLength``)."""
    found: list[str] = []
    _walk(schema, "$", schema, frozenset(), found)
    return found


def _walk(node: Any, path: str, root: Any, refs: frozenset[str], found: list[str]) -> None:
    if node is True or node == {}:
        found.append(f"{path}: any value")
        return
    if not isinstance(node, dict):
        return
    ref = node.get("$ref")
    if isinstance(ref, str):
        if ref in refs:
            found.append(f"{path}: recursive $ref {ref}")
            return
        _walk(_resolve(root, ref), path, root, refs | {ref}, found)
    if "enum" in node or "const" in node:
        return
    types = node.get("type")
    kinds = set(types) if isinstance(types, list) else {types} if isinstance(types, str) else set()
    if "string" in kinds and "maxLength" not in node and "pattern" not in node:
        found.append(f"{path}: string without maxLength")
    if "array" in kinds and "maxItems" not in node:
        found.append(f"{path}: array without maxItems")
    if kinds & {"integer", "number"} and not ({"minimum", "maximum"} <= node.keys()):
        found.append(f"{path}: number without minimum and maximum")
    extra = node.get("additionalProperties", False)
    if "object" in kinds and extra is not False:
        found.append(f"{path}: additionalProperties other than false")
    for key, sub in (node.get("properties") or {}).items():
        _walk(sub, f"{path}.{key}", root, refs, found)
    if isinstance(node.get("items"), dict):
        _walk(node["items"], f"{path}[]", root, refs, found)
    for keyword in _SCHEMA_LISTS:
        for index, sub in enumerate(node.get(keyword) or ()):
            _walk(sub, f"{path}<{keyword} {index}>", root, refs, found)


def _resolve(root: Any, ref: str) -> Any:
    """The local target of ``ref`` (``#/$defs/Card``), or ``None`` when it points elsewhere."""
    if not ref.startswith("#"):
        return None
    target = root
    for part in ref[1:].split("/")[1:]:
        if not isinstance(target, dict):
            return None
        target = target.get(part.replace("~1", "/").replace("~0", "~"))
    return target


def genui_schema() -> dict[str, Any]:
    """The GenUI catalogue as a bounded schema: Cards unrolled to ``GENUI_DEPTH`` levels (a
    Card at the last level has no Card children), arrays, strings and ids cut short."""
    catalogue = catalogue_schema()
    leaves = {
        name: _bounded(spec, GENUI_MAX_ITEMS, GENUI_MAX_TEXT)
        for name, spec in catalogue["$defs"].items()
        if name != "Card"
    }
    defs: dict[str, Any] = dict(leaves)
    card = _bounded(catalogue["$defs"]["Card"], GENUI_MAX_ITEMS, GENUI_MAX_TEXT)
    components = [name for name in _one_of_names(catalogue) if name != "Card"]
    for level in range(GENUI_DEPTH, 0, -1):
        deeper = components if level == GENUI_DEPTH else [f"Card{level + 1}", *components]
        level_card = copy.deepcopy(card)
        level_card["properties"]["children"]["items"] = _refs(deeper)
        defs[f"Card{level}"] = level_card
    return {"$defs": _short_ids(defs), **_refs(["Card1", *components])}


def _short_ids(node: Any) -> Any:
    """``node`` with every component id pattern of the catalogue replaced by ``GENUI_ID``."""
    if isinstance(node, list):
        return [_short_ids(item) for item in node]
    if not isinstance(node, dict):
        return node
    return {
        key: GENUI_ID if key == "pattern" and value == ID_PATTERN else _short_ids(value)
        for key, value in node.items()
    }


def _one_of_names(catalogue: dict[str, Any]) -> list[str]:
    return [str(entry["$ref"]).rsplit("/", 1)[-1] for entry in catalogue["oneOf"]]


def _refs(names: Sequence[str]) -> dict[str, Any]:
    return {"anyOf": [{"$ref": f"#/$defs/{name}"} for name in names]}


def tool_call_schema(tools: Sequence[ToolSpec] = TOOLS) -> dict[str, Any]:
    """One call of one of ``tools``: ``{"tool": <its name>, "args": <its parameters>}``, the
    arguments bounded like any enforced schema."""
    calls = [
        {
            "type": "object",
            "properties": {
                "tool": {"const": tool.name},
                "args": _bounded(dict(tool.parameters), GENUI_MAX_ITEMS, ARGS_MAX_TEXT),
            },
            "required": ["tool", "args"],
            "additionalProperties": False,
        }
        for tool in tools
    ]
    return {"anyOf": calls}


def decoded_tool(tool: ToolSpec) -> ToolSpec:
    """``tool`` with the arguments a decoder enforces when it is a built-in tool: each op of
    ``notes`` and ``todo`` with exactly the arguments it needs, a ``calculator`` expression in
    the characters of arithmetic (``EXPRESSION_PATTERN``). The tool's own schema (what the model
    is told, covered by the harness's address) leaves those rules to the tool's validation, and
    a base model, sampled, wrote prose as an expression or a note without its key in most of
    its calls; under the decoder, every call's arguments validate. Other tools are unchanged."""
    properties: Any = tool.parameters.get("properties")
    ops = {"notes": NOTES_OPS, "todo": TODO_OPS}.get(tool.name)
    if not isinstance(properties, dict) or (ops is None and tool.name != "calculator"):
        return tool
    if ops is not None:
        named = _ops(tool) or list(ops)
        parameters: dict[str, Any] = {
            "anyOf": [_op_call(op, needs, properties) for op, needs in ops.items() if op in named]
        }
    else:
        expression = {"type": "string", "pattern": EXPRESSION_PATTERN}
        parameters = {**tool.parameters, "properties": {**properties, "expression": expression}}
    return tool.model_copy(update={"parameters": parameters})


def _ops(tool: ToolSpec) -> list[str]:
    """The ops ``tool``'s ``op`` argument names (its ``enum``), or none; of a built-in tool,
    only those it runs (the decoder has a branch for those alone)."""
    properties: Any = tool.parameters.get("properties")
    op: Any = properties.get("op") if isinstance(properties, dict) else None
    named = op.get("enum") if isinstance(op, dict) else None
    known = {"notes": NOTES_OPS, "todo": TODO_OPS}.get(tool.name)
    listed = [str(value) for value in named] if isinstance(named, list) else []
    return [op for op in listed if known is None or op in known]


def call_kinds(tools: Sequence[ToolSpec]) -> list[str]:
    """Every kind of call of ``tools``, in their order: a tool's name, or ``tool.op`` for each
    op its ``op`` argument names (``notes.set``, ``notes.get``, ...)."""
    return [kind for t in tools for kind in ([f"{t.name}.{op}" for op in _ops(t)] or [t.name])]


def held_to(tools: Sequence[ToolSpec], kind: str) -> tuple[ToolSpec, ...]:
    """``tools`` cut to the one call ``kind`` names (of ``call_kinds``): that tool alone and, for
    ``tool.op``, its ``op`` argument cut to that op (``decoded_tool`` decodes only its
    branch)."""
    name, _, op = kind.partition(".")
    held = [tool for tool in tools if tool.name == name]
    if not op:
        return tuple(held)
    cut = []
    for tool in held:
        properties: Any = dict(tool.parameters["properties"])  # type: ignore[arg-type]
        properties["op"] = {**properties["op"], "enum": [op]}
        parameters = {**tool.parameters, "properties": properties}
        cut.append(tool.model_copy(update={"parameters": parameters}))
    return tuple(cut)


def _op_call(op: str, needs: Sequence[str], properties: dict[str, Any]) -> dict[str, Any]:
    fields = {name: _not_null(schema) for name, schema in properties.items() if name in needs}
    return {
        "type": "object",
        "properties": {"op": {"const": op}, **fields},
        "required": ["op", *fields],
        "additionalProperties": False,
    }


def _not_null(schema: Any) -> Any:
    """An optional argument's schema without its ``null`` branch (the op that takes it needs
    it)."""
    branches = schema.get("anyOf") if isinstance(schema, dict) else None
    kept = [branch for branch in branches or () if branch != {"type": "null"}]
    return kept[0] if len(kept) == 1 else schema


def _bounded(node: Any, max_items: int, max_text: int) -> Any:
    """A copy of ``node`` with every array at most ``max_items`` long, every free string at
    most ``max_text`` characters, every number within ``NUMBER_LIMIT`` unless its schema
    bounds it, the keywords that only describe dropped, and ``oneOf`` as
    ``anyOf`` (the catalogue's and the calls' branches differ by a constant; xgrammar cannot
    prove that and warns)."""
    if isinstance(node, list):
        return [_bounded(item, max_items, max_text) for item in node]
    if not isinstance(node, dict):
        return node
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key in _DROPPED:
            continue
        if key in _KEYWORDS_WITH_SCHEMAS and isinstance(value, dict):
            out[key] = {k: _bounded(v, max_items, max_text) for k, v in value.items()}
        elif key == "oneOf" and "anyOf" not in node:
            out["anyOf"] = _bounded(value, max_items, max_text)
        else:
            out[key] = _bounded(value, max_items, max_text)
    kinds = out.get("type")
    kinds = set(kinds) if isinstance(kinds, list) else {kinds}
    if "array" in kinds:
        out["maxItems"] = min(int(out.get("maxItems", max_items)), max_items)
        out["minItems"] = min(int(out.get("minItems", 0)), out["maxItems"])
    if "string" in kinds and not {"enum", "const", "pattern"} & out.keys():
        out["maxLength"] = min(int(out.get("maxLength", max_text)), max_text)
    if kinds & {"integer", "number"} and not {"enum", "const"} & out.keys():
        out.setdefault("minimum", -NUMBER_LIMIT)
        out.setdefault("maximum", NUMBER_LIMIT)
    return out


def output_constraint(
    harness: HarnessSpec, specialist: str, *, first_step: bool = True
) -> OutputConstraint | None:
    """What ``harness`` enforces while decoding a step of ``specialist``'s answer: ``None``
    unless its grammar is enforced and the step may be a tool call or a GenUI tree; text beside
    those is allowed as ``or_text``, except on a turn's first step when the specialist's
    ``tool_choice`` is ``required`` (a tool call, nothing else). Built once per output kinds
    and tools."""
    spec = harness.for_specialist(specialist)
    kinds = set(spec.output)
    if first_step and spec.tool_choice == "required":
        kinds = {"tool_call"}
    if not spec.enforce_grammar or kinds == {"text"}:
        return None
    tools = json.dumps([tool.model_dump(mode="json") for tool in harness.tools])  # keys in order
    return _constraint(tuple(sorted(kinds)), tools)


@functools.lru_cache(maxsize=32)
def _constraint(kinds: tuple[OutputKind, ...], tools: str) -> OutputConstraint:
    anyof: list[Any] = []
    defs: dict[str, Any] = {}
    if "genui" in kinds:
        genui = genui_schema()
        defs, anyof = genui["$defs"], genui["anyOf"]
    if "tool_call" in kinds:
        specs = tuple(decoded_tool(ToolSpec.model_validate(tool)) for tool in json.loads(tools))
        anyof = [*anyof, *tool_call_schema(specs)["anyOf"]]
    schema = {"$defs": defs, "anyOf": anyof} if defs else {"anyOf": anyof}
    return OutputConstraint(kind="json_schema", json_schema=schema, or_text="text" in kinds)
