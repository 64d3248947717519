"""Whether a text is in the grammar of a JSON Schema: xgrammar over a vocabulary of single
characters (compiles in milliseconds), since no JSON Schema validator is installed. It checks
what a grammar can: rules across fields (a table row as long as its columns, unique ids) are the
catalogue's own."""

from __future__ import annotations

import json
from typing import Any

import xgrammar as xgr

from engines.grammar import SEPARATORS

CHARACTERS = [chr(i) for i in range(32, 127)] + ["</s>"]


def written(value: Any) -> str:
    """``value`` as the engines write it: no whitespace between members."""
    return json.dumps(value, separators=SEPARATORS, ensure_ascii=False)


def in_grammar(schema: dict[str, Any], text: str) -> bool:
    info = xgr.TokenizerInfo(CHARACTERS, stop_token_ids=[len(CHARACTERS) - 1])
    compiled = xgr.GrammarCompiler(info, cache_enabled=False).compile_json_schema(
        json.dumps(schema), any_whitespace=False, separators=SEPARATORS
    )
    matcher = xgr.GrammarMatcher(compiled)
    return matcher.accept_string(text) and matcher.is_completed()
