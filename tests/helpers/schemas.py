"""OpenAI's schemas: responses and stream events validated against the official spec (tests/data/openai_schemas.json)."""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path


SCHEMAS = Path(__file__).parents[1] / "data" / "openai_schemas.json"


@lru_cache(maxsize=None)
def _validator(name: str):
    import jsonschema
    from referencing import Registry, Resource
    from referencing.jsonschema import DRAFT202012

    data = json.loads(SCHEMAS.read_text())
    doc = {"components": {"schemas": data["schemas"]}}
    registry = Registry().with_resource("urn:openai", Resource(doc, specification=DRAFT202012))
    schema = {"$ref": f"urn:openai#/components/schemas/{name}"}
    return jsonschema.Draft202012Validator(schema, registry=registry)


def validate_schema(name: str, payload: dict) -> None:
    """Raise jsonschema.ValidationError unless ``payload`` fits OpenAI's schema."""
    _validator(name).validate(payload)


@lru_cache(maxsize=None)
def _stream_event_schemas() -> dict[str, str]:
    """Event type ("response.output_text.delta") -> its schema's name, from
    the members of ResponseStreamEvent."""
    schemas = json.loads(SCHEMAS.read_text())["schemas"]
    out = {}
    for member in schemas["ResponseStreamEvent"]["anyOf"]:
        name = member["$ref"].rsplit("/", 1)[1]
        for kind in schemas[name]["properties"]["type"]["enum"]:
            out[kind] = name
    return out


def validate_stream_event(event: dict) -> str:
    """Validate a Responses stream event against ResponseStreamEvent and
    against the member schema its type names; returns that name."""
    name = _stream_event_schemas()[event["type"]]
    validate_schema("ResponseStreamEvent", event)
    validate_schema(name, event)
    return name


def sse_events(text: str) -> list:
    """Parse an SSE body into its JSON payloads; the final [DONE] as a string."""
    events = []
    for block in text.split("\n\n"):
        block = block.strip()
        if not block:
            continue
        assert block.startswith("data: "), block
        data = block[len("data: "):]
        events.append(data if data == "[DONE]" else json.loads(data))
    return events


def typed_events(text: str) -> list[dict]:
    """Parse a typed SSE body (Responses API): each block is `event: TYPE`
    then `data: JSON` whose "type" is TYPE; no [DONE]."""
    events = []
    for block in text.split("\n\n"):
        if not block.strip():
            continue
        head, data = block.strip().split("\n")
        assert head.startswith("event: ") and data.startswith("data: "), block
        event = json.loads(data[len("data: "):])
        assert event["type"] == head[len("event: "):], block
        events.append(event)
    return events
