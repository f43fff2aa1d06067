"""The four text dialects' protocol through the real app, in process: a
scripted engine (helpers/scripted.py) behind create_app, driven through
httpx.ASGITransport. No model, no port: answers, streams, usage, errors,
backpressure and the order of admission (a refused request costs no
tokenizer work; an admitted one makes one trip to the tokenizer thread)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Callable

import anthropic
import pydantic
import pytest
from anthropic.types import RawMessageStreamEvent
from anthropic.types.shared import ErrorResponse

from helpers.schemas import sse_events, typed_events, validate_schema, validate_stream_event
from helpers.scripted import ScriptedEngine, client, tokenizer_model

MESSAGE = anthropic.types.Message
RAW_EVENT = pydantic.TypeAdapter(RawMessageStreamEvent)
ANTHROPIC_ERROR = pydantic.TypeAdapter(ErrorResponse)
USER = [{"role": "user", "content": "Hello there, how are you?"}]


@dataclass(frozen=True)
class Dialect:
    name: str
    path: str
    body: Callable[..., dict]  # (max_tokens, **extra) -> a request body
    text: Callable[[dict], str]  # a whole response's text
    stream_text: Callable[[str], str]  # a stream's text (validated on the way)
    finish: Callable[[dict], str]  # a whole response's finish, in its own words
    length: str  # that finish for max_tokens
    usage: Callable[[dict], tuple[int, int]]  # (prompt tokens, output tokens)
    max_tokens_param: str
    validate: Callable[[dict], None]
    validate_error: Callable[[dict], None]


def _chat_stream(text: str) -> str:
    events = sse_events(text)
    assert events[-1] == "[DONE]"
    for e in events[:-1]:
        validate_schema("CreateChatCompletionStreamResponse", e)
    return "".join(e["choices"][0]["delta"].get("content") or "" for e in events[:-1] if e["choices"])


def _completion_stream(text: str) -> str:
    events = sse_events(text)
    assert events[-1] == "[DONE]"
    for e in events[:-1]:  # OpenAI's schema has no chunk of its own: the finishing ones fit the response's
        if e["choices"] and e["choices"][0]["finish_reason"]:
            validate_schema("CreateCompletionResponse", e)
    return "".join(e["choices"][0]["text"] for e in events[:-1] if e["choices"])


def _messages_stream(text: str) -> str:
    events = typed_events(text)
    for e in events:
        RAW_EVENT.validate_python(e)
    assert events[0]["type"] == "message_start" and events[-1]["type"] == "message_stop"
    return "".join(e["delta"]["text"] for e in events if e["type"] == "content_block_delta"
                   and e["delta"]["type"] == "text_delta")


def _responses_stream(text: str) -> str:
    events = typed_events(text)
    for e in events:
        validate_stream_event(e)
    assert events[0]["type"] == "response.created" and events[-1]["type"] in ("response.completed",
                                                                              "response.incomplete")
    return "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")


def _responses_text(j: dict) -> str:
    return "".join(c["text"] for item in j["output"] if item["type"] == "message"
                   for c in item["content"] if c["type"] == "output_text")


def _openai_error(j: dict) -> None:
    validate_schema("ErrorResponse", j)


DIALECTS = {
    "chat": Dialect(
        "chat", "/v1/chat/completions",
        lambda max_tokens=4, **extra: {"model": "tiny", "messages": USER, "max_tokens": max_tokens, **extra},
        lambda j: j["choices"][0]["message"]["content"], _chat_stream,
        lambda j: j["choices"][0]["finish_reason"], "length",
        lambda j: (j["usage"]["prompt_tokens"], j["usage"]["completion_tokens"]), "max_tokens",
        lambda j: validate_schema("CreateChatCompletionResponse", j), _openai_error),
    "completions": Dialect(
        "completions", "/v1/completions",
        lambda max_tokens=4, **extra: {"model": "tiny", "prompt": "Hello there, how are you?",
                                       "max_tokens": max_tokens, **extra},
        lambda j: j["choices"][0]["text"], _completion_stream,
        lambda j: j["choices"][0]["finish_reason"], "length",
        lambda j: (j["usage"]["prompt_tokens"], j["usage"]["completion_tokens"]), "max_tokens",
        lambda j: validate_schema("CreateCompletionResponse", j), _openai_error),
    "messages": Dialect(
        "messages", "/v1/messages",
        lambda max_tokens=4, **extra: {"model": "tiny", "messages": USER, "max_tokens": max_tokens, **extra},
        lambda j: "".join(b["text"] for b in j["content"] if b["type"] == "text"), _messages_stream,
        lambda j: j["stop_reason"], "max_tokens",
        lambda j: (j["usage"]["input_tokens"], j["usage"]["output_tokens"]), "max_tokens",
        MESSAGE.model_validate, ANTHROPIC_ERROR.validate_python),
    "responses": Dialect(
        "responses", "/v1/responses",
        lambda max_tokens=4, **extra: {"model": "tiny", "input": USER, "max_output_tokens": max_tokens, **extra},
        _responses_text, _responses_stream,
        lambda j: (j.get("incomplete_details") or {}).get("reason") or j["status"], "max_output_tokens",
        lambda j: (j["usage"]["input_tokens"], j["usage"]["output_tokens"]), "max_output_tokens",
        lambda j: validate_schema("Response", j), _openai_error),
}
ALL = pytest.mark.parametrize("d", list(DIALECTS.values()), ids=list(DIALECTS))
OPENAI_SAMPLING = pytest.mark.parametrize("d", [DIALECTS["chat"], DIALECTS["completions"]], ids=["chat", "completions"])


@pytest.fixture(scope="module")
def model(tiny_model):
    return tokenizer_model(tiny_model)


def run(model, scenario, engine: ScriptedEngine | None = None, **settings):
    """``scenario(client)`` against the app over ``engine``, on a fresh loop."""
    async def main():
        async with client(model, engine, **settings) as c:
            return await asyncio.wait_for(scenario(c), timeout=60)
    return asyncio.run(main())


class Trips:
    """Counts what is handed to the tokenizer lanes' threads."""

    def __init__(self, state):
        self.count = 0
        lanes = state.prompts
        for lane in {id(lanes.short[1]): lanes.short[1], id(lanes.long[1]): lanes.long[1]}.values():
            submit = lane.submit

            def counted(*args, _submit=submit, **kwargs):
                self.count += 1
                return _submit(*args, **kwargs)
            lane.submit = counted


# ---- answers and streams ---------------------------------------------------------------


@ALL
def test_an_answer_fits_the_dialects_schema(model, d):
    async def scenario(c):
        r = await c.post(d.path, json=d.body())
        assert r.status_code == 200, r.text
        d.validate(r.json())
        return r.json(), c.engine.submitted
    j, submitted = run(model, scenario)
    seq, = submitted
    assert d.finish(j) == d.length
    assert d.usage(j) == (len(seq.prompt), 4)
    assert d.text(j)


@ALL
def test_a_stream_says_what_the_answer_says(model, d):
    async def scenario(c):
        whole = await c.post(d.path, json=d.body(6))
        streamed = await c.post(d.path, json=d.body(6, stream=True))
        assert streamed.status_code == 200 and streamed.headers["content-type"].startswith("text/event-stream")
        return d.text(whole.json()), d.stream_text(streamed.text)
    whole, streamed = run(model, scenario)
    assert whole == streamed and whole


@ALL
def test_the_answer_is_what_the_engine_made(model, d):
    """The scripted engine answers the prompt's own tokens: the text is their decoding."""
    tokenizer = model.tokenizer

    async def scenario(c):
        r = await c.post(d.path, json=d.body(5))
        return d.text(r.json()), c.engine.submitted[0].prompt
    text, prompt = run(model, scenario)
    assert text == tokenizer.decode(prompt[:5], skip_special_tokens=True)


@ALL
def test_a_stop_token_ends_the_answer(model, d):
    engine = ScriptedEngine(script=lambda seq: [70, 71, min(seq.params.stop_token_ids), 72])

    async def scenario(c):
        r = await c.post(d.path, json=d.body(10))
        return r.json()
    j = run(model, scenario, engine)
    assert d.finish(j) in ("stop", "end_turn", "completed")
    assert d.usage(j)[1] == 3


@ALL
def test_the_generations_are_given_back(model, d):
    async def scenario(c):
        for stream in (False, True):
            r = await c.post(d.path, json=d.body(3, stream=stream))
            assert r.status_code == 200
        return c.state.active_sequences
    assert run(model, scenario) == 0


@ALL
def test_sampling_reaches_the_engine(model, d):
    async def scenario(c):
        r = await c.post(d.path, json=d.body(3, temperature=0.5, top_p=0.9))
        assert r.status_code == 200, r.text
        return c.engine.submitted[0].params
    params = run(model, scenario)
    assert (params.temperature, params.top_p, params.max_tokens) == (0.5, 0.9, 3)
    assert model.tokenizer.eos_token_ids <= params.stop_token_ids


@ALL
def test_defaults_sample_at_temperature_one(model, d):
    async def scenario(c):
        body = d.body(3)
        await c.post(d.path, json=body)
        return c.engine.submitted[0].params
    params = run(model, scenario)
    assert (params.temperature, params.top_p, params.seed) == (1.0, 1.0, None)


@ALL
def test_an_engine_failure_ends_a_stream_in_the_dialects_words(model, d):
    engine = ScriptedEngine()
    engine.fail_with = "injected"

    async def scenario(c):
        return await c.post(d.path, json=d.body(4, stream=True))
    r = run(model, scenario, engine)
    assert r.status_code == 200
    if d.name in ("chat", "completions"):
        events = sse_events(r.text)
        assert events[-1] == "[DONE]" and "injected" in events[-2]["error"]["message"]
    elif d.name == "messages":
        events = typed_events(r.text)
        assert events[-1]["type"] == "error" and "injected" in events[-1]["error"]["message"]
    else:
        events = typed_events(r.text)
        for e in events:
            validate_stream_event(e)
        assert events[-1]["type"] == "response.failed"


@ALL
def test_an_engine_failure_without_a_stream_is_an_error(model, d):
    engine = ScriptedEngine()
    engine.fail_with = "injected"

    async def scenario(c):
        return await c.post(d.path, json=d.body(4))
    r = run(model, scenario, engine)
    assert r.status_code >= 500
    d.validate_error(r.json())


# ---- errors --------------------------------------------------------------------------------


@ALL
def test_an_unknown_model_is_a_404(model, d):
    async def scenario(c):
        return await c.post(d.path, json={**d.body(), "model": "nobody"})
    r = run(model, scenario)
    assert r.status_code == 404
    d.validate_error(r.json())


@ALL
@pytest.mark.parametrize("body", [None, {}, {"model": 3}], ids=["empty", "no-fields", "wrong-type"])
def test_a_malformed_body_is_a_4xx_in_the_dialects_envelope(model, d, body):
    async def scenario(c):
        if body is None:
            return await c.post(d.path, content=b"", headers={"content-type": "application/json"})
        return await c.post(d.path, json=body)
    r = run(model, scenario)
    assert 400 <= r.status_code < 500
    d.validate_error(r.json())
    assert "'None'" not in r.text


@ALL
def test_more_than_the_context_is_a_400_naming_max_tokens(model, d):
    async def scenario(c):
        return await c.post(d.path, json=d.body(model.max_model_len + 1))
    r = run(model, scenario)
    assert r.status_code == 400, r.text
    d.validate_error(r.json())
    if d.name != "messages":
        assert r.json()["error"]["param"] == d.max_tokens_param


@ALL
def test_a_negative_max_tokens_is_refused(model, d):
    async def scenario(c):
        return await c.post(d.path, json=d.body(0))
    r = run(model, scenario)
    assert 400 <= r.status_code < 500
    d.validate_error(r.json())


@OPENAI_SAMPLING
@pytest.mark.parametrize("field,value", [("stop_token_ids", [100000]), ("logit_bias", {"100000": 1.0})])
def test_token_ids_outside_the_vocabulary_are_refused_before_the_tokenizer(model, d, field, value):
    async def scenario(c):
        trips = Trips(c.state)
        r = await c.post(d.path, json=d.body(**{field: value}))
        return r, trips.count, c.engine.submitted
    r, trips, submitted = run(model, scenario)
    assert r.status_code == 400 and r.json()["error"]["param"] == field
    validate_schema("ErrorResponse", r.json())
    assert trips == 0 and not submitted


@pytest.mark.parametrize("d", [DIALECTS["chat"]], ids=["chat"])
def test_top_logprobs_needs_logprobs(model, d):
    async def scenario(c):
        return await c.post(d.path, json=d.body(top_logprobs=2))
    r = run(model, scenario)
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_logprobs"


# ---- admission and the tokenizer thread ----------------------------------------------------


@ALL
def test_one_trip_to_the_tokenizer_thread(model, d):
    async def scenario(c):
        trips = Trips(c.state)
        r = await c.post(d.path, json=d.body(3))
        assert r.status_code == 200, r.text
        return trips.count
    assert run(model, scenario) == 1


@pytest.mark.parametrize("d", [DIALECTS["chat"], DIALECTS["completions"], DIALECTS["responses"]],
                         ids=["chat", "completions", "responses"])
def test_one_trip_with_a_grammar_too(model, d):
    fmt = {"type": "json_object"}
    extra = {"text": {"format": fmt}} if d.name == "responses" else {"response_format": fmt}

    async def scenario(c):
        trips = Trips(c.state)
        r = await c.post(d.path, json=d.body(3, **extra))
        assert r.status_code == 200, r.text
        return trips.count, c.engine.submitted[0].constraint
    trips, constraint = run(model, scenario)
    assert trips == 1 and constraint is not None


@ALL
def test_a_refused_request_does_no_tokenizer_work_while_draining(model, d):
    async def scenario(c):
        c.state.draining = True
        trips = Trips(c.state)
        r = await c.post(d.path, json=d.body())
        return r, trips.count
    r, trips = run(model, scenario)
    assert r.status_code == 503
    d.validate_error(r.json())
    assert trips == 0


@ALL
def test_backpressure_refuses_before_the_tokenizer(model, d):
    """With one row and no queue, a second request while the first runs is a
    429 with Retry-After, and costs no tokenizer work."""
    engine = ScriptedEngine()

    async def scenario(c):
        engine.hold = asyncio.Event()  # every step waits: the first stays in flight
        first = asyncio.ensure_future(c.post(d.path, json=d.body(3)))
        while not engine.submitted:  # the first is in the engine
            await asyncio.sleep(0)
        trips = Trips(c.state)
        second = await c.post(d.path, json=d.body(3))
        engine.hold.set()
        return second, trips.count, (await first).status_code
    second, trips, first = run(model, scenario, engine, max_num_seqs=1, max_queue=0)
    assert first == 200
    assert second.status_code == 429 and second.headers["retry-after"] == "1"
    d.validate_error(second.json())
    assert trips == 0


@ALL
def test_a_queue_takes_what_it_may(model, d):
    engine = ScriptedEngine()

    async def scenario(c):
        engine.hold = asyncio.Event()
        firsts = [asyncio.ensure_future(c.post(d.path, json=d.body(2))) for _ in range(2)]
        while len(engine.submitted) < 2:
            await asyncio.sleep(0)
        third = await c.post(d.path, json=d.body(2))
        engine.hold.set()
        return [(await f).status_code for f in firsts], third.status_code
    firsts, third = run(model, scenario, engine, max_num_seqs=1, max_queue=1)
    assert firsts == [200, 200] and third == 429


# ---- dialect by dialect --------------------------------------------------------------------


@OPENAI_SAMPLING
def test_n_choices_draw_with_seed_plus_i(model, d):
    async def scenario(c):
        r = await c.post(d.path, json=d.body(2, n=3, seed=7))
        return r.json(), [s.params.seed for s in c.engine.submitted]
    j, seeds = run(model, scenario)
    assert sorted(ch["index"] for ch in j["choices"]) == [0, 1, 2]
    assert seeds == [7, 8, 9]
    assert j["usage"]["completion_tokens"] == 6


@OPENAI_SAMPLING
def test_usage_at_the_end_of_a_stream(model, d):
    async def scenario(c):
        r = await c.post(d.path, json=d.body(3, stream=True, stream_options={"include_usage": True}))
        return sse_events(r.text)
    events = run(model, scenario)
    assert events[-2]["choices"] == [] and events[-2]["usage"]["completion_tokens"] == 3


@OPENAI_SAMPLING
def test_a_stop_string_cuts_the_text(model, d):
    async def scenario(c):
        first = await c.post(d.path, json=d.body(8))
        text = d.text(first.json())
        stop = text[2:4]
        cut = await c.post(d.path, json=d.body(8, stop=[stop]))
        return text, stop, cut.json()
    text, stop, cut = run(model, scenario)
    assert d.text(cut) == text[: text.index(stop)]
    assert d.finish(cut) == "stop"


@OPENAI_SAMPLING
def test_logprobs_fit_the_schema(model, d):
    extra = {"logprobs": True, "top_logprobs": 2} if d.name == "chat" else {"logprobs": 2}

    async def scenario(c):
        return (await c.post(d.path, json=d.body(3, **extra))).json()
    j = run(model, scenario)
    d.validate(j)
    assert j["choices"][0]["logprobs"]


def test_completions_take_several_prompts(model):
    async def scenario(c):
        r = await c.post("/v1/completions", json={"model": "tiny", "prompt": ["one two", "three four five"],
                                                  "max_tokens": 2, "n": 2})
        return r.json(), c.engine.submitted
    j, submitted = run(model, scenario)
    validate_schema("CreateCompletionResponse", j)
    assert len(j["choices"]) == 4 and len(submitted) == 4
    assert j["usage"]["prompt_tokens"] == len(submitted[0].prompt) + len(submitted[2].prompt)


def test_completions_take_token_ids_and_refuse_unknown_ones(model):
    async def scenario(c):
        ok = await c.post("/v1/completions", json={"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 2})
        bad = await c.post("/v1/completions", json={"model": "tiny", "prompt": [5, 100000], "max_tokens": 2})
        return ok, bad, c.engine.submitted
    ok, bad, submitted = run(model, scenario)
    assert ok.status_code == 200 and submitted[0].prompt == [5, 6, 7]
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "prompt"


def test_a_chat_image_part_is_refused(model):
    async def scenario(c):
        trips = Trips(c.state)
        r = await c.post("/v1/chat/completions", json={"model": "tiny", "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "data:,"}}]}]})
        return r, trips.count
    r, trips = run(model, scenario)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages[0].content[0].image_url.url"
    assert "The model 'tiny' does not take images" in r.json()["error"]["message"]
    assert trips == 0


def test_messages_count_tokens_counts_what_messages_renders(model):
    async def scenario(c):
        counted = await c.post("/v1/messages/count_tokens", json={"model": "tiny", "messages": USER})
        await c.post("/v1/messages", json=DIALECTS["messages"].body(2))
        return counted.json(), c.engine.submitted[0]
    counted, seq = run(model, scenario)
    assert counted == {"input_tokens": len(seq.prompt)}


def test_messages_stop_sequences_end_the_message(model):
    async def scenario(c):
        first = (await c.post("/v1/messages", json=DIALECTS["messages"].body(8))).json()
        text = DIALECTS["messages"].text(first)
        stop = text[3:5]
        cut = (await c.post("/v1/messages", json=DIALECTS["messages"].body(8, stop_sequences=[stop]))).json()
        return text, stop, cut
    text, stop, cut = run(model, scenario)
    MESSAGE.model_validate(cut)
    assert cut["stop_reason"] == "stop_sequence" and cut["stop_sequence"] == stop
    assert DIALECTS["messages"].text(cut) == text[: text.index(stop)]


def test_responses_are_stored_and_continued(model):
    d = DIALECTS["responses"]

    async def scenario(c):
        first = (await c.post(d.path, json=d.body(3, store=True))).json()
        got = await c.get(f"/v1/responses/{first['id']}")
        follow = await c.post(d.path, json={**d.body(3), "input": "and then?", "previous_response_id": first["id"]})
        return first, got.json(), follow.json(), c.engine.submitted
    first, got, follow, submitted = run(model, scenario)
    assert got == first
    validate_schema("Response", follow)
    assert len(submitted[1].prompt) > len(submitted[0].prompt)  # the earlier turn is in the prompt


def test_a_response_not_stored_is_not_found(model):
    d = DIALECTS["responses"]

    async def scenario(c):
        first = (await c.post(d.path, json=d.body(3, store=False))).json()
        return await c.get(f"/v1/responses/{first['id']}")
    r = run(model, scenario)
    assert r.status_code == 404
    validate_schema("ErrorResponse", r.json())


def test_an_orphan_call_output_is_a_400_before_the_tokenizer(model):
    d = DIALECTS["responses"]

    async def scenario(c):
        trips = Trips(c.state)
        r = await c.post(d.path, json={**d.body(3), "input": [
            {"type": "function_call_output", "call_id": "call_nobody", "output": "42"}]})
        return r, trips.count
    r, trips = run(model, scenario)
    assert r.status_code == 400
    validate_schema("ErrorResponse", r.json())
    assert trips == 0


# ---- the app around the dialects -----------------------------------------------------------


def test_health_and_models_in_process(model):
    async def scenario(c):
        health = await c.get("/health")
        models = await c.get("/v1/models")
        c.state.draining = True
        drained = await c.get("/health")
        return health, models, drained
    health, models, drained = run(model, scenario)
    assert health.status_code == 200 and health.json()["status"] == "ok"
    validate_schema("ListModelsResponse", models.json())
    assert [m["id"] for m in models.json()["data"]] == ["tiny"]
    assert drained.status_code == 503 and drained.json()["error"]["code"] == "shutting_down"


@ALL
def test_the_api_key_guards_every_dialect(model, d):
    async def scenario(c):
        without = await c.post(d.path, json=d.body())
        with_key = await c.post(d.path, json=d.body(), headers={"Authorization": "Bearer key-123456789"})
        return without, with_key
    without, with_key = run(model, scenario, api_key="key-123456789")
    assert without.status_code == 401
    d.validate_error(without.json())
    assert with_key.status_code == 200


@ALL
def test_a_request_id_comes_back(model, d):
    async def scenario(c):
        return await c.post(d.path, json=d.body(), headers={"X-Request-Id": "abc-123"})
    r = run(model, scenario)
    assert r.headers["x-request-id"] == "abc-123"


@ALL
def test_a_body_over_the_limit_is_a_413(model, d):
    async def scenario(c):
        return await c.post(d.path, json={**d.body(), "padding": "x" * 4096})
    r = run(model, scenario, max_request_bytes=1024)
    assert r.status_code == 413
    if d.name == "messages":  # Anthropic's request_too_large, which the SDK's types do not list
        assert r.json()["type"] == "error" and r.json()["error"]["type"] == "request_too_large"
    else:
        d.validate_error(r.json())
