"""Where a generation ends (mola/models/eog.py) and what its text shows:

- llama.cpp's end-of-generation rule on hand-made vocabularies, and on the real
  model (SmolLM2-135M-Instruct's GGUF) against the rule written again here from
  llama.cpp's source, over gguf-py's reading of the file;
- every model source gets the set: a GGUF file, an mlx-lm directory with a
  generation_config.json, the chat template's end-of-turn token;
- on a live server of a tiny model whose vocabulary has such tokens: an answer
  stops at the first one (not in ``content``), ``ignore_eos`` goes on,
  ``stop_token_ids`` stops on a given id, ``skip_special_tokens: false`` renders
  special tokens, and bad values are 400s naming the field."""

from __future__ import annotations

import json

import mlx.core as mx
import pytest
from gguf import GGUFReader

from mola.models.eog import end_of_generation_ids, gguf_eog_ids, special_token_ids, template_end_of_turn
from mola.models.loader import load_base_model
from mola.models.tokenizer import tokenizer_files
from mola.server.protocol import ChatCompletionRequest
from mola.demo.tokenizer import CHATML_TEMPLATE, train_tokenizer
from mola.testing.model import TinyModelSpec, make_tiny_model

from helpers.references import greedy_tokens, merged_model
from helpers.servers import start_server

EXTRA = ("<|eot_id|>", "<|eom_id|>", "<|python_tag|>", "<|custom_end|>")
QUESTION = [{"role": "user", "content": "Hello there"}]
MAX_TOKENS = 24


# ---- llama.cpp's rule, written again from its source -------------------------------------------

# llama.cpp src/llama-vocab.cpp, llama_vocab::impl::load(): the texts of "maintain a list of
# tokens that cause end-of-generation", the EOT and EOM auto-detection lists, and the FIM
# pad / repo / file-separator lists (whose ids are EOG too).
SOURCE_EOG = ["<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
              "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
              "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
              "<｜end▁of▁sentence｜>", "[e~[" ]
SOURCE_EOT = ["<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|end_of_text|>",
              "<EOT>", "_<EOT>", "[EOT]", "<｜end▁of▁sentence｜>", "<end_of_utterance>"]
SOURCE_FIM = {"fim_pad": ["<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"],
              "fim_rep": ["<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"],
              "fim_sep": ["<|file_sep|>"]}


def llama_cpp_rule(tokens: list[str], kv: dict) -> set[int]:
    """The steps of llama_vocab::impl::load(), in its order, for a BPE ("gpt2") vocabulary."""
    n = len(tokens)
    special = {"eos": 11 if n > 11 else None, "eot": None, "eom": None,
               "fim_pad": None, "fim_rep": None, "fim_sep": None}  # BPE's default eos is 11
    for key in special:
        value = kv.get(f"tokenizer.ggml.{key}_token_id")
        if value is not None and value < n:
            special[key] = value
    for i, text in enumerate(tokens):  # auto-detect special tokens by text
        if special["eot"] is None and text in SOURCE_EOT:
            special["eot"] = i
        if special["eom"] is None and text == "<|eom_id|>":
            special["eom"] = i
        for key, texts in SOURCE_FIM.items():
            if special[key] is None and text in texts:
                special[key] = i
    eog = {special[k] for k in ("fim_pad", "fim_rep", "fim_sep") if special[k] is not None}
    eog |= {i for i, text in enumerate(tokens) if text in SOURCE_EOG}
    eog |= {special[k] for k in ("eos", "eot", "eom") if special[k] is not None}  # the sanity checks
    texts = {tokens[i]: i for i in eog}
    if "<|end|>" in texts and (("<|return|>" in texts and ("<|call|>" in texts or "<|calls|>" in texts))
                               or (("<|call|>" in texts or "<|calls|>" in texts) and "<|flush|>" in texts)):
        eog.discard(texts["<|end|>"])
    if "<|tool_response>" in texts and "</s>" in texts:
        eog.discard(texts["</s>"])
    return eog


def metadata(tokens: list[str], **ids) -> dict:
    return {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": tokens,
            **{f"tokenizer.ggml.{k}_token_id": v for k, v in ids.items()}}


@pytest.mark.parametrize("tokens, ids", [
    (["a", "b", "<|endoftext|>", "<|im_end|>", "<reponame>", "<repo_name>", "c"], {"eos": 3}),
    (["<s>", "</s>", "<|eot_id|>", "<|eom_id|>", "x"], {"eos": 1, "eot": 2}),
    ([f"t{i}" for i in range(20)], {}),  # nothing by text: BPE's default eos, 11
    (["t0", "t1", "<|end|>"], {}),  # fewer than 12 tokens: no default eos
    (["<|return|>", "<|call|>", "<|end|>", "<|endoftext|>", "x"], {"eos": 3}),  # harmony: <|end|> goes
    (["<|return|>", "<|end|>", "x"], {}),  # without <|call|>: <|end|> stays
    (["<|calls|>", "<|flush|>", "<|end|>"], {}),  # solar-open
    (["<eos>", "</s>", "<|tool_response>", "<turn|>"], {"eos": 0}),  # gemma4: </s> goes
    (["<PAD>", "[PAD]", "<fim_pad>", "<|fim_pad|>", "y"], {"fim_pad": 4}),  # the metadata's fim id wins
    (["<PAD>", "x", "<|file_sep|>"], {"eos": 99}),  # an id out of range: the default (none here)
])
def test_the_gguf_rule_is_llama_cpps(tokens, ids):
    kv = metadata(tokens, **ids)
    assert gguf_eog_ids(kv) == llama_cpp_rule(tokens, kv)


def test_a_text_in_the_list_ends_generation_whatever_its_token_type():
    # llama.cpp matches texts over the whole vocabulary and makes such a token a control token.
    assert gguf_eog_ids(metadata(["a", "<|eot_id|>", "b"])) == {1}
    assert gguf_eog_ids({**metadata(["a", "b", "c"]), "tokenizer.ggml.model": "llama"}) == {2}  # SPM's eos


@pytest.mark.slow
def test_the_real_models_set_is_llama_cpps(smollm_gguf, smollm, tmp_path):
    fields = GGUFReader(str(smollm_gguf)).fields
    tokens = fields["tokenizer.ggml.tokens"].contents()
    kv = {k: f.contents() for k, f in fields.items() if k.startswith("tokenizer.ggml.") and k.endswith("_id")}
    expected = llama_cpp_rule(tokens, kv)
    assert smollm.tokenizer.eos_token_ids == expected
    # <|endoftext|> and <|im_end|> by text, and <reponame> as its FIM repo token.
    assert {tokens[i] for i in expected} == {"<|endoftext|>", "<|im_end|>", "<reponame>"}
    # `mola convert` writes the same set into config.json.
    everything = {k: f.contents() for k, f in fields.items() if k.startswith("tokenizer.")}
    assert set(tokenizer_files(everything, "llama", tmp_path, None)) == expected


# ---- every model source ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def eog_model(tmp_path_factory):
    """A tiny mlx-lm model whose vocabulary has llama.cpp's EOG texts, a token only
    generation_config.json names, and a special token that ends nothing."""
    path = make_tiny_model(tmp_path_factory.mktemp("eog") / "tiny-eog", TinyModelSpec(extra_special_tokens=EXTRA))
    vocab = json.loads((path / "tokenizer.json").read_text())["model"]["vocab"]
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [vocab["<|im_end|>"],
                                                                              vocab["<|custom_end|>"]]}))
    return path


def ids_of(tokenizer, *texts) -> set[int]:
    return {tokenizer.convert_tokens_to_ids(t) for t in texts}


def test_an_mlx_lm_directory_stops_where_llama_cpp_and_generation_config_say(eog_model):
    tok = load_base_model(str(eog_model)).tokenizer
    assert tok.eos_token_ids == ids_of(tok, "<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|eom_id|>",
                                       "<|custom_end|>")
    assert tok.convert_tokens_to_ids("<|python_tag|>") in special_token_ids(tok)
    assert template_end_of_turn(tok) == tok.convert_tokens_to_ids("<|im_end|>")


def test_the_chat_templates_end_of_turn_token(tmp_path):
    tok = train_tokenizer(300)
    tok.add_special_tokens({"additional_special_tokens": ["<|turn_done|>"]})
    done = tok.convert_tokens_to_ids("<|turn_done|>")
    tok.chat_template = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }} <|turn_done|>\n"
                         "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    assert template_end_of_turn(tok) == done
    assert done in end_of_generation_ids(tok)
    tok.chat_template = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
    assert template_end_of_turn(tok) is None  # plain text after the content: no token
    tok.chat_template = CHATML_TEMPLATE
    assert end_of_generation_ids(tok) == ids_of(tok, "<|im_end|>", "<|endoftext|>")


def test_a_gguf_twin_stops_where_its_directory_does(eog_model, tmp_path):
    from mola.testing.gguf_model import save_gguf_model

    gguf = save_gguf_model(tmp_path / "tiny-eog.gguf", eog_model)
    tok = load_base_model(str(gguf), dtype="float32").tokenizer
    # The file has no generation_config.json; the rest is the same set.
    assert tok.eos_token_ids == ids_of(tok, "<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|eom_id|>")


# ---- a live server -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(eog_model):
    handle = start_server(model=str(eog_model), served_model_name="eog")
    yield handle
    handle.stop()


def chat(client, **extra) -> dict:
    body = {"model": "eog", "messages": QUESTION, "max_tokens": MAX_TOKENS, "temperature": 0, **extra}
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    return {"content": choice["message"]["content"], "finish": choice["finish_reason"],
            "tokens": r.json()["usage"]["completion_tokens"]}


@pytest.fixture(scope="module")
def greedy(server, eog_model):
    """The base's greedy tokens for QUESTION (plain mlx-lm) and, per step, how far
    <|eot_id|>'s logit is below the best one."""
    model, _ = merged_model(eog_model)
    tok = server.state.tokenizer
    prompt = tok.apply_chat_template(QUESTION, add_generation_prompt=True)
    tokens = greedy_tokens(model, prompt, MAX_TOKENS)
    logits = model(mx.array([prompt + tokens]))[0, len(prompt) - 1:-1]  # [MAX_TOKENS, vocab]
    eot = tok.convert_tokens_to_ids("<|eot_id|>")
    gaps = (logits.max(axis=-1) - logits[:, eot]).tolist()
    return tokens, gaps


def test_an_answer_stops_at_the_first_end_of_generation_token(client, server, greedy):
    """A logit bias on <|eot_id|> that makes it win at step k and no step before:
    the answer is the first k tokens' text, and the token is not in it."""
    tokens, gaps = greedy
    eos = server.state.tokenizer.eos_token_ids
    assert not eos & set(tokens), "the greedy answer should not end by itself within MAX_TOKENS"
    records = [k for k in range(1, len(gaps)) if gaps[k] < min(gaps[:k]) - 1.0]
    assert records, "no step where a bias can make <|eot_id|> win first"
    k = records[-1]
    bias = (gaps[k] + min(gaps[:k])) / 2
    assert bias <= 100
    eot = server.state.tokenizer.convert_tokens_to_ids("<|eot_id|>")
    prefix = chat(client, max_tokens=k, ignore_eos=True)
    got = chat(client, logit_bias={str(eot): bias})
    assert got == {"content": prefix["content"], "finish": "stop", "tokens": k + 1}
    # With skip_special_tokens false the special tokens before it show, but not the one that ends it.
    raw = chat(client, max_tokens=k, ignore_eos=True, skip_special_tokens=False)["content"]
    assert chat(client, logit_bias={str(eot): bias}, skip_special_tokens=False) == {**got, "content": raw}
    # ignore_eos goes on past it; rendered only when asked.
    on = chat(client, logit_bias={str(eot): bias}, ignore_eos=True, skip_special_tokens=False)
    assert on["finish"] == "length" and on["tokens"] == MAX_TOKENS
    assert on["content"].startswith(raw + "<|eot_id|>")
    hidden = chat(client, logit_bias={str(eot): bias}, ignore_eos=True)
    assert hidden["tokens"] == MAX_TOKENS and "<|" not in hidden["content"]


@pytest.mark.parametrize("text", ["<|endoftext|>", "<|eot_id|>", "<|eom_id|>", "<|custom_end|>", "<|im_end|>"])
def test_every_end_of_generation_token_stops(client, server, text):
    token = server.state.tokenizer.convert_tokens_to_ids(text)
    assert chat(client, logit_bias={str(token): 100}) == {"content": "", "finish": "stop", "tokens": 1}
    rendered = chat(client, logit_bias={str(token): 100}, ignore_eos=True, skip_special_tokens=False, max_tokens=3)
    assert rendered == {"content": text * 3, "finish": "length", "tokens": 3}
    r = client.post("/v1/completions", json={"model": "eog", "prompt": "Hello", "max_tokens": 5,
                                             "logit_bias": {str(token): 100}})
    assert r.json()["choices"][0]["text"] == "" and r.json()["choices"][0]["finish_reason"] == "stop"


def test_a_special_token_that_ends_nothing_is_skipped_unless_asked(client, server):
    tag = server.state.tokenizer.convert_tokens_to_ids("<|python_tag|>")
    assert chat(client, logit_bias={str(tag): 100}, max_tokens=3) == {"content": "", "finish": "length", "tokens": 3}
    assert chat(client, logit_bias={str(tag): 100}, max_tokens=3, skip_special_tokens=False)["content"] == \
        "<|python_tag|>" * 3
    # Streamed: the same text, in deltas.
    with client.stream("POST", "/v1/chat/completions", json={
            "model": "eog", "messages": QUESTION, "max_tokens": 3, "stream": True, "skip_special_tokens": False,
            "logit_bias": {str(tag): 100}}) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert "".join(c["delta"].get("content") or "" for e in events for c in e["choices"]) == "<|python_tag|>" * 3


def test_stop_token_ids_stop_on_a_given_token(client, server, greedy):
    tokens, _ = greedy
    k = next(k for k in range(3, len(tokens)) if tokens[k] not in tokens[:k])
    prefix = chat(client, max_tokens=k, ignore_eos=True)
    for extra in ({}, {"ignore_eos": True}):  # vLLM: ignore_eos leaves stop_token_ids in force
        got = chat(client, stop_token_ids=[tokens[k]], **extra)
        assert got == {"content": prefix["content"], "finish": "stop", "tokens": k + 1}
    r = client.post("/v1/responses", json={"model": "eog", "input": QUESTION, "max_output_tokens": MAX_TOKENS,
                                           "temperature": 0, "stop_token_ids": [tokens[k]]})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["output_tokens"] == k + 1


@pytest.mark.parametrize("field, value, param", [
    ("stop_token_ids", "7", "stop_token_ids"),
    ("stop_token_ids", ["7"], "stop_token_ids[0]"),
    ("stop_token_ids", [True], "stop_token_ids[0]"),
    ("stop_token_ids", [1.5], "stop_token_ids[0]"),
    ("stop_token_ids", [-1], "stop_token_ids"),
    ("stop_token_ids", [10 ** 9], "stop_token_ids"),
    ("stop_token_ids", list(range(257)), "stop_token_ids"),
    ("skip_special_tokens", "no", "skip_special_tokens"),
    ("skip_special_tokens", 0, "skip_special_tokens"),
])
@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/completions", "/v1/responses"])
def test_bad_values_are_400s_naming_the_field(client, route, field, value, param):
    body = {"/v1/chat/completions": {"messages": QUESTION}, "/v1/completions": {"prompt": "Hi"},
            "/v1/responses": {"input": "Hi"}}[route]
    r = client.post(route, json={"model": "eog", "max_tokens" if route != "/v1/responses" else "max_output_tokens": 2,
                                 **body, field: value})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and r.json()["error"]["type"] == "invalid_request_error"


def test_the_request_fields_default_as_vllms():
    body = ChatCompletionRequest(model="m", messages=QUESTION)
    assert body.skip_special_tokens is True and body.stop_token_ids is None
    assert body.sampling().stop_token_ids == ()
