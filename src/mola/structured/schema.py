"""OpenAI's structured-output subset of JSON Schema, checked before a schema
is compiled, so that a keyword mola would not enforce is a 400 naming it,
never a constraint silently dropped.

What is accepted is what OpenAI documents for Structured Outputs: the types
string, number, integer, boolean, object, array and null (a type or a list of
them), ``enum``, ``const``, ``anyOf``, local ``$ref`` into ``$defs`` /
``definitions`` (recursion included); for strings ``pattern`` and ``format``
(the formats OpenAI lists) and ``minLength`` / ``maxLength``; for numbers
``minimum``, ``maximum``, ``exclusiveMinimum``, ``exclusiveMaximum``,
``multipleOf``; for arrays ``items``, ``minItems``, ``maxItems``; for objects
``properties``, ``required``, ``additionalProperties``; and the annotations
``title``, ``description``, ``default``, ``examples``, ``$comment``,
``$schema``. Under ``strict`` (OpenAI's rules) the root is an object, every
object sets ``additionalProperties: false`` and requires all its properties.
"""

from __future__ import annotations

from typing import Any

from ..errors import InvalidRequest

ANNOTATIONS = {"title", "description", "default", "examples", "$comment", "$schema"}
GENERIC = {"type", "enum", "const", "anyOf", "$ref", "$defs", "definitions"}
BY_TYPE = {
    "string": {"pattern", "format", "minLength", "maxLength"},
    "number": {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"},
    "integer": {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"},
    "array": {"items", "minItems", "maxItems"},
    "object": {"properties", "required", "additionalProperties"},
    "boolean": set(),
    "null": set(),
}
ALLOWED = ANNOTATIONS | GENERIC | set().union(*BY_TYPE.values())
FORMATS = {"date-time", "time", "date", "duration", "email", "hostname", "ipv4", "ipv6", "uuid"}

MAX_DEPTH = 10  # nesting of objects and arrays (OpenAI's limit)
MAX_PROPERTIES = 5000  # object properties in the whole schema (OpenAI's limit)
MAX_ENUM_VALUES = 1000  # enum values in the whole schema (OpenAI's limit)


class _Walk:
    """One pass over a schema, counting what OpenAI limits."""

    def __init__(self, param: str, strict: bool):
        self.param = param
        self.strict = strict
        self.num_properties = 0
        self.num_enum_values = 0

    def fail(self, where: str, message: str):
        raise InvalidRequest(f"Invalid JSON schema at {where}: {message}", param=self.param)

    def schema(self, node: Any, where: str, depth: int) -> None:
        if not isinstance(node, dict):
            self.fail(where, f"a schema must be an object, got {node!r}")
        for key in node:
            if key not in ALLOWED:
                self.fail(where, f"the keyword {key!r} is not supported (mola enforces OpenAI's "
                                 "structured-output subset of JSON Schema)")
        types = self._types(node, where)
        for key in node:
            owners = [t for t, keys in BY_TYPE.items() if key in keys]
            if owners and types and not set(owners) & types:
                self.fail(where, f"the keyword {key!r} applies to {'/'.join(owners)}, not to "
                                 f"type {'/'.join(sorted(types))}")
        if "format" in node and not (isinstance(node["format"], str) and node["format"] in FORMATS):
            self.fail(where, f"the string format {node['format']!r} is not supported; "
                             f"use one of {', '.join(sorted(FORMATS))}")
        if "enum" in node:
            if not isinstance(node["enum"], list) or not node["enum"]:
                self.fail(where, "'enum' must be a non-empty list")
            self.num_enum_values += len(node["enum"])
            if self.num_enum_values > MAX_ENUM_VALUES:
                self.fail(where, f"more than {MAX_ENUM_VALUES} enum values in the schema")
        if "$ref" in node and not (isinstance(node["$ref"], str) and node["$ref"].startswith("#")):
            self.fail(where, f"only local references ('#...') are supported, got {node['$ref']!r}")
        for key in ("$defs", "definitions"):
            if key in node:
                if not isinstance(node[key], dict):
                    self.fail(where, f"'{key}' must be an object")
                for name, sub in node[key].items():
                    self.schema(sub, f"{where}/{key}/{name}", depth)
        if "anyOf" in node:
            if not isinstance(node["anyOf"], list) or not node["anyOf"]:
                self.fail(where, "'anyOf' must be a non-empty list")
            for i, sub in enumerate(node["anyOf"]):
                self.schema(sub, f"{where}/anyOf/{i}", depth)
        self._children(node, where, depth, types)

    def _types(self, node: dict, where: str) -> set[str]:
        t = node.get("type")
        if t is None:
            return set()
        types = t if isinstance(t, list) else [t]
        for name in types:
            if not isinstance(name, str) or name not in BY_TYPE:
                self.fail(where, f"unknown type {name!r}")
        return set(types)

    def _children(self, node: dict, where: str, depth: int, types: set[str]) -> None:
        if depth > MAX_DEPTH:
            self.fail(where, f"the schema nests more than {MAX_DEPTH} levels")
        if "items" in node:
            self.schema(node["items"], f"{where}/items", depth + 1)
        is_object = "object" in types or "properties" in node
        if not is_object:
            return
        props = node.get("properties", {})
        if not isinstance(props, dict):
            self.fail(where, "'properties' must be an object")
        self.num_properties += len(props)
        if self.num_properties > MAX_PROPERTIES:
            self.fail(where, f"more than {MAX_PROPERTIES} object properties in the schema")
        required = node.get("required", [])
        if not isinstance(required, list) or any(not isinstance(r, str) or r not in props for r in required):
            self.fail(where, "'required' must list names of 'properties'")
        extra = node.get("additionalProperties", True)
        if self.strict:
            if extra is not False:
                self.fail(where, "strict schemas need 'additionalProperties': false on every object")
            missing = [p for p in props if p not in required]
            if missing:
                self.fail(where, f"strict schemas require every property; {missing[0]!r} is not "
                                 "in 'required' (make it nullable instead)")
        if isinstance(extra, dict):
            self.schema(extra, f"{where}/additionalProperties", depth + 1)
        elif not isinstance(extra, bool):
            self.fail(where, "'additionalProperties' must be a boolean or a schema")
        for name, sub in props.items():
            self.schema(sub, f"{where}/properties/{name}", depth + 1)


def check_schema(schema: Any, *, strict: bool, param: str) -> None:
    """Raise InvalidRequest naming the first keyword or rule outside OpenAI's
    subset (``param``: the request field the schema came from)."""
    walk = _Walk(param, strict)
    if strict and not (isinstance(schema, dict) and schema.get("type") == "object"):
        walk.fail("#", "the root of a strict schema must be an object ('type': 'object'), "
                       "not anyOf or another type")
    walk.schema(schema, "#", 1)
