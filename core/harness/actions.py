"""The deterministic tools the ``agent`` specialist calls, and the replayable state they share.

A conversation's tool state is one JSON object. Every call becomes a ``HarnessActionExecuted``
event whose ``state_delta`` is a JSON Merge Patch over that state, so applying the recorded
deltas in order rebuilds the state, and re-executing the recorded calls on it must give the same
results and deltas. ``execute`` is therefore pure: the state and the time come in as arguments,
and the clock is the only tool that reads the time. Bad model output (an unknown tool, invalid
arguments, a failing tool) is an ``ok=False`` outcome with a stable error code, never an
exception.
"""

from __future__ import annotations

import ast
import math
import operator
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Generic, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, JsonValue, ValidationError, model_validator

from core.canonical import canonical_json
from core.conversation import empty_tool_state
from core.merge_patch import apply_merge_patch, merge_patch_diff

MAX_ACTIONS_PER_TURN = 4
"""Most tool calls the harness runs for one turn before the model must answer."""
MAX_NOTES = 100
MAX_TODOS = 100
MAX_EXPRESSION_CHARS = 200
MAX_EXPONENT = 100
"""Largest exponent magnitude ``calculator`` raises to: keeps every calculation small."""
MAX_MAGNITUDE = 1e100
"""Largest absolute value ``calculator`` produces, intermediate values included."""
NOTES_OPS: dict[str, tuple[str, ...]] = {
    "set": ("key", "value"),
    "get": ("key",),
    "delete": ("key",),
    "list": (),
}
"""The arguments each ``notes`` op needs, and the only ones it takes."""
TODO_OPS: dict[str, tuple[str, ...]] = {"add": ("text",), "list": (), "complete": ("id",)}
"""The arguments each ``todo`` op needs, and the only ones it takes."""
EXPRESSION_CHARACTERS = "0-9 .+*/%()-"
"""The characters of a ``calculator`` expression as a regular-expression class: numbers, the
operators and parentheses (the parser also reads forms like ``1e3``, which no task needs)."""

ToolState = dict[str, JsonValue]
"""``{"notes": {key: value}, "todos": {"<id>": {"text": str, "done": bool}}, "next_todo": int}``"""


class ToolCall(BaseModel):
    """One call the model emits: a tool's name and its arguments, still unvalidated."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    tool: str
    args: dict[str, JsonValue] = Field(default_factory=dict)


class ToolSpec(BaseModel):
    """What the harness context tells the model about one tool (``parameters`` is JSON Schema)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    description: str
    parameters: dict[str, JsonValue]


@dataclass(frozen=True)
class ActionOutcome:
    """One executed call, as a ``HarnessActionExecuted`` event records it."""

    name: str
    args: dict[str, JsonValue]
    result: JsonValue
    ok: bool
    state_delta: dict[str, JsonValue]


class _ToolError(Exception):
    """A call the tool refuses (division by zero, a missing note): becomes an error result."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


# --- arguments ------------------------------------------------------------------------------


class _Args(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)


class CalculatorArgs(_Args):
    expression: str = Field(
        min_length=1,
        max_length=MAX_EXPRESSION_CHARS,
        description="Arithmetic on numbers: + - * / // % **, unary minus, parentheses.",
    )


class NotesArgs(_Args):
    op: Literal["set", "get", "delete", "list"] = Field(
        description="set needs key and value; get and delete need key; list takes neither."
    )
    key: str | None = Field(default=None, min_length=1, max_length=100)
    value: str | None = Field(default=None, max_length=2000)

    @model_validator(mode="after")
    def _fields_fit_op(self) -> NotesArgs:
        given = {name for name in ("key", "value") if getattr(self, name) is not None}
        _require_exactly(self.op, set(NOTES_OPS[self.op]), given)
        return self


class TodoArgs(_Args):
    op: Literal["add", "list", "complete"] = Field(
        description="add needs text; complete needs id; list takes neither."
    )
    text: str | None = Field(default=None, min_length=1, max_length=500)
    id: int | None = Field(default=None, ge=1)

    @model_validator(mode="after")
    def _fields_fit_op(self) -> TodoArgs:
        given = {name for name in ("text", "id") if getattr(self, name) is not None}
        _require_exactly(self.op, set(TODO_OPS[self.op]), given)
        return self


class ClockArgs(_Args):
    pass


def _require_exactly(op: str, needed: set[str], given: set[str]) -> None:
    if missing := sorted(needed - given):
        raise ValueError(f"op {op!r} needs {', '.join(missing)}")
    if extra := sorted(given - needed):
        raise ValueError(f"op {op!r} does not take {', '.join(extra)}")


# --- state ----------------------------------------------------------------------------------


class _Todo(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    text: str
    done: bool


class _State(BaseModel):
    """The tool state, typed. Each call validates a fresh copy and changes only that copy."""

    model_config = ConfigDict(extra="forbid", strict=True)

    notes: dict[str, str]
    todos: dict[str, _Todo]
    next_todo: int


# --- tools ----------------------------------------------------------------------------------

_Number = int | float
_BINARY: dict[type[ast.operator], Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}


def _calculator(args: CalculatorArgs, state: _State, now: datetime) -> JsonValue:
    """Walks the parsed expression itself: only number literals and arithmetic are allowed."""
    try:
        tree = ast.parse(args.expression.strip(), mode="eval")
    except (SyntaxError, ValueError) as exc:
        raise _ToolError("invalid_expression", f"not an arithmetic expression: {exc}") from exc
    return {"value": _evaluate(tree.body)}


def _evaluate(node: ast.expr) -> _Number:
    if isinstance(node, ast.Constant):
        return _bounded(node.value)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
        operand = _evaluate(node.operand)
        return _bounded(-operand if isinstance(node.op, ast.USub) else operand)
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise _ToolError("exponent_too_large", f"exponents are limited to ±{MAX_EXPONENT}")
        try:
            return _bounded(_BINARY[type(node.op)](left, right))
        except ZeroDivisionError as exc:
            raise _ToolError("division_by_zero", "division by zero") from exc
        except OverflowError as exc:
            raise _ToolError("result_too_large", f"a value exceeds {MAX_MAGNITUDE:g}") from exc
    raise _ToolError(
        "invalid_expression",
        f"{type(node).__name__} is not allowed: only numbers, parentheses and + - * / // % **",
    )


def _bounded(value: object) -> _Number:
    """Admit a literal or intermediate value only if it is a real number within the limits."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise _ToolError(
            "invalid_expression", f"only real numbers are allowed, not {type(value).__name__}"
        )
    if not math.isfinite(value) or abs(value) > MAX_MAGNITUDE:
        raise _ToolError("result_too_large", f"a value exceeds {MAX_MAGNITUDE:g}")
    return value


def _notes(args: NotesArgs, state: _State, now: datetime) -> JsonValue:
    if args.op == "list":
        keys: list[JsonValue] = list(sorted(state.notes))
        return {"keys": keys}
    key = args.key or ""
    if args.op == "set":
        if key not in state.notes and len(state.notes) >= MAX_NOTES:
            raise _ToolError("too_many_notes", f"at most {MAX_NOTES} notes; delete one first")
        state.notes[key] = args.value or ""
        return {"key": key, "value": state.notes[key]}
    if key not in state.notes:
        raise _ToolError("note_not_found", f"no note named {key!r}")
    if args.op == "get":
        return {"key": key, "value": state.notes[key]}
    del state.notes[key]
    return {"key": key, "deleted": True}


def _todo(args: TodoArgs, state: _State, now: datetime) -> JsonValue:
    if args.op == "list":
        ids = sorted(int(todo_id) for todo_id in state.todos)
        return {"todos": [_todo_view(todo_id, state) for todo_id in ids]}
    if args.op == "add":
        if len(state.todos) >= MAX_TODOS:
            raise _ToolError("too_many_todos", f"at most {MAX_TODOS} todos")
        todo_id = state.next_todo
        state.todos[str(todo_id)] = _Todo(text=args.text or "", done=False)
        state.next_todo += 1
        return _todo_view(todo_id, state)
    todo_id = args.id or 0
    todo = state.todos.get(str(todo_id))
    if todo is None:
        raise _ToolError("todo_not_found", f"no todo with id {todo_id}")
    todo.done = True
    return _todo_view(todo_id, state)


def _todo_view(todo_id: int, state: _State) -> JsonValue:
    todo = state.todos[str(todo_id)]
    return {"id": todo_id, "text": todo.text, "done": todo.done}


def _clock(args: ClockArgs, state: _State, now: datetime) -> JsonValue:
    return {"now": now.astimezone(UTC).isoformat()}


# --- registry and execution -----------------------------------------------------------------

_A = TypeVar("_A", bound=_Args)


@dataclass(frozen=True)
class _Tool(Generic[_A]):
    name: str
    description: str
    args_model: type[_A]
    run: Callable[[_A, _State, datetime], JsonValue]
    """Returns the result and may change the state it is given; raises ``_ToolError``."""

    def spec(self) -> ToolSpec:
        return ToolSpec(
            name=self.name,
            description=self.description,
            parameters=self.args_model.model_json_schema(),
        )


_REGISTRY: tuple[_Tool[Any], ...] = (
    _Tool(
        "calculator",
        "Evaluate an arithmetic expression (integer arithmetic is exact).",
        CalculatorArgs,
        _calculator,
    ),
    _Tool(
        "notes",
        "Keep short notes for this conversation: set/get/delete one by key, or list the keys.",
        NotesArgs,
        _notes,
    ),
    _Tool(
        "todo", "Keep a todo list: add an item, list them, or complete one by id.", TodoArgs, _todo
    ),
    _Tool("clock", "The current date and time (UTC, ISO 8601).", ClockArgs, _clock),
)
_BY_NAME = {tool.name: tool for tool in _REGISTRY}
TOOLS: tuple[ToolSpec, ...] = tuple(tool.spec() for tool in _REGISTRY)


def execute(call: ToolCall, state: ToolState, now: datetime) -> ActionOutcome:
    """Run one call against ``state`` (left unchanged) at time ``now`` (timezone-aware)."""
    if now.tzinfo is None:
        raise ValueError("now must be timezone-aware")
    tool = _BY_NAME.get(call.tool)
    if tool is None:
        known = ", ".join(_BY_NAME)
        return _failed(call, "unknown_tool", f"no tool named {call.tool[:100]!r}; tools: {known}")
    try:
        args = tool.args_model.model_validate(call.args)
    except ValidationError as exc:
        return _failed(call, "invalid_args", _describe(exc))
    work = _State.model_validate(state)
    try:
        result = tool.run(args, work, now)
    except _ToolError as exc:
        return _failed(call, exc.code, exc.message)
    delta = merge_patch_diff(state, work.model_dump(mode="json"))
    return ActionOutcome(call.tool, call.args, result, ok=True, state_delta=delta)


def _failed(call: ToolCall, code: str, message: str) -> ActionOutcome:
    error: JsonValue = {"error": {"code": code, "message": message}}
    return ActionOutcome(call.tool, call.args, error, ok=False, state_delta={})


def _describe(exc: ValidationError) -> str:
    reasons = []
    for error in exc.errors()[:5]:
        path = ".".join(str(part) for part in error["loc"]) or "args"
        reasons.append(f"{path}: {error['msg']}")
    return "; ".join(reasons)


def replay(actions: Iterable[ActionOutcome]) -> ToolState:
    """The tool state after ``actions``: their deltas applied in order to the empty state."""
    state = empty_tool_state()
    for action in actions:
        state = apply_merge_patch(state, action.state_delta)
    return state


def verify_replay(
    actions: Sequence[ActionOutcome], recorded_times: Sequence[datetime]
) -> ToolState:
    """Re-execute each recorded call at its recorded time on the state rebuilt so far.

    Raises ``ValueError`` naming the first action whose result, ``ok`` or delta differs from
    the record; returns the final state.
    """
    if len(actions) != len(recorded_times):
        raise ValueError(f"{len(actions)} actions but {len(recorded_times)} recorded times")
    state = empty_tool_state()
    for index, (action, now) in enumerate(zip(actions, recorded_times, strict=True)):
        again = execute(ToolCall(tool=action.name, args=action.args), state, now)
        differs = [
            field
            for field in ("result", "ok", "state_delta")
            if canonical_json(getattr(action, field)) != canonical_json(getattr(again, field))
        ]
        if differs:
            raise ValueError(
                f"action {index} ({action.name}) differs on replay in {', '.join(differs)}"
            )
        state = apply_merge_patch(state, action.state_delta)
    return state
