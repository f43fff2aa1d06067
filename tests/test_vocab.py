"""Adapters that change the embedding and the head, resolved against the base
(mola/adapters/vocab.py) and served by the engine: rows of every kind with
plain LoRA, activated LoRA and base rows in one batch, prompts of several
lengths prefilled in chunks, speculative decoding, a quantized base and a
quantized KV cache, against plain mlx-lm with each adapter merged; the
server's report of the parts; and the refusals."""

from __future__ import annotations

import json
from pathlib import Path
import random

import mlx.core as mx
import pytest

from mola.adapters.recipe import read_checked
from mola.adapters.vocab import VocabParts, resolve_vocab
from mola.adapters.weights import LoRAWeights, ModuleLoRA
from mola.engine.config import SpeculativeConfig
from mola.errors import InvalidAdapter
from mola.lora.tokens import TrainableTokens
from mola.lora.pack import AdapterPacks
from mola.testing.model import TinyModelSpec, make_tiny_model
from mlx_lm import load
from mlx_lm.models.cache import make_prompt_cache

from helpers.engines import ENGINE_QUESTIONS as QUESTIONS
from helpers.engines import EngineRunner, together
from helpers.references import reference_decode
from helpers.vocab import make_vocab_adapters, merged_vocab_model, tied_copy

MAX_TOKENS = 8
LOGPROB_TOL = 1e-3


@pytest.fixture(scope="module")
def tied(tiny_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("vocab-engine")
    model_dir = tied_copy(tiny_model, root / "tied")
    return model_dir, make_vocab_adapters(root, model_dir, tied=True)


def _runner(model_dir, adapters, **config) -> EngineRunner:
    r = EngineRunner(model_dir, max_tokens=MAX_TOKENS, max_loras=len(adapters), **config)
    for name, path in adapters.items():  # read as the server reads them
        r.add(name, read_checked(str(path), r.engine.geometry, r.loaded.config))
    return r


def _activated(base, merged, prompt: list[int], start: int) -> list[int]:
    """Greedy, position p of the prompt fed to ``merged`` if p >= start else to ``base``."""
    cache = make_prompt_cache(base)
    for p, token in enumerate(prompt):
        logits = (merged if p >= start else base)(mx.array([[token]]), cache=cache)
    out = []
    for _ in range(MAX_TOKENS):
        token = int(mx.argmax(logits[0, -1]))
        out.append(token)
        logits = merged(mx.array([[token]]), cache=cache)
    return out


def test_every_kind_beside_lora_activated_and_base_rows_in_chunked_prefill(tied):
    model_dir, adapters = tied
    r = _runner(model_dir, adapters, prefill_step_size=5)
    prompts = [r.prompt(q) for q in QUESTIONS]  # 4 lengths
    rng = random.Random(3)
    jobs = [(name, i) for i in range(len(prompts)) for name in (None, *adapters)]
    rng.shuffle(jobs)
    try:
        seqs = together(r, lambda: [r.submit(prompts[i], name, logprobs=2) for name, i in jobs]
                        + [r.submit(prompts[3], "lin", adapter_start=7)])
        r.wait(seqs)
        logprobs = {s.seq_id: r.logprobs.get(s.seq_id) for s in seqs}
    finally:
        r.stop()
    refs = {name: merged_vocab_model(model_dir, adapters.get(name), True) for name in (None, *adapters)}
    for (name, i), s in zip(jobs, seqs):
        tokens, lps = reference_decode(refs[name], prompts[i], MAX_TOKENS, top_k=2)
        assert s.output == tokens, (name, i)
        for (got, got_top), (want, want_top) in zip(logprobs[s.seq_id], lps):
            assert abs(got - want) < LOGPROB_TOL, (name, i)
            assert all(abs(g[1] - w[1]) < LOGPROB_TOL for g, w in zip(got_top, want_top)), (name, i)
    assert seqs[-1].output == _activated(refs[None], refs["lin"], prompts[3], 7)
    # the kinds really differ from each other on the same prompt
    assert len({tuple(reference_decode(m, prompts[1], MAX_TOKENS)[0]) for m in refs.values()}) == len(refs)


def test_speculative_rows_verify_several_tokens_through_the_embedding_and_the_head(tied):
    model_dir, adapters = tied
    cfg = SpeculativeConfig(max_batch=32, num_draft_tokens=4, cost_aware=False)
    r = _runner(model_dir, adapters, speculative=cfg)
    prompt = r.prompt("hi hi hi hi hi hi hi hi hi hi hi hi")
    try:
        seqs = together(r, lambda: [r.submit(prompt, name) for name in (None, *adapters)])
        r.wait(seqs)
    finally:
        r.stop()
    for name, s in zip((None, *adapters), seqs):
        ref = merged_vocab_model(model_dir, adapters.get(name), True)
        assert s.output == reference_decode(ref, prompt, MAX_TOKENS)[0], name


def test_a_quantized_base(tmp_path):
    """A 4-bit base: a QuantizedEmbedding and a QuantizedLinear head; the
    tokens' deltas are taken from the dequantized rows."""
    model_dir = make_tiny_model(tmp_path / "q4", TinyModelSpec(quantize_bits=4, quantize_group_size=32))
    adapters = make_vocab_adapters(tmp_path / "adapters", model_dir, tied=False)
    r = _runner(model_dir, adapters)
    prompt = r.prompt(QUESTIONS[1])
    try:
        seqs = together(r, lambda: [r.submit(prompt, name, logprobs=1) for name in (None, *adapters)])
        r.wait(seqs)
        logprobs = [r.logprobs[s.seq_id] for s in seqs]
    finally:
        r.stop()
    for name, s, lps in zip((None, *adapters), seqs, logprobs):
        ref = merged_vocab_model(model_dir, adapters.get(name), False)  # dequantized
        tokens, want = reference_decode(ref, prompt, MAX_TOKENS)
        assert s.output == tokens, name
        assert all(abs(g - w) < 1e-2 for (g, _), (w, _) in zip(lps, want)), name


def _quantized_reference(model, prompt: list[int], bits: int) -> list[int]:
    """Greedy as the engine feeds a row (the prompt but its last token, then a
    token a step) over mlx-lm's own QuantizedKVCache."""
    from mlx_lm.models.cache import QuantizedKVCache

    cache = [QuantizedKVCache(group_size=64, bits=bits) for _ in model.layers]
    model(mx.array([prompt[:-1]]), cache=cache)
    token, out = prompt[-1], []
    for _ in range(MAX_TOKENS):
        token = int(mx.argmax(model(mx.array([[token]]), cache=cache)[0, -1]))
        out.append(token)
    return out


def test_a_quantized_kv_cache(tmp_path):
    """--kv-bits 8 (heads 64 wide): every kind in one batch of several prompt
    lengths equals mlx-lm's QuantizedKVCache on the merged weights."""
    model_dir = make_tiny_model(tmp_path / "h64", TinyModelSpec(hidden_size=128, num_attention_heads=2,
                                                                num_key_value_heads=1))
    adapters = make_vocab_adapters(tmp_path / "adapters", model_dir, tied=False)
    rng = random.Random(4)
    prompts = [[rng.choice([3, 40, 97, 200, rng.randrange(3, 500)]) for _ in range(n)] for n in (6, 31, 17, 44)]
    jobs = [(name, p) for p in prompts for name in (None, *adapters)]
    r = _runner(model_dir, adapters, kv_bits=8, kv_cache_bytes=0)
    try:
        seqs = together(r, lambda: [r.submit(p, name) for name, p in jobs])
        r.wait(seqs)
    finally:
        r.stop()
    refs = {name: merged_vocab_model(model_dir, adapters.get(name), False) for name in (None, *adapters)}
    for (name, p), s in zip(jobs, seqs):
        assert s.output == _quantized_reference(refs[name], p, 8), name


# ---- resolving against the base, and refusals --------------------------------------------


@pytest.fixture(scope="module")
def geometry(tiny_model):
    model, _ = load(str(tiny_model))
    return AdapterPacks.install(model, max_loras=2, max_rank=8).geometry


def _tokens(ids, hidden=64, path="model.embed_tokens", tied=True):
    return TrainableTokens(path, tuple(ids), mx.ones((len(ids), hidden)), tied)


def _weights(tokens=(), modules=None, **extra) -> LoRAWeights:
    return LoRAWeights("x", "peft", modules or {}, vocab=VocabParts(tokens=tuple(tokens)), **extra)


def test_tokens_become_a_replacement(geometry):
    """The factors replace the rows exactly: base row + S @ D = v (checked on the base's own rows)."""
    w = resolve_vocab(_weights([_tokens([5, 9])]), geometry)
    m = w.modules["model.embed_tokens"]
    rows = geometry.vocab.rows("model.embed_tokens", list(range(geometry.vocab.vocab_size)))
    replaced = rows + m.scale * (m.a @ m.b)
    assert mx.allclose(replaced[mx.array([5, 9])], mx.ones((2, 64)), atol=1e-6).item()
    untouched = [i for i in range(geometry.vocab.vocab_size) if i not in (5, 9)]
    assert mx.array_equal(replaced[mx.array(untouched)], rows[mx.array(untouched)]).item()
    assert "lm_head" not in w.modules  # an untied head keeps its rows
    assert w.vocab.describe() == {"embedding_lora_rank": 0, "head_lora_rank": 0, "embedding_tokens": 2,
                                  "head_tokens": 0}


@pytest.mark.parametrize("case, words", [
    (lambda V: _weights([_tokens([1, V, V + 3])]), ["tokens [512, 515]", "vocabulary of 512", "new tokens"]),
    (lambda V: _weights([_tokens(range(9))]), ["9 token rows", "--max-lora-rank 8"]),
    (lambda V: _weights([_tokens([1], hidden=32)]), ["shape (1, 32)", "expected (1, 64)"]),
    (lambda V: _weights([_tokens([1], path="model.wte")]), ["model.wte"]),
    (lambda V: _weights([_tokens([1])], {"model.embed_tokens": ModuleLoRA(mx.zeros((V, 2)), mx.zeros((2, 64)), 1.0)}),
     ["both LoRA and trainable tokens", "model.embed_tokens"]),
    (lambda V: _weights([_tokens([1])], invocation_tokens=(4, 5)), ["activated LoRA", "embedding"]),
])
def test_refusals_name_the_problem(geometry, case, words):
    with pytest.raises(InvalidAdapter) as e:
        resolve_vocab(case(geometry.vocab.vocab_size), geometry)
    assert all(w in str(e.value) for w in words), str(e.value)


def test_a_base_without_an_embedding_refuses_trainable_tokens(geometry):
    import dataclasses

    with pytest.raises(InvalidAdapter, match="no token embedding"):
        resolve_vocab(_weights([_tokens([1])]), dataclasses.replace(geometry, vocab=None))


def test_validate_refuses_a_head_lora_of_the_wrong_vocabulary(geometry, tmp_path):
    from mola.testing.peft_vocab import save_peft_vocab_adapter

    bad = LoRAWeights("h", "peft", {"lm_head": ModuleLoRA(mx.zeros((64, 4)), mx.zeros((4, 500)), 1.0)})
    path = save_peft_vocab_adapter(tmp_path / "bad", bad)
    with pytest.raises(InvalidAdapter, match=r"lm_head.*\(4, 512\)"):
        read_checked(str(path), geometry, json.loads((tmp_path / "bad" / "adapter_config.json").read_text()))


def test_the_server_reports_the_parts_and_serves_them(tied):
    """/v1/models and /v1/adapters say what each adapter changes of the
    embedding and the head; a completion on one equals its merged reference;
    an adapter that extends the vocabulary gets a 400 naming its tokens."""
    import httpx

    from helpers.servers import start_server
    from mola.config import AdapterSpec
    from mola.testing.peft_vocab import save_peft_vocab_adapter

    model_dir, adapters = tied
    handle = start_server(model=str(model_dir), served_model_name="tiny", max_lora_rank=16, max_loras=len(adapters),
                          allow_any_adapter_path=True, adapters=[AdapterSpec(n, str(p)) for n, p in adapters.items()])
    try:
        prompt = [5, 40, 97, 12, 200]
        r = httpx.post(handle.url + "/v1/completions", timeout=60, json={
            "model": "tok", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
            "logprobs": 1})
        assert r.status_code == 200, r.text
        want, lps = reference_decode(merged_vocab_model(model_dir, adapters["tok"], True), prompt, MAX_TOKENS)
        got = r.json()["choices"][0]["logprobs"]["token_logprobs"]
        assert all(abs(g - w) < LOGPROB_TOL for g, (w, _) in zip(got, lps)) and len(got) == MAX_TOKENS
        cards = {c["id"]: c for c in httpx.get(handle.url + "/v1/models").json()["data"]}
        assert cards["tok"]["vocab"] == {"embedding_lora_rank": 0, "head_lora_rank": 0, "embedding_tokens": 6,
                                         "head_tokens": 6}  # a tied head: the same rows replaced
        assert cards["tie"]["vocab"]["embedding_lora_rank"] == cards["tie"]["vocab"]["head_lora_rank"] == 4
        assert cards["head"]["vocab"]["head_lora_rank"] == 8 and "vocab" not in cards["lin"]
        listed = {a["name"]: a for a in httpx.get(handle.url + "/v1/adapters").json()["data"]}
        assert listed["emb"]["vocab"]["embedding_lora_rank"] == 4 and listed["lin"]["vocab"] is None
        new = save_peft_vocab_adapter(Path(str(adapters["tok"]) + "-new"),
                                      tokens={"model.embed_tokens": ([1, 600], mx.ones((2, 64)))})
        r = httpx.post(handle.url + "/v1/adapters", timeout=60, json={"name": "new", "path": str(new)})
        assert r.status_code == 400 and "tokens [600]" in r.text, r.text
    finally:
        handle.stop()
