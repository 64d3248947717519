"""Grammar-constrained decoding with xgrammar: one compiler per engine over its tokenizer, compiled
grammars cached by the sha256 of the schema's compact JSON, a cheap matcher per request, and the
token mask applied only to the rows of a batch whose request carries a grammar.

xgrammar 0.2.8 lets a string bounded by ``maxLength`` hold raw control characters (byte 0x10,
a tab), which no JSON parser accepts; so before compiling, each such string's length bounds are
replaced by the ``pattern`` xgrammar means: at most ``maxLength`` characters, none a control
character, a quote or a backslash (xgrammar writes no escapes in a bounded string either; vLLM
refuses a pattern beside length bounds). It costs compile time (about 3x for the GenUI
grammar), once per schema.

The schema's key order is kept, not sorted as in ``core.canonical``: properties are written in
the order the schema lists them (``"type"`` first in a GenUI component), so two orders are two
grammars.

Answers are written without free whitespace (xgrammar 0.2.8 still writes ``", "`` between the
members of a free JSON value), the way the vLLM replicas are started (``infra/vllm_cpu.py``):
both engines decode the same grammar, and greedy answers on the same weights are the same.
Plain JSON is the schema ``{}`` (any JSON value) on both.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import torch
import xgrammar as xgr

from core.canonical import sha256_hex
from core.engine import OutputConstraint
from core.errors import GrammarInvalid, GrammarUnbounded
from core.harness.grammars import unbounded_paths

SEPARATORS = (",", ":")
ANY_JSON = "{}"
PLAIN_CHARACTERS = '^[^\\x00-\\x1f"\\\\]{%d,%d}$'
TEXT = "root ::= [^{ \\t\\n\\r] [^]*"
"""Text a constraint with ``or_text`` allows: one character or more, not beginning with ``{``
(that begins the JSON value) or whitespace."""
_NOT_SCHEMAS = frozenset(("enum", "const", "default", "examples"))
CACHED = 64
"""Checked schemas and compiled grammars kept per engine, least recently used dropped first."""
T = TypeVar("T")


def _compact(schema: Any) -> str:
    try:
        return json.dumps(schema, separators=SEPARATORS, ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise GrammarInvalid(f"the schema is not JSON: {exc}") from exc


def grammar_key(constraint: OutputConstraint) -> str:
    """The sha256 of the constraint's kind, schema (as compact JSON in its own key order) and
    whether text is allowed instead."""
    schema = {} if constraint.json_schema is None else constraint.json_schema
    text = "+text" if constraint.or_text else ""
    return sha256_hex(f"{constraint.kind}{text}:{_compact(schema)}".encode())


@dataclass(frozen=True)
class Checked:
    """A constraint that passed the bounds rule and that xgrammar reads: its schema as compact
    JSON in its own key order (``{}`` for plain JSON), and whether text is allowed instead."""

    schema: str
    or_text: bool

    def grammar(self) -> xgr.Grammar:
        """The grammar both engines decode: the schema's, or the union with ``TEXT``."""
        value = xgr.Grammar.from_json_schema(
            self.schema, any_whitespace=False, separators=SEPARATORS
        )
        return xgr.Grammar.union(value, xgr.Grammar.from_ebnf(TEXT)) if self.or_text else value

    def structured_outputs(self) -> dict[str, str]:
        """What a vLLM replica gets: the schema, or the union grammar as EBNF."""
        return {"grammar": str(self.grammar())} if self.or_text else {"json": self.schema}


def checked(constraint: OutputConstraint) -> Checked:
    """The constraint, once it passes the bounds rule and xgrammar can read it:
    ``GrammarUnbounded`` or ``GrammarInvalid`` if not. Tens of milliseconds for the GenUI
    schema: cache it."""
    if constraint.json_schema is None:
        return Checked(ANY_JSON, constraint.or_text)
    schema = constraint.json_schema
    loose = unbounded_paths(schema)
    if loose:
        shown = "; ".join(loose[:5]) + ("; ..." if len(loose) > 5 else "")
        raise GrammarUnbounded(
            f"the schema is unbounded ({shown}): every array needs maxItems, every string "
            "that is not an enum, a const or a pattern maxLength, every number minimum and maximum"
        )
    result = Checked(_compact(_plain_strings(schema)), constraint.or_text)
    try:
        result.grammar()
    except (RuntimeError, ValueError, TypeError) as exc:
        raise GrammarInvalid(f"the schema does not compile to a grammar: {exc}") from exc
    return result


def _plain_strings(node: Any) -> Any:
    """A copy of ``node`` where each string bounded only by ``maxLength`` has the pattern of
    ``PLAIN_CHARACTERS`` instead."""
    if isinstance(node, list):
        return [_plain_strings(item) for item in node]
    if not isinstance(node, dict):
        return node
    out = {
        key: value
        if key in _NOT_SCHEMAS
        else {k: _plain_strings(v) for k, v in value.items()}
        if key in ("properties", "$defs", "definitions") and isinstance(value, dict)
        else _plain_strings(value)
        for key, value in node.items()
    }
    kinds = out.get("type")
    strings = kinds == "string" or (isinstance(kinds, list) and "string" in kinds)
    if strings and "maxLength" in out and not {"pattern", "format", *_NOT_SCHEMAS} & out.keys():
        shortest, longest = out.pop("minLength", 0), out.pop("maxLength")
        out["pattern"] = PLAIN_CHARACTERS % (shortest, longest)  # vLLM refuses both at once
    return out


class _Recent(Generic[T]):
    """At most ``CACHED`` values by key, least recently used dropped first; thread-safe."""

    def __init__(self) -> None:
        self._values: OrderedDict[str, T] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: str) -> T | None:
        with self._lock:
            value = self._values.get(key)
            if value is not None:
                self._values.move_to_end(key)
            return value

    def put(self, key: str, value: T) -> None:
        with self._lock:
            self._values[key] = value
            while len(self._values) > CACHED:
                self._values.popitem(last=False)


class CheckedSchemas:
    """What the fleet sends: each constraint checked once, its structured outputs by its key."""

    def __init__(self) -> None:
        self._checked: _Recent[dict[str, str]] = _Recent()

    def structured_outputs(self, constraint: OutputConstraint) -> dict[str, str]:
        key = grammar_key(constraint)
        found = self._checked.get(key)
        if found is None:
            found = checked(constraint).structured_outputs()
            self._checked.put(key, found)
        return found


class Grammars:
    """The engine's compiled grammars: the compiler is built on first use (from the tokenizer
    and the model's vocabulary width), each constraint is checked and compiled once (one compile
    at a time: concurrent requests for a new grammar wait for the first to compile it), each
    request gets a matcher of its own."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int]) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._stop = list(stop_token_ids)
        self._compiler: xgr.GrammarCompiler | None = None
        self._compiled: _Recent[xgr.CompiledGrammar] = _Recent()
        self._compiling = threading.Lock()

    def matcher(self, constraint: OutputConstraint) -> xgr.GrammarMatcher:
        """A fresh matcher for ``constraint``, compiling its grammar if it is not cached (that
        can take seconds: call it off the event loop and off the batch worker)."""
        key = grammar_key(constraint)
        compiled = self._compiled.get(key)
        if compiled is None:
            with self._compiling:
                compiled = self._compiled.get(key)
                if compiled is None:
                    compiled = self._compile(constraint)
                    self._compiled.put(key, compiled)
        return xgr.GrammarMatcher(compiled)

    def _compile(self, constraint: OutputConstraint) -> xgr.CompiledGrammar:
        grammar = checked(constraint).grammar()
        if self._compiler is None:
            info = xgr.TokenizerInfo.from_huggingface(
                self._tokenizer, vocab_size=self.vocab_size, stop_token_ids=self._stop or None
            )
            self._compiler = xgr.GrammarCompiler(info, cache_enabled=False)
        try:
            return self._compiler.compile_grammar(grammar)
        except (RuntimeError, ValueError, TypeError) as exc:
            raise GrammarInvalid(f"the schema does not compile to a grammar: {exc}") from exc


def constrained(
    logits: torch.Tensor, matchers: Sequence[xgr.GrammarMatcher | None], bitmask: torch.Tensor
) -> torch.Tensor:
    """``logits`` with the tokens each row's grammar does not allow next forbidden (rows
    without a matcher as they were): a float32 copy, which the mask needs and greedy choice
    does not notice; ``logits`` itself when no row has a grammar. ``bitmask`` has a row per
    row of ``logits``."""
    if all(m is None for m in matchers):
        return logits
    logits = logits.float()
    rows = [
        row
        for row, matcher in enumerate(matchers)
        if matcher is not None and matcher.fill_next_token_bitmask(bitmask, row)
    ]
    if rows:
        xgr.apply_token_bitmask_inplace(logits, bitmask, indices=rows)
    return logits


def new_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    return xgr.allocate_token_bitmask(rows, vocab_size)
