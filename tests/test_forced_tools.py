"""Forced tool calls on a model whose chat template has no tool syntax (a
plain ChatML template, as SmolLM2's): the output is held to bare JSON
(mola/structured/grammar.py) and read back as tool calls
(mola/server/tools.JsonCallParser), in chat, streamed or not, in the
Responses API, alone and in a batch with free rows and adapters; the OpenAI
SDK round-trips a tool result. Random walks through the grammar are the
oracle: whatever the masks allow must parse into calls whose arguments
validate against the tool's schema."""

from __future__ import annotations

import asyncio
import json

import httpx
import jsonschema
import numpy as np
import openai
import pytest
from mlx_lm.utils import load_tokenizer

from mola.config import AdapterSpec
from mola.frontend.prompts import render_messages
from mola.frontend.tools import JsonCallParser, messages_for_template
from mola.structured import JsonCalls, StructuredOutputs

from helpers.references import grammar_walks
from helpers.schemas import sse_events, typed_events, validate_schema, validate_stream_event
from helpers.servers import start_server
from helpers.tokenizers import with_chat_template

# SmolLM2-135M-Instruct's template, in effect: ChatML, no tools, no tool calls.
PLAIN_CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] "
                "+ '<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
                "{% endif %}")
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Rome", "Oslo"]},
                                     "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string", "maxLength": 5}}, "required": ["zone"],
    "additionalProperties": False}}}
TOOLS = [WEATHER, TIME]
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
NAMED = {"type": "function", "function": {"name": "get_time"}}
QUESTIONS = ["What is the weather like in Rome this week?", "hi", "What time is it in Oslo?"]


def check_calls(calls, names=tuple(PARAMS)):
    assert calls
    for call in calls:
        fn = call["function"]
        assert fn["name"] in names and call["type"] == "function" and call["id"].startswith("call_")
        jsonschema.validate(json.loads(fn["arguments"]), PARAMS[fn["name"]])


@pytest.fixture(scope="module")
def plain_model(tiny_model, tmp_path_factory):
    return with_chat_template(tiny_model, tmp_path_factory.mktemp("plain") / "plain", PLAIN_CHATML)


@pytest.fixture(scope="module")
def tokenizer(plain_model):
    tok = load_tokenizer(plain_model)
    assert not tok.has_tool_calling  # no tool syntax, no parser
    return tok


# ---- the grammar, walked -----------------------------------------------------------------------


def read_calls(json_calls, text, cuts=()) -> tuple[str, list[dict]]:
    p, content, calls, at = JsonCallParser(json_calls), "", [], 0
    for cut in [*cuts, len(text)]:
        c, k = p.feed(text[at:cut])
        content, calls, at = content + c, calls + k, cut
    c, k = p.finish()
    return content + c, calls + k


@pytest.mark.parametrize("choice, parallel", [("required", None), ("required", False), (NAMED, None)])
def test_every_walk_through_the_grammar_reads_back_as_valid_calls(tokenizer, choice, parallel):
    compiled = StructuredOutputs(tokenizer, len(tokenizer._tokenizer)).for_request(
        tools=TOOLS, tool_choice=choice, parallel_tool_calls=parallel)
    json_calls = compiled.grammar.json_calls
    assert json_calls == JsonCalls("get_time" if isinstance(choice, dict) else None)
    counts = set()
    for text in grammar_walks(compiled, tokenizer, np.random.default_rng(0), max_tokens=200):
        content, calls = read_calls(json_calls, text)
        assert content == "", text
        check_calls(calls, ["get_time"] if isinstance(choice, dict) else PARAMS)
        counts.add(len(calls))
        if isinstance(choice, dict):
            assert calls[0]["function"]["arguments"] == text  # the output is the arguments
    assert counts == {1} if parallel is False or isinstance(choice, dict) else max(counts) > 1


def test_a_list_of_calls_streams_each_call_as_it_closes():
    text = ('[{"name": "get_weather", "arguments": {"city": "Rome", "days": 2}}, '
            '{"name": "get_time", "arguments": {"zone": "CET"}}]')
    first_closes = text.index("}}") + 2
    for cuts in [(), range(1, len(text)), *([c] for c in range(len(text) + 1))]:
        content, calls = read_calls(JsonCalls(None), text, cuts)
        assert content == "" and [json.loads(c["function"]["arguments"]) for c in calls] == [
            {"city": "Rome", "days": 2}, {"zone": "CET"}], cuts
    p = JsonCallParser(JsonCalls(None))
    assert p.feed(text[:first_closes - 1]) == ("", [])
    assert [c["function"]["name"] for c in p.feed(text[first_closes - 1:first_closes])[1]] == ["get_weather"]


def test_output_cut_off_is_kept_as_text():
    text = '[{"name": "get_weather", "arguments": {"city": "Rome", "days": 2}}, {"name": "get_ti'
    content, calls = read_calls(JsonCalls(None), text)
    assert [c["function"]["name"] for c in calls] == ["get_weather"] and content == '{"name": "get_ti'
    assert read_calls(JsonCalls("get_time"), '{"zone": "CE') == ('{"zone": "CE', [])
    assert read_calls(JsonCalls(None), "") == ("", [])


def test_a_template_without_tool_syntax_sees_earlier_calls_as_that_json(tokenizer):
    history = [{"role": "user", "content": "Weather in Rome?"},
               {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "type": "function", "function": {
                   "name": "get_weather", "arguments": '{"city": "Rome", "days": 2}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]
    fixed = messages_for_template(history, PLAIN_CHATML)
    assert fixed[1]["content"] == '[{"name": "get_weather", "arguments": {"city": "Rome", "days": 2}}]'
    assert messages_for_template(history, "{{ message.tool_calls }}")[1]["content"] == ""  # reads them itself
    prompt = tokenizer.decode(render_messages(tokenizer, history, TOOLS, False, "messages", None, 64))
    assert ('<|im_start|>assistant\n[{"name": "get_weather", "arguments": {"city": "Rome", "days": 2}}]<|im_end|>\n'
            '<|im_start|>tool\nsunny, 21 C<|im_end|>\n<|im_start|>assistant\n') in prompt


# ---- through the server ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(plain_model, adapters):
    handle = start_server(model=str(plain_model), served_model_name="plain", max_loras=2, max_lora_rank=16,
                          adapters=(AdapterSpec("a", str(adapters["a"])),))
    yield handle
    handle.stop()


def body(question=QUESTIONS[0], model="plain", **extra):
    return {"model": model, "messages": [{"role": "user", "content": question}], "temperature": 0,
            "max_tokens": 300, "tools": TOOLS, **extra}


@pytest.mark.parametrize("choice, parallel", [("required", None), ("required", False), (NAMED, None)])
def test_chat_returns_forced_calls(client, choice, parallel):
    extra = {"tool_choice": choice} | ({} if parallel is None else {"parallel_tool_calls": parallel})
    for question in QUESTIONS:
        r = client.post("/v1/chat/completions", json=body(question, **extra))
        assert r.status_code == 200, r.text
        validate_schema("CreateChatCompletionResponse", r.json())
        choice_ = r.json()["choices"][0]
        assert choice_["finish_reason"] == "tool_calls" and choice_["message"]["content"] is None
        calls = choice_["message"]["tool_calls"]
        check_calls(calls, ["get_time"] if isinstance(choice, dict) else PARAMS)
        if parallel is False or isinstance(choice, dict):
            assert len(calls) == 1


def test_streamed_calls_match_and_fit_the_schema(client):
    plain = client.post("/v1/chat/completions", json=body(tool_choice="required")).json()
    r = client.post("/v1/chat/completions", json=body(tool_choice="required", stream=True,
                                                      stream_options={"include_usage": True}))
    chunks = sse_events(r.text)
    assert chunks[-1] == "[DONE]"
    calls = []
    for chunk in chunks[:-1]:
        validate_schema("CreateChatCompletionStreamResponse", chunk)
        for choice in chunk["choices"]:
            calls += choice["delta"].get("tool_calls") or []
    assert [c["index"] for c in calls] == list(range(len(calls)))
    assert [c["function"] for c in calls] == [c["function"] for c in plain["choices"][0]["message"]["tool_calls"]]
    assert chunks[-2]["usage"]["completion_tokens"] == plain["usage"]["completion_tokens"]


def test_auto_still_needs_a_parser(client):
    r = client.post("/v1/chat/completions", json=body(tool_choice="auto"))
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools"
    assert "no tool-call parser" in r.json()["error"]["message"]
    assert client.post("/v1/chat/completions", json=body(tool_choice="none", max_tokens=4)).status_code == 200


def test_forced_rows_do_not_depend_on_the_batch(server):
    jobs = [body(q, model=m, tool_choice=c) for m in ("plain", "a") for q in QUESTIONS for c in ("required", NAMED)]
    jobs += [{k: v for k, v in body(q, model=m, max_tokens=20).items() if k != "tools"}
             for m in ("plain", "a") for q in QUESTIONS]  # free rows

    async def go(bodies):
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as c:
            rs = await asyncio.gather(*(c.post("/v1/chat/completions", json=b) for b in bodies))
            return [r.json()["choices"][0] for r in rs]

    def strip(choice):
        m = choice["message"]
        return m["content"], [c["function"] for c in m.get("tool_calls") or []], choice["finish_reason"]

    alone = [strip(asyncio.run(go([b]))[0]) for b in jobs]
    together = [strip(c) for c in asyncio.run(go(jobs))]
    assert together == alone
    assert all(a[2] == "tool_calls" for a, j in zip(alone, jobs) if "tool_choice" in j)
    for (_, calls, _), job in zip(alone, jobs):
        if "tool_choice" in job:
            check_calls([{"id": "call_x", "type": "function", "function": f} for f in calls])
    assert server.engine.snapshot.stats.masked_steps > 0


def test_the_sdk_round_trips_a_required_call_and_its_result(server, tokenizer):
    sdk = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                        _strict_response_validation=True)
    messages = [{"role": "user", "content": QUESTIONS[0]}]
    r = sdk.chat.completions.create(model="plain", messages=messages, tools=TOOLS, tool_choice="required",
                                    parallel_tool_calls=False, temperature=0, max_tokens=100)
    message = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and len(message.tool_calls) == 1
    call = message.tool_calls[0]
    check_calls([call.model_dump()])
    messages += [message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}]
    again = sdk.chat.completions.create(model="plain", messages=messages, tools=TOOLS, tool_choice="required",
                                        temperature=0, max_tokens=300)
    check_calls([c.model_dump() for c in again.choices[0].message.tool_calls])
    answer = sdk.chat.completions.create(model="plain", messages=messages, temperature=0, max_tokens=8)
    assert answer.choices[0].message.content is not None
    # what the model was shown: its call, as the JSON it wrote it in, then the result
    prompt = tokenizer.decode(render_messages(tokenizer, messages, TOOLS, False, "messages", None, 64))
    args = json.loads(call.function.arguments)
    assert json.dumps([{"name": call.function.name, "arguments": args}]) in prompt and "sunny, 21 C" in prompt
    assert answer.usage.prompt_tokens > r.usage.prompt_tokens + 20


def test_responses_api_forces_calls_without_tool_syntax(client):
    tools = [{"type": "function", "name": t["function"]["name"], "parameters": t["function"]["parameters"]}
             for t in TOOLS]
    req = {"model": "plain", "input": QUESTIONS[0], "tools": tools, "temperature": 0, "max_output_tokens": 100,
           "tool_choice": {"type": "function", "name": "get_weather"}}
    r = client.post("/v1/responses", json=req)
    assert r.status_code == 200, r.text
    validate_schema("Response", r.json())
    items = r.json()["output"]
    assert [i["type"] for i in items] == ["function_call"]
    check_calls([{"id": items[0]["call_id"], "type": "function",
                  "function": {"name": items[0]["name"], "arguments": items[0]["arguments"]}}], ["get_weather"])
    events = typed_events(client.post("/v1/responses", json={**req, "stream": True}).text)
    for event in events:
        validate_stream_event(event)
    done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    assert [(i["name"], i["arguments"]) for i in done] == [(items[0]["name"], items[0]["arguments"])]
    out = client.post("/v1/responses", json={**req, "previous_response_id": r.json()["id"], "input": [
        {"type": "function_call_output", "call_id": items[0]["call_id"], "output": "sunny"}], "tool_choice": "required",
        "parallel_tool_calls": False})
    assert out.status_code == 200 and [i["type"] for i in out.json()["output"]] == ["function_call"]
