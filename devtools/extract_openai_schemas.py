"""Extract the OpenAI response schemas mola's tests validate against.

Reads OpenAI's official openapi.yaml (../shared/openai-openapi/ beside the
checkout, or --spec), keeps the named schemas with everything they reference,
rewrites OpenAPI-3.0 `nullable: true` into JSON Schema's `anyOf [.., null]`,
and writes tests/data/openai_schemas.json. The tests read that file, so they
run wherever the checkout is; test_openai_schemas.py checks it is current.

    python devtools/extract_openai_schemas.py [--spec PATH] [--out PATH]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_SPEC = ROOT.parent / "shared" / "openai-openapi" / "openapi.yaml"
DEFAULT_OUT = ROOT / "tests" / "data" / "openai_schemas.json"
SCHEMAS = [
    "CreateChatCompletionResponse",
    "CreateChatCompletionStreamResponse",
    "CreateCompletionResponse",
    "ListModelsResponse",
    "Model",
    "ErrorResponse",
    "Response",  # POST /v1/responses
    "ResponseStreamEvent",  # its typed stream events (anyOf every event)
    "ImagesResponse",  # POST /v1/images/generations
]
PREFIX = "#/components/schemas/"


def refs(node) -> set[str]:
    found = set()
    if isinstance(node, dict):
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith(PREFIX):
            found.add(ref[len(PREFIX):])
        for v in node.values():
            found |= refs(v)
    elif isinstance(node, list):
        for v in node:
            found |= refs(v)
    return found


def nullable_to_anyof(node):
    if isinstance(node, dict):
        node = {k: nullable_to_anyof(v) for k, v in node.items()}
        if node.pop("nullable", False) is True:
            return {"anyOf": [node, {"type": "null"}]}
        return node
    if isinstance(node, list):
        return [nullable_to_anyof(v) for v in node]
    return node


def extract(spec: dict, names: list[str]) -> dict:
    schemas = spec["components"]["schemas"]
    keep, todo = {}, list(names)
    while todo:
        name = todo.pop()
        if name in keep:
            continue
        keep[name] = schemas[name]
        todo.extend(refs(schemas[name]) - set(keep))
    return {name: nullable_to_anyof(keep[name]) for name in sorted(keep)}


def build(spec_path: Path) -> dict:
    import yaml

    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml's, when PyYAML has it: ~10x faster
    spec = yaml.load(spec_path.read_text(), Loader=loader)
    return {
        "source": "openai/openai-openapi openapi.yaml (components/schemas), nullable rewritten as anyOf-null",
        "roots": SCHEMAS,
        "schemas": extract(spec, SCHEMAS),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spec", type=Path, default=DEFAULT_SPEC)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args()
    if not args.spec.is_file():
        print(f"no spec at {args.spec}", file=sys.stderr)
        return 1
    data = build(args.spec)
    args.out.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    print(f"wrote {len(data['schemas'])} schemas to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
