"""Output grammars: the bounds rule, the bounded GenUI and tool-call schemas, and the checks an
engine makes before it compiles a constraint."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
import xgrammar as xgr
from pydantic import JsonValue, ValidationError

from core.conversation import empty_tool_state
from core.engine import GenerationChunk, GenerationRequest, OutputConstraint
from core.errors import ConstraintUnsupported, GrammarInvalid, GrammarUnbounded
from core.harness.actions import NOTES_OPS, TODO_OPS, TOOLS, ToolCall, ToolState, execute
from core.harness.artifact import HarnessSpec, root_harness
from core.harness.genui import catalogue_schema, validate_tree
from core.harness.grammars import (
    ARGS_MAX_TEXT,
    GENUI_MAX_ITEMS,
    call_kinds,
    decoded_tool,
    genui_schema,
    held_to,
    output_constraint,
    tool_call_schema,
    unbounded_paths,
)
from engines.grammar import checked
from engines.instant import InstantEngine, fixed_reply
from tests.grammar_check import CHARACTERS, in_grammar, written
from tests.unit.test_actions import NOW, error_code
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
        ({"type": "number", "minimum": 0}, "$: number without minimum and maximum"),
        ({"type": "array", "maxItems": 2, "items": {"type": "integer"}}, "$[]: number without"),
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
            "n": {"type": "integer", "minimum": 0, "maximum": 99},
            "level": {"enum": [1, 2, 3]},
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
    long_id = {"type": "Text", "id": "a" * 30, "text": "x"}  # ids: 24 characters at most
    assert validate_tree(long_id).valid and not in_grammar(schema, written(long_id))
    assert in_grammar(schema, written({**long_id, "id": "a" * 24}))


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


def test_a_decoded_call_of_a_built_in_tool_takes_what_the_tool_takes_and_nothing_else() -> None:
    """The tools' own schemas leave op-specific arguments and the calculator's syntax to the
    tools; the decoder's grammar says them: a decoded call's arguments validate."""
    schema = tool_call_schema([decoded_tool(tool) for tool in TOOLS])
    given: dict[str, JsonValue] = {"key": "milk", "value": "2 litres", "text": "call Ann", "id": 1}
    state = execute(ToolCall(tool="todo", args={"op": "add", "text": "x"}), empty_tool_state(), NOW)
    for tool, ops in (("notes", NOTES_OPS), ("todo", TODO_OPS)):
        for op, needs in ops.items():
            args: dict[str, JsonValue] = {"op": op, **{name: given[name] for name in needs}}
            call: dict[str, Any] = {"tool": tool, "args": args}
            assert in_grammar(schema, written(call)), call
            before: ToolState = {**empty_tool_state(), **state.state_delta, "notes": {"milk": "1"}}
            assert execute(ToolCall.model_validate(call), before, NOW).ok, call
            for name in needs:  # each argument it needs, left out
                short = {"tool": tool, "args": {k: v for k, v in args.items() if k != name}}
                assert not in_grammar(schema, written(short)), short
                assert _refused_args(short)
            for name in set(given) - set(needs):  # an argument it does not take, added
                extra = {"tool": tool, "args": {**args, name: given[name]}}
                assert not in_grammar(schema, written(extra)) and _refused_args(extra), extra

    def calculator(expression: str) -> str:
        return written({"tool": "calculator", "args": {"expression": expression}})

    for expression in ("250 - 19", "2**10", "(3+4)*-2", "7 // 2 % 3", "0.5/4"):
        assert in_grammar(schema, calculator(expression)), expression
    for expression in ("two plus two", "sum(1, 2)", "1e3", "", "1+" * ARGS_MAX_TEXT):
        assert not in_grammar(schema, calculator(expression)), expression
    assert tool_call_schema() != schema  # what the model is told (harness@0) did not change


def test_a_sweep_holds_the_decoder_to_one_kind_of_call_at_a_time() -> None:
    """``call_kinds`` names every call of the tools (a tool, or each op of a tool with ops);
    ``held_to`` one of them lets the decoder write that call and no other, while the tools
    themselves (what the model is told) are left as they were."""
    kinds = call_kinds(TOOLS)
    ops = [f"notes.{op}" for op in NOTES_OPS] + [f"todo.{op}" for op in TODO_OPS]
    assert sorted(kinds) == sorted(["calculator", "clock", *ops])
    calls: dict[str, dict[str, Any]] = {
        "calculator": {"tool": "calculator", "args": {"expression": "6*7"}},
        "clock": {"tool": "clock", "args": {}},
        "notes.set": {"tool": "notes", "args": {"op": "set", "key": "a", "value": "b"}},
        "notes.get": {"tool": "notes", "args": {"op": "get", "key": "a"}},
        "notes.delete": {"tool": "notes", "args": {"op": "delete", "key": "a"}},
        "notes.list": {"tool": "notes", "args": {"op": "list"}},
        "todo.add": {"tool": "todo", "args": {"op": "add", "text": "a"}},
        "todo.list": {"tool": "todo", "args": {"op": "list"}},
        "todo.complete": {"tool": "todo", "args": {"op": "complete", "id": 1}},
    }
    assert set(calls) == set(kinds)
    for kind in kinds:
        held = held_to(TOOLS, kind)
        schema = tool_call_schema([decoded_tool(tool) for tool in held])
        assert not unbounded_paths(schema)
        allowed = {k for k, call in calls.items() if in_grammar(schema, written(call))}
        assert allowed == {kind}, kind
    assert [tool.name for tool in TOOLS] == ["calculator", "notes", "todo", "clock"]
    assert held_to(TOOLS, "notes.get")[0].parameters != TOOLS[1].parameters
    assert call_kinds(TOOLS) == kinds  # the originals were not changed by holding


def _refused_args(call: dict[str, Any]) -> bool:
    outcome = execute(ToolCall.model_validate(call), empty_tool_state(), NOW)
    return error_code(outcome) == "invalid_args"


def test_a_constraint_names_a_schema_exactly_when_its_kind_needs_one() -> None:
    with pytest.raises(ValidationError):
        OutputConstraint(kind="json_schema")
    with pytest.raises(ValidationError):
        OutputConstraint(kind="json", json_schema={"type": "integer"})
    assert checked(OutputConstraint(kind="json")).schema == "{}"


@pytest.mark.parametrize(
    "schema",
    [{"type": "foo"}, {"$ref": "#/$defs/missing"}, {"type": "object", "required": 3}],
)
def test_a_schema_that_does_not_compile_is_grammar_invalid(schema: dict[str, Any]) -> None:
    with pytest.raises(GrammarInvalid) as refused:
        checked(OutputConstraint(kind="json_schema", json_schema=schema))
    assert refused.value.code == "grammar_invalid"


def test_an_unbounded_schema_is_grammar_unbounded() -> None:
    schema = {"type": "object", "properties": {"tags": {"type": "array"}}}
    with pytest.raises(GrammarUnbounded, match=r"\$\.tags: array without maxItems") as refused:
        checked(OutputConstraint(kind="json_schema", json_schema=schema))
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
    bounded = checked(OutputConstraint(kind="json_schema", json_schema=raw)).schema
    info = xgr.TokenizerInfo([*CHARACTERS, "\x10"], stop_token_ids=[len(CHARACTERS) - 1])
    compiler = xgr.GrammarCompiler(info, cache_enabled=False)
    for schema, allowed in ((json.dumps(raw), True), (bounded, False)):
        matcher = xgr.GrammarMatcher(compiler.compile_json_schema(schema, any_whitespace=False))
        assert matcher.accept_string('"a\x10b"') is allowed
    matcher = xgr.GrammarMatcher(compiler.compile_json_schema(bounded, any_whitespace=False))
    assert matcher.accept_string('"abcde"') and not matcher.accept_string("f")


def _matcher(constraint: OutputConstraint) -> xgr.GrammarMatcher:
    info = xgr.TokenizerInfo(CHARACTERS, stop_token_ids=[len(CHARACTERS) - 1])
    compiler = xgr.GrammarCompiler(info, cache_enabled=False)
    return xgr.GrammarMatcher(compiler.compile_grammar(checked(constraint).grammar()))


def _ends(matcher: xgr.GrammarMatcher, text: str) -> bool:
    """Whether ``text`` is a whole answer: accepted, then the stop token is too."""
    return matcher.accept_string(text) and matcher.accept_token(len(CHARACTERS) - 1)


def test_an_agent_may_answer_in_text_or_with_a_well_formed_call_and_nothing_else() -> None:
    constraint = OutputConstraint(kind="json_schema", json_schema=tool_call_schema(), or_text=True)
    assert _ends(_matcher(constraint), "It is {probably} 3 o'clock.")
    assert _ends(_matcher(constraint), written({"tool": "clock", "args": {}}))
    for refused in ('{"tool": "shell"', '{"oops"', " leading space", "\nnewline first"):
        assert not _matcher(constraint).accept_string(refused), refused
    assert not _ends(_matcher(constraint), '{"tool":"clock"')  # a started call must finish
    after_call = _matcher(constraint)
    assert after_call.accept_string(written({"tool": "clock", "args": {}}))
    assert not after_call.accept_string(" and more")
    assert not _ends(_matcher(constraint), "")


def test_a_harness_enforces_the_grammar_of_the_outputs_it_names() -> None:
    root = root_harness()
    assert all(output_constraint(root, name) is None for name in root.specialists)

    def enforcing(name: str) -> HarnessSpec:
        own = root.specialists[name].model_copy(update={"enforce_grammar": True})
        return root.model_copy(update={"specialists": {**root.specialists, name: own}})

    assert output_constraint(enforcing("chat"), "chat") is None  # text: nothing to enforce
    genui = output_constraint(enforcing("genui"), "genui")
    assert genui is not None and not genui.or_text and genui.json_schema == genui_schema()
    agent = output_constraint(enforcing("agent"), "agent")
    assert agent is not None and agent.or_text
    assert agent.json_schema == tool_call_schema([decoded_tool(tool) for tool in root.tools])
    assert output_constraint(enforcing("agent"), "genui") is None
    own = root.specialists["agent"].model_copy(
        update={"enforce_grammar": True, "tool_choice": "required"}
    )
    required = root.model_copy(update={"specialists": {**root.specialists, "agent": own}})
    first = output_constraint(required, "agent")
    assert first is not None and not first.or_text  # a call, nothing else
    assert output_constraint(required, "agent", first_step=False) == agent  # then text or a call
