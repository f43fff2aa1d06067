"""Requests -> grammars (mola/structured/grammar.py, compiler.py), checked
against oracles that do not share llguidance's code: random walks through
each grammar's masks must give text that json.loads and jsonschema accept,
or tool calls that mlx-lm's own parser for the family reads; what a chat
template renders must be accepted; valid instances are accepted and invalid
ones refused."""

from __future__ import annotations

import json

import jsonschema
import numpy as np
import pytest
from mlx_lm.utils import load_tokenizer

from mola.errors import InvalidRequest
from mola.frontend.tools import ToolCallParser
from mola.structured import JsonCalls, StructuredOutputs

from helpers.references import grammar_walks
from helpers.tokenizers import MISTRAL_TEMPLATE, MISTRAL_V3_TEMPLATE, PYTHONIC_TEMPLATE, with_chat_template

ADDRESS = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome", "Oslo"]},
                                            "zip": {"type": ["string", "null"], "pattern": "^[0-9]{5}$"}},
           "required": ["city", "zip"], "additionalProperties": False}
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
        "score": {"type": "number", "minimum": -1, "maximum": 1},
        "born": {"type": "string", "format": "date"},
        "home": {"$ref": "#/$defs/address"},
        "friends": {"type": "array", "items": {"anyOf": [{"type": "string", "maxLength": 4}, {"type": "null"}]},
                    "maxItems": 2},
    },
    "required": ["name", "age", "score", "born", "home", "friends"],
    "additionalProperties": False,
    "$defs": {"address": ADDRESS},
}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}, "days": {"type": "integer",
                                                                                   "minimum": 1, "maximum": 7}},
    "required": ["city", "days"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string", "maxLength": 6}}, "required": ["zone"],
    "additionalProperties": False}}}
NOW = {"type": "function", "function": {"name": "now"}}  # no parameters
TOOLS = [WEATHER, TIME, NOW]
PARAMS = {t["function"]["name"]: t["function"].get("parameters", {"type": "object", "maxProperties": 0})
          for t in TOOLS}


def fmt(schema):
    return {"type": "json_schema", "json_schema": {"name": "s", "schema": schema, "strict": True}}


@pytest.fixture(scope="module")
def tokenizers(tiny_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    out = {"json_tools": load_tokenizer(tiny_model)}
    for name, template in (("mistral", MISTRAL_TEMPLATE), ("mistral_v3", MISTRAL_V3_TEMPLATE),
                           ("pythonic", PYTHONIC_TEMPLATE)):
        out[name] = load_tokenizer(with_chat_template(tiny_model, root / name, template))
    return out




def calls_of(tokenizer, tools, text):
    parser = ToolCallParser(tokenizer, tools)
    content, calls = parser.feed(text)
    more_content, more_calls = parser.finish()
    return (content + more_content), calls + more_calls


def test_random_walks_through_a_json_schema_validate(tokenizers):
    tok = tokenizers["json_tools"]
    compiled = StructuredOutputs(tok, len(tok._tokenizer)).for_request(response_format=fmt(PERSON))
    validator = jsonschema.Draft202012Validator(PERSON, format_checker=jsonschema.FormatChecker())
    for text in grammar_walks(compiled, tok, np.random.default_rng(0)):
        validator.validate(json.loads(text))


def test_json_object_walks_are_objects(tokenizers):
    tok = tokenizers["json_tools"]
    compiled = StructuredOutputs(tok, len(tok._tokenizer)).for_request(response_format={"type": "json_object"})
    for text in grammar_walks(compiled, tok, np.random.default_rng(1)):
        assert isinstance(json.loads(text), dict)


def accepts(compiled, tokenizer, text) -> bool:
    m = compiled.matcher.deep_copy()
    ids = tokenizer.encode(text, add_special_tokens=False)
    return m.try_consume_tokens(ids) == len(ids) and m.is_accepting()


def test_valid_instances_are_accepted_and_invalid_ones_refused(tokenizers):
    tok = tokenizers["json_tools"]
    compiled = StructuredOutputs(tok, len(tok._tokenizer)).for_request(response_format=fmt(ADDRESS))
    assert accepts(compiled, tok, json.dumps({"city": "Rome", "zip": "00184"}))
    assert accepts(compiled, tok, json.dumps({"city": "Oslo", "zip": None}))
    for bad in ({"city": "Lyon", "zip": None}, {"city": "Rome", "zip": "1"}, {"zip": None, "city": "Rome"},
                {"city": "Rome", "zip": None, "extra": 1}):
        assert not accepts(compiled, tok, json.dumps(bad)), bad


@pytest.mark.parametrize("family", ["json_tools", "mistral", "mistral_v3"])
@pytest.mark.parametrize("choice, parallel", [("required", None), ("required", False),
                                              ({"type": "function", "function": {"name": "get_time"}}, None)])
def test_forced_tool_calls_parse_with_the_familys_own_parser(tokenizers, family, choice, parallel):
    tok = tokenizers[family]
    compiled = StructuredOutputs(tok, len(tok._tokenizer)).for_request(
        tools=TOOLS, tool_choice=choice, parallel_tool_calls=parallel)
    names = {"get_time"} if isinstance(choice, dict) else set(PARAMS)
    counts = set()
    for text in grammar_walks(compiled, tok, np.random.default_rng(2)):
        content, calls = calls_of(tok, TOOLS, text)
        assert calls and not content.strip(), text
        counts.add(len(calls))
        for call in calls:
            name = call["function"]["name"]
            assert name in names
            jsonschema.validate(json.loads(call["function"]["arguments"]), PARAMS[name])
    assert counts == {1} if parallel is False else max(counts) > 1


@pytest.mark.parametrize("family", ["json_tools", "mistral", "mistral_v3"])
def test_calls_as_the_chat_template_renders_them_are_accepted(tokenizers, family):
    tok = tokenizers[family]
    compiled = StructuredOutputs(tok, len(tok._tokenizer)).for_request(tools=TOOLS, tool_choice="required")
    calls = [{"type": "function", "id": "c1", "function": {"name": "get_weather",
                                                            "arguments": {"city": "Rome", "days": 3}}},
             {"type": "function", "id": "c2", "function": {"name": "get_time", "arguments": {"zone": "CET"}}}]
    user = [{"role": "user", "content": "weather and time in Rome?"}]
    prompt = tok.apply_chat_template(user, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    full = tok.apply_chat_template(user + [{"role": "assistant", "content": "", "tool_calls": calls}],
                                   tools=TOOLS, tokenize=False)
    assert full.startswith(prompt)
    rendered = full[len(prompt):].split("<|im_end|>")[0].rstrip("\n")
    assert accepts(compiled, tok, rendered), rendered


def test_auto_with_a_format_is_a_call_or_the_format(tokenizers):
    tok = tokenizers["json_tools"]
    compiled = StructuredOutputs(tok, len(tok._tokenizer)).for_request(
        response_format=fmt(ADDRESS), tools=TOOLS, tool_choice="auto")
    kinds = set()
    for text in grammar_walks(compiled, tok, np.random.default_rng(3), num=40):
        content, calls = calls_of(tok, TOOLS, text)
        if calls:
            kinds.add("calls")
        else:
            jsonschema.validate(json.loads(content), ADDRESS)
            kinds.add("json")
    assert kinds == {"calls", "json"}


def test_free_requests_have_no_grammar(tokenizers):
    s = StructuredOutputs(tokenizers["json_tools"], 512)
    assert s.for_request() is None
    assert s.for_request(response_format={"type": "text"}, tools=TOOLS, tool_choice="auto") is None
    # tool_choice auto does not hold tool schemas to the subset (they are not enforced)
    loose = [{"type": "function", "function": {"name": "f", "parameters": {"allOf": []}}}]
    assert s.for_request(tools=loose, tool_choice="auto") is None


@pytest.mark.parametrize("kwargs, words", [
    (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}), "'nope'"),
    (dict(tool_choice="required"), "needs 'tools'"),
    (dict(tools=[WEATHER, WEATHER], tool_choice="required"), "Two tools are named 'get_weather'"),
    (dict(tools=[{"type": "web_search"}], tool_choice="required"), "'web_search'"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {"not": {}}}}],
          tool_choice="required"), "'not'"),
    (dict(response_format={"type": "yaml"}), "'yaml'"),
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "x"}}), "needs a 'schema'"),
    (dict(response_format=fmt({"type": "object", "properties": {"a": {"type": "string", "pattern": "(?=a)b"}},
                               "required": ["a"], "additionalProperties": False})), "look-around"),
])
def test_what_cannot_be_constrained_is_refused(tokenizers, kwargs, words):
    with pytest.raises(InvalidRequest) as e:
        StructuredOutputs(tokenizers["json_tools"], 512).for_request(**kwargs)
    assert words in e.value.message


def test_a_family_without_a_grammar_forces_bare_json_but_offers_no_call_beside_a_format(tokenizers):
    s = StructuredOutputs(tokenizers["pythonic"], 512)
    assert s.for_request(tools=TOOLS, tool_choice="required").grammar.json_calls == JsonCalls(None)
    with pytest.raises(InvalidRequest) as e:
        s.for_request(tools=TOOLS, tool_choice="auto", response_format=fmt(ADDRESS))
    assert "pythonic" in e.value.message and e.value.param == "tool_choice"


def test_compiled_grammars_are_cached(tokenizers):
    s = StructuredOutputs(tokenizers["json_tools"], 512)
    first = s.for_request(response_format=fmt(PERSON))
    assert s.for_request(response_format=fmt(PERSON)) is first
    a, b = first.new_constraint(), first.new_constraint()
    a.advance(tokenizers["json_tools"].encode("{", add_special_tokens=False)[0])
    assert a.num_tokens == 1 and b.num_tokens == 0 and a.matcher is not b.matcher
