"""A vision-language base through the real app: OpenAI chat requests with an
image (a data: URL) and an adapter answer as mlx-vlm's own ``generate`` with
the adapter fused; streaming gives the same; a text-only request is served;
/v1/models says the base takes images; a request whose images take more
vision tokens than --max-vision-tokens is a 400 naming it, and the server
stays healthy; /tokenize counts a chat with images as mlx-vlm's processor
prepares it, which is chat's ``usage.prompt_tokens``. Skipped without mlx-vlm, saying why (MOLA_REQUIRE_VISION=1: failed)."""

from __future__ import annotations

import base64
import io
import json
import httpx
import pytest

from helpers.vision import require_mlx_vlm

require_mlx_vlm()  # skipped without mlx-vlm, saying why; failed where MOLA_REQUIRE_VISION=1 (CI)

from helpers.references import detokenize
from helpers.servers import start_server
from mlx_lm.utils import load_tokenizer
from helpers.vision_models import image_chat, make_tiny_qwen2_vl, make_vlm_adapter, merged_vlm, random_image

from mola.config import AdapterSpec

MAX_TOKENS = 6


@pytest.fixture(scope="module")
def qwen2_vl(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen2_vl_server")
    model = make_tiny_qwen2_vl(root / "model")
    return model, make_vlm_adapter(root / "a", model, seed=1), make_vlm_adapter(root / "b", model, seed=2, rank=2)


@pytest.fixture(scope="module")
def client(qwen2_vl):
    model, a, _ = qwen2_vl
    handle = start_server(model=str(model), served_model_name="vlm", adapters=(AdapterSpec("a", str(a)),),
                          allow_any_adapter_path=True, max_loras=2, max_lora_rank=8, max_vision_tokens=20)
    with httpx.Client(base_url=handle.url, timeout=120) as c:
        yield c
    handle.stop()


def png_url(im) -> str:
    buf = io.BytesIO()
    im.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def body(model: str, question: str, im=None, stream: bool = False) -> dict:
    parts = [{"type": "image_url", "image_url": {"url": png_url(im)}}] if im is not None else []
    return {"model": model, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": stream,
            "messages": [{"role": "user", "content": [*parts, {"type": "text", "text": question}]}]}


def reference_text(model_dir, adapter, question, im, scale: float = 1.0, more=()) -> str:
    from mlx_vlm import generate

    m, processor = merged_vlm(model_dir, adapter, scale, more)
    chat = image_chat(question) if im is not None else [{"role": "user", "content": question}]
    prompt = processor.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    ids = generate(m, processor, prompt, image=[im] if im is not None else None, max_tokens=MAX_TOKENS,
                   temperature=0.0, verbose=False).token_ids
    return detokenize(load_tokenizer(model_dir), ids)  # its tokens, as the server detokenizes them


def streamed(client, payload) -> str:
    text = []
    with client.stream("POST", "/v1/chat/completions", json=payload) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                for choice in json.loads(line[6:])["choices"]:
                    text.append(choice["delta"].get("content") or "")
    return "".join(text)


def test_an_adapter_answers_about_an_image_as_mlx_vlm_does_streaming_or_not(client, qwen2_vl):
    model, a, _ = qwen2_vl
    im = random_image(7)
    r = client.post("/v1/chat/completions", json=body("a", "What is this?", im))
    assert r.status_code == 200, r.text
    got = r.json()["choices"][0]["message"]["content"]
    assert got == reference_text(model, a, "What is this?", im)
    assert streamed(client, body("a", "What is this?", im, stream=True)) == got
    base = client.post("/v1/chat/completions", json=body("vlm", "What is this?", im)).json()
    assert base["choices"][0]["message"]["content"] == reference_text(model, None, "What is this?", im)


def test_a_text_only_request_is_served_as_mlx_vlm_answers_it(client, qwen2_vl):
    model, a, _ = qwen2_vl
    r = client.post("/v1/chat/completions", json={**body("a", "Tell me a story."),
                                                 "messages": [{"role": "user", "content": "Tell me a story."}]})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == reference_text(model, a, "Tell me a story.", None)


def test_models_say_the_base_and_its_adapters_take_images(client):
    cards = {c["id"]: c for c in client.get("/v1/models").json()["data"]}
    assert cards["vlm"]["input_modalities"] == ["text", "image"]
    assert cards["a"]["input_modalities"] == ["text", "image"]


def test_too_many_vision_tokens_is_a_400_naming_the_bound(client):
    big = random_image(8, (64, 64))  # 32 x 32 pixels at most after resizing: 16 vision tokens each
    r = client.post("/v1/chat/completions", json={**body("a", "Two?"), "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": png_url(big)}},
        {"type": "image_url", "image_url": {"url": png_url(random_image(9, (64, 64)))}},
        {"type": "text", "text": "Two?"}]}]})
    assert r.status_code == 400, r.text
    assert "--max-vision-tokens" in r.json()["error"]["message"]
    assert client.get("/health").status_code == 200
    assert client.post("/v1/chat/completions", json=body("a", "What is this?", random_image(7))).status_code == 200


def test_tokenize_counts_a_chat_with_an_image_as_mlx_vlm_prepares_it(client, qwen2_vl):
    from mlx_vlm.utils import prepare_inputs

    model, _, _ = qwen2_vl
    im, question = random_image(11), "What is in the picture?"
    chat = body("a", question, im)
    r = client.post("/tokenize", json={"model": "a", "messages": chat["messages"]})
    assert r.status_code == 200, r.text
    _, processor = merged_vlm(model)
    prompt = processor.apply_chat_template(image_chat(question), add_generation_prompt=True, tokenize=False)
    want = prepare_inputs(processor, images=[im], prompts=[prompt])["input_ids"][0].tolist()
    assert r.json()["tokens"] == want
    usage = client.post("/v1/chat/completions", json={**chat, "max_tokens": 1}).json()["usage"]
    assert r.json()["count"] == usage["prompt_tokens"] == len(want)
    for extra, param in (({"add_generation_prompt": False}, "add_generation_prompt"),
                         ({"add_special_tokens": True}, "add_special_tokens")):
        bad = client.post("/tokenize", json={"model": "a", "messages": chat["messages"], **extra})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == param, bad.text


def test_anthropic_image_blocks_answer_as_openai_image_parts(client):
    im = random_image(10)
    openai = client.post("/v1/chat/completions", json=body("a", "What is this?", im)).json()
    data = png_url(im).split(",", 1)[1]
    r = client.post("/v1/messages", json={"model": "a", "max_tokens": MAX_TOKENS, "temperature": 0, "messages": [
        {"role": "user", "content": [{"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                                                  "data": data}},
                                     {"type": "text", "text": "What is this?"}]}]})
    assert r.status_code == 200, r.text
    assert r.json()["content"][0]["text"] == openai["choices"][0]["message"]["content"]


def test_a_structured_output_about_an_image_follows_its_schema(client):
    schema = {"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]}},
              "required": ["colour"], "additionalProperties": False}
    r = client.post("/v1/chat/completions", json={**body("a", "Which colour?", random_image(11)), "max_tokens": 40,
                                                 "response_format": {"type": "json_schema", "json_schema": {
                                                     "name": "c", "schema": schema}}})
    assert r.status_code == 200, r.text
    assert json.loads(r.json()["choices"][0]["message"]["content"])["colour"] in ("red", "green", "blue")


def test_a_hot_loaded_adapter_in_a_stack_answers_about_an_image_as_both_fused(client, qwen2_vl):
    model, a, b = qwen2_vl
    r = client.post("/v1/adapters", json={"name": "b", "path": str(b)})
    assert r.status_code == 200, r.text
    im = random_image(12)
    r = client.post("/v1/chat/completions", json={**body("vlm", "What is this?", im),
                                                 "adapters": [{"name": "a", "scale": 0.5}, {"name": "b", "scale": 2}]})
    assert r.status_code == 200, r.text
    want = reference_text(model, a, "What is this?", im, 0.5, more=[(b, 2.0)])
    assert r.json()["choices"][0]["message"]["content"] == want
    assert want != reference_text(model, a, "What is this?", im)  # the stack is not adapter a alone


# ---- tools with images -------------------------------------------------------------------------

DESCRIBE = {"type": "function", "function": {"name": "describe", "parameters": {
    "type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]},
                                     "count": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["colour", "count"], "additionalProperties": False}}}
NAMED = {"type": "function", "function": {"name": "describe"}}


def forced_reference(model_dir, adapter, question, im, max_tokens) -> str:
    """mlx-vlm's own greedy answer (its generate, the adapter fused) with each
    step's logits masked by the same grammar (llguidance's matcher, advanced
    by the tokens mlx-vlm drew), detokenized."""
    import mlx.core as mx
    import numpy as np
    from mlx_vlm import generate

    from mola.structured import StructuredOutputs

    m, processor = merged_vlm(model_dir, adapter)
    tok = load_tokenizer(model_dir)
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    matcher = StructuredOutputs(tok, vocab).for_request(tools=[DESCRIBE], tool_choice=NAMED).matcher.deep_copy()
    done = []  # how many of the tokens it passes are consumed (at the first step: the prompt's tail, none)

    def masked(tokens, logits):  # tokens: the prompt's tail, then those drawn; logits [1, V]
        for t in tokens.tolist()[done[0] if done else len(tokens):]:
            assert matcher.consume_token(int(t))
        done[:] = [len(tokens)]
        allowed = np.frombuffer(matcher.compute_logit_bias(), dtype=np.uint8)[:logits.shape[-1]] > 0
        return mx.where(mx.array(allowed), logits, -float("inf"))

    prompt = processor.apply_chat_template(image_chat(question), add_generation_prompt=True, tokenize=False)
    ids = generate(m, processor, prompt, image=[im], max_tokens=max_tokens, temperature=0.0, verbose=False,
                   logits_processors=[masked]).token_ids
    return detokenize(tok, ids)


def test_a_forced_tool_call_about_an_image_is_mlx_vlms_masked_answer_streamed_or_not(client, qwen2_vl):
    model, a, _ = qwen2_vl
    im = random_image(13)
    payload = {**body("a", "Describe it.", im), "max_tokens": 40, "tools": [DESCRIBE], "tool_choice": NAMED}
    r = client.post("/v1/chat/completions", json=payload)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls", choice
    (call,) = choice["message"]["tool_calls"]
    args = json.loads(call["function"]["arguments"])
    assert call["function"]["name"] == "describe" and args["colour"] in ("red", "green", "blue")
    assert args == json.loads(forced_reference(model, a, "Describe it.", im, 40))
    calls = {}
    with client.stream("POST", "/v1/chat/completions", json={**payload, "stream": True}) as s:
        for line in s.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                for c in json.loads(line[6:])["choices"][0]["delta"].get("tool_calls") or []:
                    calls.setdefault(c["index"], []).append(c["function"].get("arguments") or "")
    assert json.loads("".join(calls[0])) == args


def test_an_image_chat_with_a_tool_call_and_its_result_answers_as_mlx_vlm_with_the_call_as_json(client, qwen2_vl):
    from mlx_vlm import generate

    model, a, _ = qwen2_vl
    im = random_image(14)
    call = {"id": "call_1", "type": "function",
            "function": {"name": "describe", "arguments": "{\"colour\": \"red\", \"count\": 2}"}}
    history = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": png_url(im)}},
                                            {"type": "text", "text": "Describe it."}]},
               {"role": "assistant", "content": None, "tool_calls": [call]},
               {"role": "tool", "tool_call_id": "call_1", "content": "noted"}]
    r = client.post("/v1/chat/completions", json={"model": "a", "max_tokens": MAX_TOKENS, "temperature": 0,
                                                 "messages": history, "tools": [DESCRIBE], "tool_choice": "none"})
    assert r.status_code == 200, r.text
    # The template reads no tool_calls: the model sees its call as the JSON forced calls are written in.
    m, processor = merged_vlm(model, a)
    chat = [*image_chat("Describe it."),
            {"role": "assistant", "content": '[{"name": "describe", "arguments": {"colour": "red", "count": 2}}]'},
            {"role": "tool", "content": "noted"}]
    prompt = processor.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    ids = generate(m, processor, prompt, image=[im], max_tokens=MAX_TOKENS, temperature=0.0, verbose=False).token_ids
    assert r.json()["choices"][0]["message"]["content"] == detokenize(load_tokenizer(model), ids)
    auto = client.post("/v1/chat/completions", json={"model": "a", "messages": history[:1], "tools": [DESCRIBE],
                                                    "tool_choice": "auto", "max_tokens": 2})
    assert auto.status_code == 400 and "tool-call parser" in auto.json()["error"]["message"]


# ---- the Responses API ---------------------------------------------------------------------------

def test_responses_input_image_parts_answer_as_chat_image_parts(client):
    im = random_image(15)
    chat = client.post("/v1/chat/completions", json=body("a", "What is this?", im)).json()
    r = client.post("/v1/responses", json={"model": "a", "max_output_tokens": MAX_TOKENS, "temperature": 0, "input": [
        {"role": "user", "content": [{"type": "input_image", "image_url": png_url(im), "detail": "auto"},
                                     {"type": "input_text", "text": "What is this?"}]}]})
    assert r.status_code == 200, r.text
    assert r.json()["output"][0]["content"][0]["text"] == chat["choices"][0]["message"]["content"]
    assert r.json()["usage"]["input_tokens"] == chat["usage"]["prompt_tokens"]
    # a second turn by previous_response_id: the stored image is read again, as chat's history holds it
    follow = client.post("/v1/responses", json={"model": "a", "max_output_tokens": MAX_TOKENS, "temperature": 0,
                                               "previous_response_id": r.json()["id"], "input": "And why?"})
    assert follow.status_code == 200, follow.text
    history = body("a", "What is this?", im)["messages"] + [
        {"role": "assistant", "content": chat["choices"][0]["message"]["content"]},
        {"role": "user", "content": "And why?"}]
    again = client.post("/v1/chat/completions", json={**body("a", "x"), "messages": history}).json()
    assert follow.json()["output"][0]["content"][0]["text"] == again["choices"][0]["message"]["content"]


@pytest.mark.parametrize("part, param", [
    ({"type": "input_image", "image_url": "data:image/png;base64,%%%"}, "input[0].content[0].image_url"),
    ({"type": "input_image", "file_id": "file_1"}, "input[0].content[0].image_url"),
    ({"type": "input_image", "image_url": "https://example.com/a.png"}, "input[0].content[0].image_url"),
    ({"type": "input_image", "image_url": "data:image/png;base64,AAAA", "detail": "huge"}, "input[0].content[0].detail"),
])
def test_bad_responses_images_are_a_400_naming_the_part(client, part, param):
    r = client.post("/v1/responses", json={"model": "a", "max_output_tokens": 2, "input": [
        {"role": "user", "content": [part, {"type": "input_text", "text": "What is this?"}]}]})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    assert client.get("/health").status_code == 200
