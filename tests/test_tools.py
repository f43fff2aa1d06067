"""Tool calls: the parser over mlx-lm's markers and parsers, and tools in the
chat template (mola/server/tools.py)."""

from __future__ import annotations

import json

import httpx
import pytest
from mlx_lm.utils import load_tokenizer

from mola.frontend.tools import ToolCallParser, messages_for_template

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    tok = load_tokenizer(tiny_model)
    assert tok.has_tool_calling and tok.tool_call_start == "<tool_call>"
    return tok


def run(tokenizer, text, chunk):
    p = ToolCallParser(tokenizer, TOOLS)
    content, calls = "", []
    for i in range(0, len(text), chunk):
        c, k = p.feed(text[i:i + chunk])
        content, calls = content + c, calls + k
    c, k = p.finish()
    return content + c, calls + k


@pytest.mark.parametrize("chunk", [1, 3, 7, 1000])
def test_calls_are_parsed_across_any_split(tokenizer, chunk):
    text = f"Let me check. {CALL}\n{CALL.replace('Paris', 'Rome')} done"
    content, calls = run(tokenizer, text, chunk)
    assert content == "Let me check. \n done"
    assert [c["function"]["name"] for c in calls] == ["get_weather", "get_weather"]
    assert [json.loads(c["function"]["arguments"]) for c in calls] == [{"city": "Paris"}, {"city": "Rome"}]
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in calls)
    assert len({c["id"] for c in calls}) == 2


def test_unparseable_call_is_returned_as_content(tokenizer):
    broken = '<tool_call>\n{"name": "get_weather", "arguments": {"city": \n</tool_call>'
    content, calls = run(tokenizer, "a " + broken, 5)
    assert calls == [] and content == "a " + broken


def test_call_cut_off_by_the_end_of_generation(tokenizer):
    content, calls = run(tokenizer, CALL[: -len("</tool_call>")], 4)  # no end marker
    assert [c["function"]["name"] for c in calls] == ["get_weather"] and content == ""
    content, calls = run(tokenizer, CALL[:20], 4)  # truncated mid-JSON: kept as text
    assert calls == [] and content == CALL[:20]


def test_plain_text_passes_through(tokenizer):
    assert run(tokenizer, "no tools <tool here", 2) == ("no tools <tool here", [])


def test_a_template_without_tool_calls_sees_them_as_a_text_part_after_list_content():
    """Content given as parts (a vision chat's) stays parts: the calls' JSON is one more text part."""
    msgs = [{"role": "assistant", "content": [{"type": "text", "text": "Looking."}],
             "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}]}]
    assert messages_for_template(msgs, "{{ m.content }}")[0]["content"] == [
        {"type": "text", "text": "Looking."}, {"type": "text", "text": '[{"name": "f", "arguments": {"x": 1}}]'}]
    assert messages_for_template(msgs, "{{ m.tool_calls }}")[0]["content"] == msgs[0]["content"]


def test_messages_for_template_parses_string_arguments():
    msgs = [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}]}]
    assert messages_for_template(msgs)[0]["tool_calls"][0]["function"]["arguments"] == {"x": 1}
    assert msgs[0]["tool_calls"][0]["function"]["arguments"] == '{"x": 1}'  # not mutated


def test_tools_reach_the_chat_template(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        base = {"model": "tiny", "messages": [{"role": "user", "content": "Weather in Paris?"}],
                "max_tokens": 2}
        plain = c.post("/v1/chat/completions", json=base).json()
        with_tools = c.post("/v1/chat/completions", json={**base, "tools": TOOLS}).json()
        assert with_tools["usage"]["prompt_tokens"] > plain["usage"]["prompt_tokens"] + 20
        history = {**base, "tools": TOOLS, "messages": [
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]}
        r = c.post("/v1/chat/completions", json=history)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens"] > with_tools["usage"]["prompt_tokens"]
