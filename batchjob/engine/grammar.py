"""Output constraints as xgrammar grammars, before any tokenizer: a canonical key per constraint (one compiled
grammar per key) and the check that fails a bad schema or regex when the request is made."""

from __future__ import annotations

import functools
import json
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import xgrammar as xgr

GrammarKey = tuple[str, str]  # (kind, canonical text): one compiled grammar per key
_FIELDS = {
    "json_schema": "response_format.json_schema.schema",
    "json_object": "response_format",
    "regex": "regex",
    "choice": "choice",
}


def grammar_key(rf, regex: str | None, choice: list[str] | None) -> GrammarKey | None:
    """What a request's output is constrained to (its response_format, regex or choice), canonically; None when
    it is free."""
    if rf is not None and rf.type == "json_schema":
        return "json_schema", json.dumps(rf.json_schema.schema_)  # property order steers generation
    if rf is not None and rf.type == "json_object":
        return "json_object", ""
    if regex is not None:
        return "regex", regex
    if choice is not None:
        return "choice", json.dumps(choice, ensure_ascii=False)
    return None


def check_grammar(key: GrammarKey) -> None:
    """ValueError naming the field when the constraint cannot be compiled (no tokenizer needed)."""
    _checked(key)


@functools.lru_cache(maxsize=1024)
def _checked(key: GrammarKey) -> None:
    try:
        build_grammar(key)
    except (RuntimeError, ValueError, TypeError) as e:  # xgrammar reports bad input as RuntimeError/ValueError
        message = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"{_FIELDS[key[0]]}: cannot be compiled to a grammar: {message}") from None


def build_grammar(key: GrammarKey) -> xgr.Grammar:
    import xgrammar as xgr

    kind, text = key
    if kind == "json_schema":
        return xgr.Grammar.from_json_schema(text, any_whitespace=False, strict_mode=True)
    if kind == "json_object":  # OpenAI's json_object is an object (xgrammar's built-in JSON grammar takes any value)
        return xgr.Grammar.from_json_schema('{"type": "object"}', any_whitespace=False, strict_mode=False)
    if kind == "regex":
        return xgr.Grammar.from_regex(text)
    # JSON string literals are valid EBNF string literals (same escapes).
    choices = json.loads(text)
    return xgr.Grammar.from_ebnf("root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices))
