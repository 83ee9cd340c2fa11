"""A JSON schema is refused when it is made if the grammar would not enforce it as written
(asyncengine/json_schema_rules.py), with the keyword and where it is; what the grammar does
enforce, and what JSON Schema itself ignores, passes."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest

from asyncengine import InvalidRequestError
from asyncengine.sampling_params import StructuredOutputsParams

REFUSED = [
    ({"type": "no-such-type"}, "type 'no-such-type' is not one of", "the top level"),
    ({"type": ["string", "wat"]}, "type 'wat'", "the top level"),
    ({"type": "string", "minLength": -1}, "minLength must be a non-negative integer", "the top"),
    ({"type": "array", "maxItems": 1.5}, "maxItems must be", "the top level"),
    ({"properties": {"t": {"type": "array", "uniqueItems": True}}}, "uniqueItems", "/properties/t"),
    ({"items": {"contains": {"const": 1}}}, '"contains"', "/items"),
    ({"$defs": {"a": {"not": {"type": "string"}}}}, '"not"', "/$defs/a"),
    ({"anyOf": [{"type": "string"}, {"if": {}, "then": {}}]}, '"if"', "/anyOf/1"),
    ({"dependentRequired": {"a": ["b"]}}, '"dependentRequired"', "the top level"),
    ({"type": "number", "multipleOf": 0.5}, '"multipleOf"', "the top level"),
    ({"type": "string", "pattern": "[a-z]+", "maxLength": 3}, "beside a pattern", "the top"),
    ({"type": "string", "format": "email", "minLength": 3}, "beside a pattern or format", "the"),
    ({"$ref": "https://example.com/s.json"}, "not a local reference", "the top level"),
    ({"properties": {"a/b": {"not": {}}}}, '"not"', "/properties/a~1b"),
    ({"prefixItems": [True, 3]}, "must be an object or a boolean", "/prefixItems/1"),
]  # fmt: skip


@pytest.mark.parametrize("schema, problem, where", REFUSED)
def test_a_schema_the_grammar_would_not_enforce_is_refused_when_made(
    schema: dict[str, Any], problem: str, where: str
) -> None:
    with pytest.raises(InvalidRequestError) as error:
        StructuredOutputsParams(json=json.dumps(schema))
    assert error.value.field == "structured_outputs.json"
    assert problem in error.value.description and where in error.value.description


def test_what_the_grammar_enforces_and_what_json_schema_ignores_pass() -> None:
    accepted = {
        "title": "x",
        "type": "object",
        "properties": {
            # names are names: a property called "not" is no keyword
            "not": {"type": "integer", "multipleOf": 3, "minimum": 0},
            "if": {"type": "string", "format": "email"},  # format alone: enforced
            "tags": {"type": "array", "items": {"$ref": "#/$defs/tag"}, "maxItems": 3},
            "any": {"anyOf": [{"type": "null"}, {"enum": [{"not": 1}]}]},  # enum is data
        },
        "$defs": {"tag": {"type": "string", "minLength": 1, "maxLength": 4}},
        "x-vendor": {"uniqueItems": True},  # unknown keywords are ignored, as validators do
    }
    StructuredOutputsParams(json=accepted)


@pytest.mark.parametrize(
    "schema, output",
    [
        ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "[1, 1]"),
        ({"type": "string", "pattern": "[a-z]+", "maxLength": 3}, '"abcdef"'),
        ({"not": {"type": "string"}}, '"a"'),
        ({"properties": {"a": {}, "b": {}}, "dependentRequired": {"a": ["b"]}}, '{"a": 1}'),
        ({"type": "number", "multipleOf": 0.5}, "1.3"),
    ],
)
def test_why_xgrammar_would_let_an_invalid_output_finish(schema: Any, output: str) -> None:
    """Each refused keyword compiles, in xgrammar 0.2.9, to a grammar that finishes an output
    the schema rejects. When this fails, xgrammar enforces it: the rule can go."""
    import xgrammar as xgr

    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(json.loads(output), schema)
    info = xgr.TokenizerInfo([chr(c) for c in range(32, 127)])
    grammar = xgr.Grammar.from_json_schema(schema, any_whitespace=False)
    matcher = xgr.GrammarMatcher(xgr.GrammarCompiler(info).compile_grammar(grammar))
    assert matcher.accept_string(output) and matcher.is_completed()
