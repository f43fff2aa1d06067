"""OpenAI's JSON-schema subset (mola/structured/schema.py): what clients
send is accepted (the OpenAI SDK's own conversion of Pydantic models), and
every keyword or strict-mode rule outside it is refused naming it."""

from __future__ import annotations

from typing import Literal, Optional

import pytest
from openai.lib._parsing._completions import type_to_response_format_param
from pydantic import BaseModel, Field

from mola.errors import InvalidRequest
from mola.structured.schema import MAX_DEPTH, check_schema


class Step(BaseModel):
    explanation: str
    output: int = Field(ge=0, le=10)


class Answer(BaseModel):
    kind: Literal["a", "b"]
    steps: list[Step]
    final: Optional[str]
    pinned: Literal["only"]
    children: list["Answer"]  # recursion through $ref "#/$defs/Answer"


def obj(props: dict, **extra) -> dict:
    return {"type": "object", "properties": props, "required": list(props), "additionalProperties": False,
            **extra}


def refused(schema, strict=True) -> str:
    with pytest.raises(InvalidRequest) as e:
        check_schema(schema, strict=strict, param="response_format")
    assert e.value.param == "response_format"
    return e.value.message


def test_the_sdks_pydantic_schemas_are_accepted():
    fmt = type_to_response_format_param(Answer)
    check_schema(fmt["json_schema"]["schema"], strict=True, param="response_format")


@pytest.mark.parametrize("schema", [
    obj({"s": {"type": "string", "pattern": "^[a-z]+$", "minLength": 1, "maxLength": 9}}),
    obj({"d": {"type": "string", "format": "date-time"}, "u": {"type": "string", "format": "uuid"}}),
    obj({"n": {"type": "number", "minimum": 0, "exclusiveMaximum": 5, "multipleOf": 0.5}}),
    obj({"a": {"type": "array", "items": {"type": ["integer", "null"]}, "minItems": 1, "maxItems": 3}}),
    obj({"e": {"enum": ["x", 1, None]}, "c": {"const": "k"}, "any": {"anyOf": [{"type": "string"},
                                                                                {"type": "null"}]}}),
    obj({"r": {"$ref": "#/$defs/R"}}, **{"$defs": {"R": obj({"x": {"type": "boolean"}})}}),
    obj({"t": {"type": "string", "title": "T", "description": "d", "default": "x", "examples": ["y"]}}),
])
def test_the_subset_is_accepted(schema):
    check_schema(schema, strict=True, param="response_format")


@pytest.mark.parametrize("keyword, schema", [
    ("allOf", obj({"a": {"allOf": [{"type": "string"}]}})),
    ("not", obj({"a": {"not": {"type": "string"}}})),
    ("if", obj({"a": {"type": "string", "if": {}, "then": {}}})),
    ("patternProperties", {"type": "object", "patternProperties": {"^x": {}}}),
    ("uniqueItems", obj({"a": {"type": "array", "items": {}, "uniqueItems": True}})),
    ("prefixItems", obj({"a": {"type": "array", "prefixItems": [{}]}})),
    ("oneOf", obj({"a": {"oneOf": [{"type": "string"}]}})),
    ("x-guidance", obj({"a": {"type": "string"}}, **{"x-guidance": {"lenient": True}})),
])
def test_keywords_outside_the_subset_are_refused_by_name(keyword, schema):
    message = refused(schema, strict=False)
    assert repr(keyword) in message and "not supported" in message


def test_the_place_of_a_bad_keyword_is_named():
    message = refused(obj({"outer": obj({"inner": {"type": "string", "allOf": []}})}))
    assert "#/properties/outer/properties/inner" in message


@pytest.mark.parametrize("schema, words", [
    (obj({"a": {"type": "string", "format": "phone"}}), "'phone'"),
    (obj({"a": {"type": "string", "minimum": 3}}), "'minimum' applies to number/integer"),
    (obj({"a": {"type": "strin"}}), "unknown type 'strin'"),
    (obj({"a": {"$ref": "https://example.com/s.json"}}), "only local references"),
    (obj({"a": {"enum": []}}), "'enum' must be a non-empty list"),
    ({"type": "object", "properties": {"a": {}}, "required": ["b"]}, "'required' must list"),
])
def test_malformed_schemas_are_refused(schema, words):
    assert words in refused(schema, strict=False)


def test_strict_rules():
    assert "additionalProperties" in refused({"type": "object", "properties": {"a": {"type": "string"}},
                                              "required": ["a"]})
    assert "'b' is not in 'required'" in refused(
        {"type": "object", "properties": {"a": {}, "b": {}}, "required": ["a"], "additionalProperties": False})
    assert "root of a strict schema" in refused({"anyOf": [obj({})]})
    # Without strict, the same schemas are constrained as written.
    check_schema({"type": "object", "properties": {"a": {"type": "string"}}}, strict=False, param="p")
    check_schema({"anyOf": [obj({}), {"type": "string"}]}, strict=False, param="p")


def test_limits():
    deep = {"type": "string"}
    for _ in range(MAX_DEPTH + 1):
        deep = obj({"x": deep})
    assert "nests more than" in refused(deep)
    assert "enum values" in refused(obj({f"p{i}": {"enum": list(range(300))} for i in range(4)}))
