"""The JSON-schema subset that response_format accepts, held against xgrammar itself: every keyword it lets through is
enforced (a string that breaks it is refused by the compiled grammar), and every schema it refuses is one whose rule
xgrammar would drop (the breaking string is accepted). A new xgrammar that changes either side fails here."""

from __future__ import annotations

import json
import re

import pytest
import xgrammar as xgr
from pydantic import ValidationError
from xgrammar.testing import _is_grammar_accept_string

from batchjob.engine.grammar import JSON_SCHEMA_FORMATS, build_grammar, schema_problem
from batchjob.engine.sampling_params import SamplingParams

INT, STR = {"type": "integer"}, {"type": "string"}
AB = {"type": "object", "properties": {"a": INT, "b": INT}}

# (schema, a JSON text that breaks it, a JSON text that keeps it), as the grammar writes them (", " and ": ").
ENFORCED = [
    (INT, '"s"', "1"),
    ({"type": ["integer", "null"]}, '"s"', "null"),
    ({"enum": ["a", 1]}, '"b"', "1"),
    ({"type": "string", "enum": ["a", "b"]}, '"c"', '"a"'),
    ({"const": "a"}, '"b"', '"a"'),
    ({"type": "string", "minLength": 2}, '"a"', '"ab"'),
    ({"type": "string", "maxLength": 1}, '"ab"', '"a"'),
    ({"type": "string", "pattern": "^a+$"}, '"b"', '"aa"'),
    ({"type": "integer", "minimum": 5}, "3", "7"),
    ({"type": "number", "maximum": 5.5}, "7", "5.5"),
    ({"type": "integer", "exclusiveMinimum": 5}, "5", "6"),
    ({"type": "number", "exclusiveMaximum": 5}, "5", "4.5"),
    ({"type": "integer", "multipleOf": 3}, "4", "6"),
    ({"type": ["integer", "null"], "multipleOf": 3}, "4", "null"),
    ({"type": "array", "items": INT}, '["s"]', "[1]"),
    ({"type": "array", "prefixItems": [INT], "items": STR}, "[1, 2]", '[1, "s"]'),
    ({"type": "array", "items": INT, "minItems": 2}, "[1]", "[1, 2]"),
    ({"type": "array", "items": INT, "maxItems": 1}, "[1, 2]", "[1]"),
    ({**AB, "required": ["a"]}, '{"b": 1}', '{"a": 1}'),
    ({**AB, "required": ["a", "b"]}, '{"a": 1}', '{"a": 1, "b": 2}'),
    ({"type": "object", "additionalProperties": INT}, '{"a": "s"}', '{"a": 1}'),
    ({"type": "object", "patternProperties": {"^x": INT}}, '{"y": 1}', '{"x": 1}'),
    ({"type": "object", "propertyNames": {"type": "string", "pattern": "^x"}}, '{"y": 1}', '{"x": 1}'),
    ({"type": "object", "additionalProperties": INT, "minProperties": 1}, "{}", '{"a": 1}'),
    ({"type": "object", "additionalProperties": INT, "maxProperties": 1}, '{"a": 1, "b": 2}', '{"a": 1}'),
    ({"anyOf": [INT, {"type": "boolean"}]}, '"s"', "true"),
    ({"oneOf": [INT, STR]}, "null", '"s"'),
    ({"allOf": [{"type": "integer", "minimum": 5}], "description": "one schema"}, "3", "7"),
    ({"$defs": {"x": {"type": "integer", "minimum": 5}}, "$ref": "#/$defs/x"}, "3", "7"),
    (
        {"definitions": {"x": INT}, "type": "object", "properties": {"a": {"$ref": "#/definitions/x"}}},
        '{"a": "s"}',
        '{"a": 1}',
    ),
    (
        {"type": "object", "properties": {"a": {"anyOf": [{"$ref": "#"}, {"type": "null"}]}}, "required": ["a"]},
        '{"a": 1}',
        '{"a": {"a": null}}',
    ),
    *[({"type": "string", "format": f}, '"#"', None) for f in JSON_SCHEMA_FORMATS],
]

# (schema, a JSON text that breaks it yet the grammar accepts, what the refusal says)
DROPPED = [
    ({"type": "string", "not": {"const": "a"}}, '"a"', "keyword 'not' is not supported"),
    ({**AB, "if": {"properties": {"a": {"const": 1}}}, "then": {"required": ["b"]}}, '{"a": 1}', "keyword 'if'"),
    ({**AB, "dependentRequired": {"a": ["b"]}}, '{"a": 1}', "keyword 'dependentRequired'"),
    ({**AB, "dependentSchemas": {"a": {"required": ["b"]}}}, '{"a": 1}', "keyword 'dependentSchemas'"),
    ({**AB, "dependencies": {"a": ["b"]}}, '{"a": 1}', "keyword 'dependencies'"),
    ({"type": "array", "items": INT, "contains": {"const": 5}}, "[1]", "keyword 'contains'"),
    ({"type": "array", "items": INT, "uniqueItems": True}, "[1, 1]", "keyword 'uniqueItems'"),
    ({"type": "array", "prefixItems": [INT], "items": True, "unevaluatedItems": False}, "[1, 2]", "'unevaluatedItems'"),
    (
        {**AB, "additionalProperties": True, "unevaluatedProperties": False},
        '{"a": 1, "c": 2}',
        "'unevaluatedProperties'",
    ),
    ({"type": "string", "contentEncoding": "base64"}, '"!!"', "keyword 'contentEncoding'"),
    ({"type": "string", "nullable": True}, '"s"', "keyword 'nullable'"),  # accepted, and null is not: OpenAPI's word
    ({"type": "string", "format": "idn-email"}, '"#"', "format 'idn-email' is not supported"),
    ({"type": "string", "format": "uri-reference"}, '"#"', "format 'uri-reference'"),
    ({"allOf": [INT, {"type": "integer", "minimum": 5}]}, "3", "'allOf' with more than one schema"),
    ({"allOf": [INT, STR]}, "[]", "'allOf' with more than one schema"),
    ({"minimum": 5}, "3", "'minimum' needs type number or integer beside it"),
    ({"maxLength": 1}, '"ab"', "'maxLength' needs type string"),
    ({"pattern": "^a$"}, '"b"', "'pattern' needs type string"),
    ({"maxItems": 1}, "[1, 2]", "'maxItems' needs type array"),
    ({"minProperties": 1}, "{}", "'minProperties' needs type object"),
    ({"type": "number", "multipleOf": 3}, "4", "'multipleOf' needs type integer beside it (it has type number)"),
    ({"type": ["integer", "number"], "multipleOf": 3}, "4.5", "'multipleOf' is enforced for type integer only"),
    ({"type": "object", "properties": {"a": INT}, "required": ["b"]}, '{"a": 1}', "required 'b' is not in properties"),
    ({"type": "object", "additionalProperties": INT, "required": ["b"]}, "{}", "required 'b' is not in properties"),
    ({"anyOf": [INT, STR], "minimum": 5}, "3", "'minimum' beside 'anyOf' would not be applied"),
    ({"type": "integer", "anyOf": [STR, INT]}, '"s"', "'type' beside 'anyOf'"),
    ({"$defs": {"x": INT}, "$ref": "#/$defs/x", "minimum": 5}, "3", "'minimum' beside '$ref'"),
    ({"type": "string", "enum": ["ab"], "maxLength": 1}, '"ab"', "'maxLength' beside 'enum'"),
    ({"type": "string", "enum": [1, "a"]}, "1", "the value 1 is not of type string"),
    ({"type": "string", "const": 1}, "1", "the value 1 is not of type string"),
    ({"$ref": "https://example.com/schema.json"}, "1", "only references within the schema"),
    ({"$defs": {"x": {"$anchor": "a", "type": "integer"}}, "$ref": "#a"}, '"s"', "$ref '#a': only references"),
    (
        {"type": "object", "properties": {"a": {"type": "string", "not": {"const": "x"}}}, "required": ["a"]},
        '{"a": "x"}',
        "keyword 'not' at /properties/a is not supported",
    ),
]


def accepts(schema: dict, text: str) -> bool:
    return _is_grammar_accept_string(build_grammar(("json_schema", json.dumps(schema))), text)


def response_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "t", "schema": schema}}


@pytest.mark.parametrize("schema,breaks,keeps", ENFORCED)
def test_an_accepted_keyword_is_enforced(schema, breaks, keeps):
    assert schema_problem(schema) is None
    assert not accepts(schema, breaks)
    if keeps is not None:
        assert accepts(schema, keeps)
    SamplingParams(response_format=response_format(schema))  # and it is accepted as a request's constraint


@pytest.mark.parametrize("schema,breaks,message", DROPPED)
def test_a_keyword_that_xgrammar_drops_is_refused(schema, breaks, message):
    assert accepts(schema, breaks), "xgrammar enforces this now: the rule that refuses it can go"
    assert message in (schema_problem(schema) or "")
    with pytest.raises(
        ValidationError, match=re.escape(f"response_format.json_schema.schema: {schema_problem(schema)}")
    ):
        SamplingParams(response_format=response_format(schema))


def test_a_schema_that_does_not_compile_says_so_before_any_keyword_check():
    with pytest.raises(ValidationError, match="cannot be compiled to a grammar"):
        SamplingParams(response_format=response_format({"type": "nonsense", "not": {}}))
    assert "is not a JSON type" in schema_problem({"type": ["integer", "nonsense"], "enum": [1]})
    xgr.Grammar.from_json_schema(json.dumps({"type": ["integer", "nonsense"], "enum": [1]}))  # xgrammar takes it
