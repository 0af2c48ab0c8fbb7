"""Output constraints as xgrammar grammars, before any tokenizer: a canonical key per constraint (one compiled
grammar per key) and the check that fails a bad schema or regex when the request is made.

xgrammar compiles some JSON-schema keywords into nothing (`not`, `if`, `uniqueItems`, a `minimum` in a schema without
a `type`, ...): the output would look constrained and not be. So a schema must keep to the subset that xgrammar was
seen to enforce (tests/engine/test_grammar.py compiles each rule's case and checks that a string breaking it is
refused); anything else fails the request with the keyword and where it is."""

from __future__ import annotations

import functools
import json
from typing import TYPE_CHECKING, Any

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


# The JSON-schema keywords xgrammar enforces, by the JSON types they apply to: each needs `type` beside it, since
# xgrammar drops a `minimum` or `maxLength` from a schema that has none.
_TYPED_KEYWORDS = {
    **dict.fromkeys(("minLength", "maxLength", "pattern", "format"), ("string",)),
    **dict.fromkeys(("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"), ("number", "integer")),
    "multipleOf": ("integer",),  # not enforced for type number
    **dict.fromkeys(("items", "prefixItems", "minItems", "maxItems"), ("array",)),
    **dict.fromkeys(
        (
            "properties",
            "required",
            "additionalProperties",
            "patternProperties",
            "propertyNames",
            "minProperties",
            "maxProperties",
        ),
        ("object",),
    ),
}
# Each of these stands for the whole schema it is in: xgrammar drops a constraint beside it (beside an enum or const,
# the type too, so their values are checked against it here).
_COMBINATORS = ("$ref", "allOf", "anyOf", "oneOf")
_VALUES = ("enum", "const")
_DEFINITIONS = ("$defs", "definitions")
_SUPPORTED = {"type", *_TYPED_KEYWORDS, *_COMBINATORS, *_VALUES, *_DEFINITIONS}
# Annotations promise no constraint, so nothing is lost where xgrammar ignores them.
_ANNOTATIONS = {
    *("title", "description", "default", "examples", "deprecated", "readOnly", "writeOnly"),
    *("$schema", "$id", "$comment"),
}
JSON_SCHEMA_FORMATS = (
    "date",
    "date-time",
    "duration",
    "email",
    "hostname",
    "ipv4",
    "ipv6",
    "json-pointer",
    "relative-json-pointer",
    "time",
    "uri",
    "uuid",
)
_PYTHON_TYPES = {
    "string": lambda v: isinstance(v, str),
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "boolean": lambda v: isinstance(v, bool),
    "null": lambda v: v is None,
    "object": lambda v: isinstance(v, dict),
    "array": lambda v: isinstance(v, list),
}


def schema_problem(schema: Any, at: str = "") -> str | None:
    """The first part of a JSON schema that xgrammar would not hold the output to, said with where it is (a JSON
    pointer); None when every part is enforced. Expects a schema that compiles."""
    if not isinstance(schema, dict):
        return None  # true or false
    where = f" at {at}" if at else ""
    keys = set(schema) - _ANNOTATIONS
    unknown = sorted(keys - _SUPPORTED)
    if unknown:
        return f"keyword {unknown[0]!r}{where} is not supported: the output would not be held to it"
    constraints = keys - {*_DEFINITIONS}
    for key in (*_COMBINATORS, *_VALUES):
        if key in keys:
            beside = sorted(constraints - {key, *(("type",) if key in _VALUES else ())})
            if beside:
                return f"{beside[0]!r}{where} beside {key!r} would not be applied; put it inside the {key} instead"
    ref = schema.get("$ref")
    if ref is not None and not (ref == "#" or str(ref).startswith("#/")):
        return f"$ref {ref!r}{where}: only references within the schema (#/...) are supported"
    if len(schema.get("allOf") or ()) > 1:
        return f"'allOf'{where} with more than one schema is not supported: merge them into one"
    declared = schema.get("type")
    named = [declared] if isinstance(declared, str) else declared if isinstance(declared, list) else []
    odd = [t for t in named if not isinstance(t, str) or t not in _PYTHON_TYPES]
    if odd:
        return f"type {json.dumps(odd[0])}{where} is not a JSON type"
    types = set(named)
    values = [*schema.get("enum", []), *([schema["const"]] if "const" in schema else [])]
    wrong = [v for v in values if types and not any(_PYTHON_TYPES[t](v) for t in types)]
    if wrong:
        return f"the value {json.dumps(wrong[0])}{where} is not of type {schema['type']}"
    for key in sorted(keys & set(_TYPED_KEYWORDS)):
        if not types & set(_TYPED_KEYWORDS[key]):
            kinds = " or ".join(_TYPED_KEYWORDS[key])
            got = f" (it has type {schema['type']})" if types else ""
            return f"{key!r}{where} needs type {kinds} beside it{got}"
    if "multipleOf" in keys and "number" in types:
        return f"'multipleOf'{where} is enforced for type integer only"
    if "format" in keys and schema["format"] not in JSON_SCHEMA_FORMATS:
        return f"format {schema['format']!r}{where} is not supported; supported: {', '.join(JSON_SCHEMA_FORMATS)}"
    missing = [name for name in schema.get("required", []) if name not in schema.get("properties", {})]
    if missing:
        return f"required {missing[0]!r}{where} is not in properties, and only properties can be required"
    for pointer, sub in _subschemas(schema):
        problem = schema_problem(sub, f"{at}/{pointer}")
        if problem:
            return problem
    return None


def _subschemas(schema: dict) -> list[tuple[str, Any]]:
    """(JSON pointer step, schema) of the schemas nested in this one."""
    out = []
    for key in ("properties", "patternProperties", *_DEFINITIONS):
        for name, sub in (schema.get(key) or {}).items():
            out.append((f"{key}/{str(name).replace('~', '~0').replace('/', '~1')}", sub))
    for key in ("additionalProperties", "propertyNames", "items"):
        if key in schema:
            out.append((key, schema[key]))
    for key in ("prefixItems", "anyOf", "oneOf", "allOf"):
        out += [(f"{key}/{i}", sub) for i, sub in enumerate(schema.get(key) or [])]
    return out


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
    problem = schema_problem(json.loads(key[1])) if key[0] == "json_schema" else None
    if problem:
        raise ValueError(f"{_FIELDS[key[0]]}: {problem}")


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
