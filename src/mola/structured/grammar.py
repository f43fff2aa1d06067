"""Requests -> llguidance grammars: ``response_format`` (json_object,
json_schema) and ``tool_choice`` "required" or a named function, in the
model family's own tool-call syntax (the one mlx-lm's tool parser for its
chat template reads).

Both chat's shapes (``{"type": "json_schema", "json_schema": {...}}``,
``{"type": "function", "function": {...}}``) and the Responses API's flat
ones (``{"type": "json_schema", "name", "schema", "strict"}``,
``{"type": "function", "name", ...}``) are read.

A model whose template has no tool syntax mola has a grammar for still gets
forced calls, as bare JSON (what vLLM's guided decoding does): a named
function's ``arguments`` object, or under "required" a list of
``{"name", "arguments"}`` (:class:`JsonCalls` says how to read them back).
A thinking model's grammar lets the thinking run free up to its end marker
and constrains only the answer after it (:class:`Thinking`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Callable

from ..errors import InvalidRequest
from .schema import check_schema

# JSON as json.dumps writes it: ", " and ": ", no other whitespace, so that a
# model cannot wander into endless whitespace.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
ANY_OBJECT = {"type": "object"}
NO_ARGUMENTS = {"type": "object", "properties": {}, "additionalProperties": False}

# A marker's text -> its Lark form (a literal, or a special token's id).
Literal = Callable[[str], str]


@dataclass(frozen=True)
class Grammar:
    """A grammar in llguidance's Lark dialect, and what it constrains."""

    lark: str
    kind: str  # "json_object", "json_schema", "tool_calls", or "json_schema|tool_calls"
    param: str  # the request field it came from (named in compile errors)
    json_calls: JsonCalls | None = None  # forced calls written as bare JSON (no family syntax)


@dataclass(frozen=True)
class JsonCalls:
    """Forced calls in bare JSON: the output is the arguments of ``name``, or
    (name None) a JSON list of ``{"name", "arguments"}``."""

    name: str | None


@dataclass(frozen=True)
class Thinking:
    """What a thinking model writes before its constrained answer.

    ``rules`` define the Lark rule ``thinking`` (free text and the marker that
    ends it); ``content`` is the Lark that opens a content answer after it
    (harmony's final-channel header; empty for <think> tags); ``tool_family``
    names the syntax the format writes tool calls in, when it has its own
    (harmony), else the template's family applies."""

    rules: str
    content: str = ""
    tool_family: str | None = None


def until(name: str, marker: str, literal: Literal) -> str:
    """Lark rule ``name``: any text, up to and including the first ``marker``
    (a special token ends a free terminal; a text marker is a lazy suffix)."""
    lark = literal(marker)
    if lark.startswith("<["):
        return f"{name}: /(?s:.*)/ {lark}\n"
    return f"{name}[suffix={json.dumps(marker, ensure_ascii=False)}]: /(?s:.*)/\n"


def _json(schema: dict) -> str:
    return "%json " + json.dumps({**schema, "x-guidance": JSON_OPTIONS}, ensure_ascii=False)


# ---- response_format ----------------------------------------------------------------------


def format_schema(fmt: Any, param: str = "response_format") -> tuple[str, dict] | None:
    """(kind, JSON schema) of a response_format / text.format; None for text."""
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise InvalidRequest(f"{param} must be an object, got {fmt!r}.", param=param)
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return kind, ANY_OBJECT
    if kind != "json_schema":
        raise InvalidRequest(f"{param} of type {kind!r} is not supported; use 'text', "
                             "'json_object' or 'json_schema'.", param=param)
    spec = fmt.get("json_schema", fmt)  # chat nests it; the Responses API does not
    if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
        raise InvalidRequest(f"{param} of type 'json_schema' needs a 'schema' object.", param=param)
    name = spec.get("name")
    if name is not None and not (isinstance(name, str) and name):
        raise InvalidRequest(f"{param}: 'name' must be a non-empty string, got {name!r}.", param=param)
    strict = spec.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise InvalidRequest(f"{param}: 'strict' must be a boolean, got {strict!r}.", param=param)
    check_schema(spec["schema"], strict=bool(strict), param=param)
    return kind, spec["schema"]


# ---- tools -----------------------------------------------------------------------------


def _functions(tools: list[dict]) -> dict[str, tuple[dict, str]]:
    """name -> (parameters schema, where it came from), for every function tool."""
    out: dict[str, tuple[dict, str]] = {}
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else tool
            raise InvalidRequest(f"tools[{i}] of type {kind!r} is not supported; only "
                                 "'function' tools are.", param=f"tools[{i}]")
        fn = tool.get("function", tool)  # chat nests it; the Responses API does not
        name = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(name, str) or not name:
            raise InvalidRequest(f"tools[{i}] needs a function name.", param=f"tools[{i}]")
        if name in out:
            raise InvalidRequest(f"Two tools are named {name!r}.", param=f"tools[{i}]")
        where = f"tools[{i}].function.parameters" if "function" in tool else f"tools[{i}].parameters"
        params = fn.get("parameters") or NO_ARGUMENTS
        check_schema(params, strict=bool(fn.get("strict", tool.get("strict"))), param=where)
        out[name] = (params, where)
    return out


def choice_names(tool_choice: Any, functions: dict) -> list[str] | None:
    """The functions a tool_choice forces (None: calls are not forced)."""
    if tool_choice in (None, "auto", "none"):
        return None
    if tool_choice == "required":
        return list(functions)
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "function":
        fn = tool_choice.get("function", tool_choice)
        name = fn.get("name") if isinstance(fn, dict) else None
        if name not in functions:
            raise InvalidRequest(f"tool_choice names the function {name!r}, which is not among "
                                 f"the tools ({', '.join(functions) or 'none'}).", param="tool_choice")
        return [name]
    raise InvalidRequest(f"Invalid tool_choice {tool_choice!r}; use 'auto', 'none', 'required' or "
                         "{'type': 'function', 'function': {'name': ...}}.", param="tool_choice")


def _call_object(name: str, params: dict) -> dict:
    return {"type": "object", "properties": {"name": {"const": name}, "arguments": params},
            "required": ["name", "arguments"], "additionalProperties": False}


def _json_tools(functions: dict, names: list[str], many: bool, literal: Literal, template: str) -> str:
    """Qwen2.5 / Hermes: <tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>."""
    calls = [_call_object(n, functions[n][0]) for n in names]
    body = calls[0] if len(calls) == 1 else {"anyOf": calls}
    start = "call (\"\\n\" call)*" if many else "call"
    return (f"start: {start}\n"
            f"call: {literal('<tool_call>')} \"\\n\" {_json(body)} \"\\n\" {literal('</tool_call>')}\n")


def _mistral(functions: dict, names: list[str], many: bool, literal: Literal, template: str) -> str:
    """Mistral: [TOOL_CALLS]name[ARGS]{...} (v11+ templates), or
    [TOOL_CALLS][{"name": ..., "arguments": ...}] (older ones)."""
    tc = literal("[TOOL_CALLS]")
    if "[ARGS]" in template:
        alts = " | ".join(f"fn{i}" for i in range(len(names)))
        rules = "".join(f"fn{i}: {json.dumps(n)} {literal('[ARGS]')} {_json(functions[n][0])}\n"
                        for i, n in enumerate(names))
        start = f"call ({tc} call)*" if many else "call"
        return f"start: {tc} {start}\ncall: {alts}\n{rules}"
    calls = [_call_object(n, functions[n][0]) for n in names]
    items = calls[0] if len(calls) == 1 else {"anyOf": calls}
    array = {"type": "array", "items": items, "minItems": 1, **({} if many else {"maxItems": 1})}
    return f"start: {tc} {_json(array)}\n"


def _harmony(functions: dict, names: list[str], many: bool, literal: Literal, template: str) -> str:
    """gpt-oss (harmony), as its template renders a call after "<|start|>assistant":
    " to=functions.NAME<|channel|>commentary json<|message|>{...}"; the call
    token that follows ends the generation, so one call per turn."""
    channel, message = literal("<|channel|>"), literal("<|message|>")
    alts = " | ".join(f"fn{i}" for i in range(len(names)))
    rules = "".join(f"fn{i}: {json.dumps(' to=functions.' + n)} {channel} \"commentary json\" {message} "
                    f"{_json(functions[n][0])}\n" for i, n in enumerate(names))
    return f"start: {alts}\n{rules}"


def _json_calls(functions: dict, names: list[str], many: bool) -> tuple[str, JsonCalls]:
    """Bare JSON, for templates without a tool syntax mola knows: a list of
    one or more {"name", "arguments"} (exactly one unless ``many``)."""
    calls = [_call_object(n, functions[n][0]) for n in names]
    items = calls[0] if len(calls) == 1 else {"anyOf": calls}
    array = {"type": "array", "items": items, "minItems": 1, **({} if many else {"maxItems": 1})}
    return f"start: {_json(array)}\n", JsonCalls(None)


# mlx-lm tool parser (module name) -> the grammar of its calls; "harmony" is
# gpt-oss's, which mola's reasoning parser reads (mlx-lm has no parser for it).
FAMILIES = {"json_tools": _json_tools, "mistral": _mistral, "harmony": _harmony}


def tool_family(tokenizer) -> str | None:
    parser = getattr(tokenizer, "tool_parser", None)
    return parser.__module__.rsplit(".", 1)[-1] if parser is not None else None


def _calls_rule(tokenizer, tools, names, parallel, literal, family: str | None = None,
                named: bool = False) -> tuple[str, JsonCalls | None]:
    """Lark rule ``calls`` for forced calls to ``names`` (``named``: one
    function was named), in the family's syntax where mola has a grammar for
    it, else as bare JSON."""
    family = family or tool_family(tokenizer)
    build = FAMILIES.get(family)
    if build is None:
        if named:
            lark, json_calls = f"start: {_json(tools[names[0]][0])}\n", JsonCalls(names[0])
        else:
            lark, json_calls = _json_calls(tools, names, parallel is not False)
    else:
        template = tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else ""
        lark, json_calls = build(tools, names, parallel is not False, literal, template), None
    return lark.replace("start:", "calls:", 1), json_calls


# ---- the whole request -----------------------------------------------------------------------


def grammar_for(tokenizer, literal: Literal, *, response_format: Any = None,
                tools: list[dict] | None = None, tool_choice: Any = None,
                parallel_tool_calls: bool | None = None,
                format_param: str = "response_format",
                thinking: Thinking | None = None) -> Grammar | None:
    """The grammar a request's output must follow, or None when it is free.
    With ``thinking``, the grammar lets the thinking run free first and
    constrains what follows it. Raises InvalidRequest naming what cannot be
    constrained."""
    fmt = format_schema(response_format, format_param)
    use_tools = bool(tools) and tool_choice != "none"
    forced = tool_choice not in (None, "auto", "none")
    if forced and not tools:
        raise InvalidRequest(f"tool_choice {tool_choice!r} needs 'tools'.", param="tool_choice")
    if not forced and fmt is None:
        return None  # free text (tool calls under "auto" are free too)
    functions = _functions(tools) if use_tools else {}
    names = choice_names(tool_choice, functions) if forced else None
    family = thinking.tool_family if thinking else None
    if names is not None:  # calls are forced: the format applies to no content
        calls, json_calls = _calls_rule(tokenizer, functions, names, parallel_tool_calls, literal, family,
                                        named=isinstance(tool_choice, dict))
        return _after(thinking, Grammar("start: calls\n" + calls, "tool_calls", "tool_choice", json_calls))
    if fmt is None:
        return None
    kind, schema = fmt
    content = f"{thinking.content} {_json(schema)}" if thinking and thinking.content else _json(schema)
    if functions:  # tool_choice auto: a call, or content in the format
        if (family or tool_family(tokenizer)) not in FAMILIES:
            raise InvalidRequest(
                f"This model's tool-call format ({tool_family(tokenizer) or 'none'}: mlx-lm's parser for "
                f"its chat template) has no grammar in mola, so a call cannot be offered beside "
                f"{format_param}; supported formats: {', '.join(FAMILIES)}. Force the call (tool_choice "
                "'required' or a function) or leave out the tools.", param="tool_choice")
        calls, _ = _calls_rule(tokenizer, functions, list(functions), parallel_tool_calls, literal, family)
        return _after(thinking, Grammar(f"start: {content} | calls\n" + calls, f"{kind}|tool_calls",
                                        format_param))
    return _after(thinking, Grammar(f"start: {content}\n", kind, format_param))


def _after(thinking: Thinking | None, grammar: Grammar) -> Grammar:
    """``grammar`` behind free thinking: start is thinking, then the answer."""
    if thinking is None:
        return grammar
    lark = "start: thinking answer\n" + thinking.rules + grammar.lark.replace("start:", "answer:", 1)
    return Grammar(lark, grammar.kind, grammar.param, grammar.json_calls)
