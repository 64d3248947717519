"""Harness tools and their replayable state: each tool's behaviour and limits, error results for
bad model output, RFC 7386 merge patches, and the replay property (deltas rebuild the state, and
re-executing the recorded calls reproduces every result and delta)."""

from __future__ import annotations

import random
from dataclasses import replace
from datetime import UTC, datetime, timedelta, timezone

import pytest
from pydantic import JsonValue

from core.conversation import empty_tool_state
from core.harness.actions import (
    MAX_NOTES,
    MAX_TODOS,
    TOOLS,
    ActionOutcome,
    ToolCall,
    ToolState,
    execute,
    replay,
    verify_replay,
)
from core.merge_patch import apply_merge_patch, merge_patch_diff

NOW = datetime(2025, 3, 4, 5, 6, 7, tzinfo=UTC)


def run(tool: str, state: ToolState | None = None, **args: JsonValue) -> ActionOutcome:
    return execute(
        ToolCall(tool=tool, args=args), empty_tool_state() if state is None else state, NOW
    )


def run_all(calls: list[tuple[str, dict[str, JsonValue]]]) -> tuple[ToolState, ActionOutcome]:
    """Execute calls in order, applying each delta; the final state and the last outcome."""
    state = empty_tool_state()
    outcome = None
    for tool, args in calls:
        outcome = execute(ToolCall(tool=tool, args=args), state, NOW)
        state = apply_merge_patch(state, outcome.state_delta)
    assert outcome is not None
    return state, outcome


def calc(expression: str) -> JsonValue:
    outcome = run("calculator", expression=expression)
    assert outcome.ok, outcome.result
    assert outcome.state_delta == {}
    assert isinstance(outcome.result, dict)
    return outcome.result["value"]


def error_code(outcome: ActionOutcome) -> JsonValue:
    assert not outcome.ok
    assert outcome.state_delta == {}
    assert isinstance(outcome.result, dict)
    error = outcome.result["error"]
    assert isinstance(error, dict)
    assert isinstance(error["message"], str)
    assert error["message"]
    return error["code"]


# --- calculator -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("expression", "value"),
    [
        ("1 + 2 * 3", 7),
        ("(1 + 2) * 3", 9),
        ("2 ** 3 ** 2", 512),
        ("-2 ** 2", -4),
        ("(-2) ** 2", 4),
        ("--3", 3),
        ("7 / 2", 3.5),
        ("7 // 2", 3),
        ("-7 // 2", -4),
        ("7 % 3", 1),
        ("-7 % 3", 2),
        ("1.5 * 4", 6.0),
        ("2 ** -1", 0.5),
        ("10 - 4 - 3", 3),
        ("  (3)  ", 3),
        ("2 ** 100", 2**100),
    ],
)
def test_calculator_follows_python_arithmetic(expression: str, value: float) -> None:
    result = calc(expression)
    assert result == value
    assert type(result) is type(value)


@pytest.mark.parametrize(
    ("expression", "code"),
    [
        ("1 / 0", "division_by_zero"),
        ("1 // 0", "division_by_zero"),
        ("1 % 0", "division_by_zero"),
        ("0 ** -1", "division_by_zero"),
        ("2 ** 10000", "exponent_too_large"),
        ("2 ** -101", "exponent_too_large"),
        ("10 ** 100 * 10", "result_too_large"),
        ("1e101", "result_too_large"),
        ("1e100 ** 2.0", "result_too_large"),
        ("(-8) ** 0.5", "invalid_expression"),
        ("__import__('os')", "invalid_expression"),
        ("a", "invalid_expression"),
        ("(1).real", "invalid_expression"),
        ("'ab' * 2", "invalid_expression"),
        ("True + 1", "invalid_expression"),
        ("1j", "invalid_expression"),
        ("~1", "invalid_expression"),
        ("1 < 2", "invalid_expression"),
        ("[1, 2]", "invalid_expression"),
        ("1 +", "invalid_expression"),
        ("x = 1", "invalid_expression"),
        ("1\x00", "invalid_expression"),
    ],
)
def test_calculator_refuses_with_an_error_result(expression: str, code: str) -> None:
    assert error_code(run("calculator", expression=expression)) == code


def test_calculator_limits_expression_length() -> None:
    assert calc("1+" * 99 + "1") == 100
    assert error_code(run("calculator", expression="1+" * 100 + "1")) == "invalid_args"


# --- notes, todo, clock ---------------------------------------------------------------------


def test_notes_set_get_delete_list() -> None:
    set_a = run("notes", op="set", key="a", value="apple")
    assert set_a.ok
    assert set_a.result == {"key": "a", "value": "apple"}
    assert set_a.state_delta == {"notes": {"a": "apple"}}
    state = apply_merge_patch(empty_tool_state(), set_a.state_delta)
    state = apply_merge_patch(state, run("notes", state, op="set", key="b", value="").state_delta)

    assert run("notes", state, op="get", key="a").result == {"key": "a", "value": "apple"}
    assert run("notes", state, op="list").result == {"keys": ["a", "b"]}

    overwrite = run("notes", state, op="set", key="a", value="apricot")
    assert overwrite.state_delta == {"notes": {"a": "apricot"}}
    unchanged = run("notes", state, op="set", key="a", value="apple")
    assert unchanged.ok
    assert unchanged.state_delta == {}

    delete = run("notes", state, op="delete", key="a")
    assert delete.result == {"key": "a", "deleted": True}
    assert delete.state_delta == {"notes": {"a": None}}
    state = apply_merge_patch(state, delete.state_delta)
    assert state["notes"] == {"b": ""}
    assert error_code(run("notes", state, op="get", key="a")) == "note_not_found"
    assert error_code(run("notes", state, op="delete", key="a")) == "note_not_found"


def test_notes_are_limited_in_number() -> None:
    state = empty_tool_state()
    state["notes"] = {f"k{i}": "v" for i in range(MAX_NOTES)}
    assert error_code(run("notes", state, op="set", key="new", value="v")) == "too_many_notes"
    assert run("notes", state, op="set", key="k0", value="w").ok


def test_todo_add_list_complete() -> None:
    add = run("todo", op="add", text="buy milk")
    assert add.result == {"id": 1, "text": "buy milk", "done": False}
    assert add.state_delta == {"todos": {"1": {"text": "buy milk", "done": False}}, "next_todo": 2}

    state, second = run_all(
        [("todo", {"op": "add", "text": "buy milk"}), ("todo", {"op": "add", "text": "call"})]
    )
    assert second.result == {"id": 2, "text": "call", "done": False}

    complete = run("todo", state, op="complete", id=2)
    assert complete.result == {"id": 2, "text": "call", "done": True}
    assert complete.state_delta == {"todos": {"2": {"done": True}}}
    state = apply_merge_patch(state, complete.state_delta)

    assert run("todo", state, op="list").result == {
        "todos": [
            {"id": 1, "text": "buy milk", "done": False},
            {"id": 2, "text": "call", "done": True},
        ]
    }
    assert error_code(run("todo", state, op="complete", id=3)) == "todo_not_found"


def test_todos_are_limited_in_number() -> None:
    state = empty_tool_state()
    state["todos"] = {str(i): {"text": "t", "done": False} for i in range(1, MAX_TODOS + 1)}
    state["next_todo"] = MAX_TODOS + 1
    assert error_code(run("todo", state, op="add", text="one more")) == "too_many_todos"


def test_clock_reports_the_given_time_in_utc() -> None:
    assert run("clock").result == {"now": "2025-03-04T05:06:07+00:00"}
    plus_two = timezone(timedelta(hours=2))
    elsewhere = execute(ToolCall(tool="clock"), empty_tool_state(), NOW.astimezone(plus_two))
    assert elsewhere.result == {"now": "2025-03-04T05:06:07+00:00"}
    assert elsewhere.state_delta == {}


def test_execute_needs_an_aware_time() -> None:
    with pytest.raises(ValueError, match="timezone-aware"):
        execute(ToolCall(tool="clock"), empty_tool_state(), datetime(2025, 1, 1))


# --- bad model output -----------------------------------------------------------------------


def test_unknown_tool_is_an_error_result() -> None:
    outcome = run("shell", command="rm -rf /")
    assert error_code(outcome) == "unknown_tool"
    assert outcome.name == "shell"
    assert outcome.args == {"command": "rm -rf /"}


@pytest.mark.parametrize(
    ("tool", "args"),
    [
        ("calculator", {}),
        ("calculator", {"expression": 12}),
        ("calculator", {"expression": "1", "extra": True}),
        ("notes", {"op": "rename", "key": "a"}),
        ("notes", {"op": "get"}),
        ("notes", {"op": "set", "key": "a"}),
        ("notes", {"op": "list", "key": "a"}),
        ("notes", {"op": "set", "key": "", "value": "v"}),
        ("notes", {"op": "set", "key": "k" * 101, "value": "v"}),
        ("notes", {"op": "set", "key": "a", "value": "v" * 2001}),
        ("todo", {"op": "add"}),
        ("todo", {"op": "add", "text": "t" * 501}),
        ("todo", {"op": "complete", "id": "1"}),
        ("todo", {"op": "complete", "id": 1.0}),
        ("todo", {"op": "complete", "id": 0}),
        ("clock", {"tz": "Europe/Paris"}),
    ],
)
def test_invalid_args_are_an_error_result(tool: str, args: dict[str, JsonValue]) -> None:
    assert (
        error_code(execute(ToolCall(tool=tool, args=args), empty_tool_state(), NOW))
        == "invalid_args"
    )


def test_execute_leaves_the_given_state_unchanged() -> None:
    state, _ = run_all(
        [("notes", {"op": "set", "key": "a", "value": "1"}), ("todo", {"op": "add", "text": "t"})]
    )
    snapshot = repr(state)
    changes: list[tuple[str, dict[str, JsonValue]]] = [
        ("notes", {"op": "delete", "key": "a"}),
        ("todo", {"op": "complete", "id": 1}),
        ("todo", {"op": "add", "text": "u"}),
    ]
    for tool, args in changes:
        assert execute(ToolCall(tool=tool, args=args), state, NOW).ok
    assert repr(state) == snapshot


def test_tool_specs_describe_every_tool() -> None:
    assert [spec.name for spec in TOOLS] == ["calculator", "notes", "todo", "clock"]
    notes = next(spec for spec in TOOLS if spec.name == "notes")
    assert notes.parameters["required"] == ["op"]
    assert notes.parameters["additionalProperties"] is False


# --- merge patch (RFC 7386) -----------------------------------------------------------------

# RFC 7386 appendix A: (target, patch, result).
RFC_EXAMPLES: list[tuple[JsonValue, JsonValue, JsonValue]] = [
    ({"a": "b"}, {"a": "c"}, {"a": "c"}),
    ({"a": "b"}, {"b": "c"}, {"a": "b", "b": "c"}),
    ({"a": "b"}, {"a": None}, {}),
    ({"a": "b", "b": "c"}, {"a": None}, {"b": "c"}),
    ({"a": ["b"]}, {"a": "c"}, {"a": "c"}),
    ({"a": "c"}, {"a": ["b"]}, {"a": ["b"]}),
    ({"a": {"b": "c"}}, {"a": {"b": "d", "c": None}}, {"a": {"b": "d"}}),
    ({"a": [{"b": "c"}]}, {"a": [1]}, {"a": [1]}),
    (["a", "b"], ["c", "d"], ["c", "d"]),
    ({"a": "b"}, ["c"], ["c"]),
    ({"a": "foo"}, None, None),
    ({"a": "foo"}, "bar", "bar"),
    ({"e": None}, {"a": 1}, {"e": None, "a": 1}),
    ([1, 2], {"a": "b", "c": None}, {"a": "b"}),
    ({}, {"a": {"bb": {"ccc": None}}}, {"a": {"bb": {}}}),
]


@pytest.mark.parametrize(("target", "patch", "result"), RFC_EXAMPLES)
def test_apply_merge_patch_matches_rfc_7386(
    target: JsonValue, patch: JsonValue, result: JsonValue
) -> None:
    target_before, patch_before = repr(target), repr(patch)
    assert apply_merge_patch(target, patch) == result
    assert (repr(target), repr(patch)) == (target_before, patch_before)


def test_apply_merge_patch_shares_no_objects_with_its_inputs() -> None:
    target: dict[str, JsonValue] = {"keep": {"x": [1]}, "swap": 1}
    patch: dict[str, JsonValue] = {"swap": [2], "new": {"y": [3]}}
    merged = apply_merge_patch(target, patch)
    assert merged == {"keep": {"x": [1]}, "swap": [2], "new": {"y": [3]}}
    assert merged["keep"] is not target["keep"]
    assert merged["swap"] is not patch["swap"]
    assert merged["new"] is not patch["new"]


@pytest.mark.parametrize(
    ("before", "after", "patch"),
    [
        ({"a": 1}, {"a": 1}, {}),
        ({"a": 1, "b": 2}, {"a": 1}, {"b": None}),
        ({"a": {"b": 1, "c": 2}}, {"a": {"b": 1, "c": 3}}, {"a": {"c": 3}}),
        ({"a": [1, 2]}, {"a": [1, 2, 3]}, {"a": [1, 2, 3]}),
        ({"a": 1}, {"a": True}, {"a": True}),
        ({"a": 1}, {"a": 1.0}, {"a": 1.0}),
        ({"a": "x"}, {"a": {"b": [None]}}, {"a": {"b": [None]}}),
        ({"a": {"b": 1}}, {"a": 5}, {"a": 5}),
    ],
)
def test_merge_patch_diff_is_minimal_and_round_trips(
    before: dict[str, JsonValue], after: dict[str, JsonValue], patch: dict[str, JsonValue]
) -> None:
    assert merge_patch_diff(before, after) == patch
    assert apply_merge_patch(before, merge_patch_diff(before, after)) == after


@pytest.mark.parametrize("after", [{"a": None}, {"b": {"c": None}}])
def test_merge_patch_diff_refuses_null_members(after: dict[str, JsonValue]) -> None:
    with pytest.raises(ValueError, match="null"):
        merge_patch_diff({"a": 1}, after)


# --- replay ---------------------------------------------------------------------------------


def random_calls(seed: int, count: int) -> list[tuple[ToolCall, datetime]]:
    """A seeded mix of valid, failing and invalid calls over a few keys and ids."""
    rng = random.Random(seed)
    calls: list[tuple[ToolCall, datetime]] = []
    now = NOW
    for _ in range(count):
        now += timedelta(seconds=rng.randint(1, 600), microseconds=rng.randint(0, 999_999))
        key = rng.choice(["alpha", "beta", "gamma"])
        choices: list[tuple[str, dict[str, JsonValue]]] = [
            ("notes", {"op": "set", "key": key, "value": f"v{rng.randint(0, 9)}"}),
            ("notes", {"op": "get", "key": key}),
            ("notes", {"op": "delete", "key": key}),
            ("notes", {"op": "list"}),
            ("todo", {"op": "add", "text": f"task {rng.randint(0, 99)}"}),
            ("todo", {"op": "complete", "id": rng.randint(1, 8)}),
            ("todo", {"op": "list"}),
            ("calculator", {"expression": f"{rng.randint(-9, 9)} / {rng.randint(0, 3)}"}),
            ("clock", {}),
            ("notes", {"op": "get"}),
            ("browser", {"url": "http://example.com"}),
        ]
        tool, args = rng.choice(choices)
        calls.append((ToolCall(tool=tool, args=args), now))
    return calls


def record(calls: list[tuple[ToolCall, datetime]]) -> tuple[list[ActionOutcome], ToolState]:
    """Execute calls live, as the harness does: each on the state the deltas so far give."""
    state = empty_tool_state()
    outcomes = []
    for call, now in calls:
        outcomes.append(execute(call, state, now))
        state = apply_merge_patch(state, outcomes[-1].state_delta)
    return outcomes, state


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_replayed_deltas_rebuild_the_live_state_and_reexecution_verifies(seed: int) -> None:
    calls = random_calls(seed, 50)
    outcomes, state = record(calls)

    notes: dict[str, str] = {}  # an independent model of what the tools should have done
    todos: dict[str, dict[str, JsonValue]] = {}
    for (call, now), outcome in zip(calls, outcomes, strict=True):
        op = call.args.get("op")
        if call.tool == "notes" and op == "set":
            notes[str(call.args["key"])] = str(call.args["value"])
        elif call.tool == "notes" and op == "delete" and outcome.ok:
            del notes[str(call.args["key"])]
        elif call.tool == "todo" and op == "add":
            todos[str(len(todos) + 1)] = {"text": call.args["text"], "done": False}
        elif call.tool == "todo" and op == "complete" and outcome.ok:
            todos[str(call.args["id"])]["done"] = True
        elif call.tool == "clock":
            assert outcome.result == {"now": now.isoformat()}

    assert {o.ok for o in outcomes} == {True, False}
    assert state == {"notes": notes, "todos": todos, "next_todo": len(todos) + 1}
    assert replay(outcomes) == state
    assert verify_replay(outcomes, [now for _, now in calls]) == state


def test_verify_replay_names_the_action_that_differs() -> None:
    calls = random_calls(7, 50)
    outcomes, state = record(calls)
    times = [now for _, now in calls]
    assert verify_replay(outcomes, times) == state

    index = next(i for i, o in enumerate(outcomes) if o.ok and o.name == "todo")
    tampered = list(outcomes)
    tampered[index] = replace(outcomes[index], result={"id": 99, "text": "forged", "done": True})
    with pytest.raises(ValueError, match=rf"action {index} \(todo\) differs on replay in result"):
        verify_replay(tampered, times)

    tampered[index] = replace(outcomes[index], ok=False)
    with pytest.raises(ValueError, match=rf"action {index} .* in ok"):
        verify_replay(tampered, times)

    clock = next(i for i, o in enumerate(outcomes) if o.name == "clock")
    shifted = list(times)
    shifted[clock] += timedelta(seconds=1)
    with pytest.raises(ValueError, match=rf"action {clock} \(clock\)"):
        verify_replay(outcomes, shifted)

    with pytest.raises(ValueError, match="recorded times"):
        verify_replay(outcomes, times[:-1])


def test_verify_replay_catches_a_forged_delta() -> None:
    set_note = run("notes", op="set", key="a", value="1")
    forged = replace(set_note, state_delta={"notes": {"a": "2"}})
    with pytest.raises(ValueError, match=r"action 0 \(notes\) differs on replay in state_delta"):
        verify_replay([forged], [NOW])
