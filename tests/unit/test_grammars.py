"""Output grammars: the bounds rule, the bounded GenUI and tool-call schemas, and the checks an
engine makes before it compiles a constraint."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
import xgrammar as xgr
from pydantic import ValidationError

from core.engine import GenerationChunk, GenerationRequest, OutputConstraint
from core.errors import ConstraintUnsupported, GrammarInvalid, GrammarUnbounded
from core.harness.actions import TOOLS, ToolCall
from core.harness.genui import catalogue_schema, validate_tree
from core.harness.grammars import (
    GENUI_MAX_ITEMS,
    genui_schema,
    tool_call_schema,
    unbounded_paths,
)
from server.engines.grammar import checked_schema
from server.engines.instant import InstantEngine, fixed_reply
from tests.grammar_check import CHARACTERS, in_grammar, written
from tests.unit.test_genui import full_tree


@pytest.mark.parametrize(
    ("schema", "where"),
    [
        ({"type": "array", "items": {"type": "integer"}}, "$: array without maxItems"),
        ({"type": "string"}, "$: string without maxLength"),
        (
            {"type": "object", "properties": {"a": {"type": ["string", "null"]}}},
            "$.a: string without maxLength",
        ),
        ({"type": "object", "additionalProperties": True}, "$: additionalProperties"),
        ({"type": "object", "properties": {"a": {}}}, "$.a: any value"),
        (
            {
                "$defs": {"n": {"type": "array", "maxItems": 2, "items": {"$ref": "#/$defs/n"}}},
                "$ref": "#/$defs/n",
            },
            "$[]: recursive $ref #/$defs/n",
        ),
        ({"anyOf": [{"type": "integer"}, {"type": "string"}]}, "$<anyOf 1>: string"),
    ],
)
def test_unbounded_schemas_name_the_place(schema: dict[str, Any], where: str) -> None:
    found = unbounded_paths(schema)
    assert any(f.startswith(where) for f in found), found


def test_bounded_schemas_pass() -> None:
    bounded = {
        "type": "object",
        "properties": {
            "kind": {"type": "string", "enum": ["a", "b"]},
            "tag": {"const": "x"},
            "id": {"type": "string", "pattern": "^[a-z]{1,8}$"},
            "tags": {"type": "array", "maxItems": 3, "items": {"type": "string", "maxLength": 5}},
            "n": {"type": "integer"},
        },
    }
    assert unbounded_paths(bounded) == []


def test_the_catalogue_itself_is_unbounded_and_its_grammar_is_not() -> None:
    assert any("recursive $ref" in f for f in unbounded_paths(catalogue_schema()))
    assert unbounded_paths(genui_schema()) == []
    assert unbounded_paths(tool_call_schema()) == []


def test_a_catalogue_tree_that_fits_the_bounds_is_in_the_genui_grammar() -> None:
    tree = validate_tree(full_tree()).tree
    assert tree is not None
    schema = genui_schema()
    assert in_grammar(schema, written(tree))
    assert in_grammar(schema, written({"type": "Text", "text": "hello"}))
    too_many = {"type": "List", "items": ["x"] * (GENUI_MAX_ITEMS + 1)}
    assert validate_tree(too_many).valid and not in_grammar(schema, written(too_many))
    cards_four_deep = {"type": "Card", "children": [{"type": "Card", "children": [full_tree()]}]}
    assert validate_tree(cards_four_deep).valid and not in_grammar(schema, written(cards_four_deep))
    assert not in_grammar(schema, written({"type": "Nope", "text": "x"}))


def test_every_tool_call_shape_is_in_the_tool_call_grammar() -> None:
    schema = tool_call_schema()
    calls = [
        {"tool": "calculator", "args": {"expression": "2 + 3 * 4"}},
        {"tool": "notes", "args": {"op": "set", "key": "milk", "value": "2 litres"}},
        {"tool": "notes", "args": {"op": "list"}},
        {"tool": "todo", "args": {"op": "complete", "id": 3}},
        {"tool": "clock", "args": {}},
    ]
    for call in calls:
        ToolCall.model_validate(call)
        assert in_grammar(schema, written(call)), call
    assert {t.name for t in TOOLS} == {c["tool"] for c in calls}
    assert not in_grammar(schema, written({"tool": "shell", "args": {}}))
    assert not in_grammar(schema, written({"tool": "notes", "args": {"op": "burn"}}))


def test_a_constraint_names_a_schema_exactly_when_its_kind_needs_one() -> None:
    with pytest.raises(ValidationError):
        OutputConstraint(kind="json_schema")
    with pytest.raises(ValidationError):
        OutputConstraint(kind="json", json_schema={"type": "integer"})
    assert checked_schema(OutputConstraint(kind="json")) == "{}"


@pytest.mark.parametrize(
    "schema",
    [{"type": "foo"}, {"$ref": "#/$defs/missing"}, {"type": "object", "required": 3}],
)
def test_a_schema_that_does_not_compile_is_grammar_invalid(schema: dict[str, Any]) -> None:
    with pytest.raises(GrammarInvalid) as refused:
        checked_schema(OutputConstraint(kind="json_schema", json_schema=schema))
    assert refused.value.code == "grammar_invalid"


def test_an_unbounded_schema_is_grammar_unbounded() -> None:
    schema = {"type": "object", "properties": {"tags": {"type": "array"}}}
    with pytest.raises(GrammarUnbounded, match=r"\$\.tags: array without maxItems") as refused:
        checked_schema(OutputConstraint(kind="json_schema", json_schema=schema))
    assert refused.value.code == "grammar_unbounded"


def test_an_engine_that_cannot_constrain_says_so() -> None:
    engine = InstantEngine(fixed_reply("not json"))
    request = GenerationRequest(
        request_id="r",
        prompt=engine.chat_prompt([{"role": "user", "content": "hi"}]),
        constraint=OutputConstraint(kind="json"),
    )

    async def first() -> GenerationChunk:
        return await anext(engine.generate(request))

    with pytest.raises(ConstraintUnsupported) as refused:
        asyncio.run(first())
    assert refused.value.code == "constraint_unsupported"


def test_a_bounded_string_never_holds_a_raw_control_character() -> None:
    """xgrammar 0.2.8 alone lets a ``maxLength`` string hold one; the checked schema does not."""
    raw = {"type": "string", "maxLength": 5}
    checked = checked_schema(OutputConstraint(kind="json_schema", json_schema=raw))
    info = xgr.TokenizerInfo([*CHARACTERS, "\x10"], stop_token_ids=[len(CHARACTERS) - 1])
    compiler = xgr.GrammarCompiler(info, cache_enabled=False)
    for schema, allowed in ((json.dumps(raw), True), (checked, False)):
        matcher = xgr.GrammarMatcher(compiler.compile_json_schema(schema, any_whitespace=False))
        assert matcher.accept_string('"a\x10b"') is allowed
    matcher = xgr.GrammarMatcher(compiler.compile_json_schema(checked, any_whitespace=False))
    assert matcher.accept_string('"abcde"') and not matcher.accept_string("f")
