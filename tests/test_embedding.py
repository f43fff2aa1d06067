"""LoRA on the token embedding and the output head in the mixed batch
(mola/lora/embedding.py): one batch of base rows, plain LoRA rows and rows of
each embedding/head kind (PEFT's embedding LoRA, a LoRA on lm_head, trainable
tokens, a tied embedding LoRA), on an untied and a tied model, against plain
mlx-lm with each adapter merged into the weights, in prefill and decode."""

from __future__ import annotations

import json

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm import load
from mlx_lm.models.cache import make_prompt_cache

from mola.adapters.recipe import read_checked
from mola.lora.embedding import MultiLoRAEmbedding, TiedHead
from mola.lora.layer import MultiLoRALinear
from mola.lora.pack import AdapterPacks, prepare_rows

from helpers.vocab import make_vocab_adapters, merged_vocab_model, tied_copy

TOL = 2e-4  # float32 logits, which differ by ~1-10 between the kinds


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def setup(request, tiny_model, tmp_path_factory):
    tied = request.param
    root = tmp_path_factory.mktemp("vocab")
    model_dir = tied_copy(tiny_model, root / "tied") if tied else tiny_model
    return tied, model_dir, make_vocab_adapters(root, model_dir, tied)


def _served(model_dir, adapters):
    """The model with packs, each adapter read as the server reads it, in slots 1..n."""
    model, _ = load(str(model_dir))
    packs = AdapterPacks.install(model, max_loras=len(adapters), max_rank=16)
    for slot, path in enumerate(adapters.values(), start=1):
        weights = read_checked(str(path), packs.geometry, _config(model_dir))
        packs.fill(slot, prepare_rows(weights, packs.geometry))
    return model, packs


def _config(model_dir) -> dict:
    return json.loads((model_dir / "config.json").read_text())


def _prompts(n: int, length: int, seed: int = 0) -> mx.array:
    rows = np.random.default_rng(seed).integers(0, 300, (n, length))
    rows[:, 1] = [3, 40, 97, 200, 255, 41, 3][:n]  # every row meets some replaced token
    return mx.array(rows, dtype=mx.int32)


def test_mixed_batch_prefill_and_decode_match_merged_references(setup):
    tied, model_dir, adapters = setup
    names = [None, *adapters]  # slot 0 (the base) and every kind
    model, packs = _served(model_dir, adapters)
    ids = _prompts(len(names), 9)
    slots = list(range(len(names)))
    packs.routing.set(slots, None)
    cache = make_prompt_cache(model)
    got = model(ids, cache=cache)  # [B, L, vocab]: prefill, many tokens a row
    nxt = mx.argmax(got[:, -1], axis=-1)[:, None]  # [B, 1]
    got_decode = model(nxt, cache=cache)[:, -1]  # one token a row
    packs.routing.clear()
    base = merged_vocab_model(model_dir, None, tied)
    for i, name in enumerate(names):
        ref = merged_vocab_model(model_dir, adapters[name] if name else None, tied)
        ref_cache = make_prompt_cache(ref)
        want = ref(ids[i:i + 1], cache=ref_cache)[0]
        want_decode = ref(nxt[i:i + 1], cache=ref_cache)[0, -1]
        assert mx.abs(got[i] - want).max().item() < TOL, name
        assert mx.abs(got_decode[i] - want_decode).max().item() < TOL, name
        if name is not None:  # the adapter really changes the logits
            assert mx.abs(want - base(ids[i:i + 1])[0]).max().item() > 0.1, name


def test_a_batch_on_one_slot_and_a_scaled_row(setup):
    """The single-slot path, and lora_scale: every delta (a replaced row's, v - e) times the row's scale."""
    tied, model_dir, adapters = setup
    model, packs = _served(model_dir, adapters)
    ids = _prompts(2, 6, seed=1)
    for slot, name in enumerate(adapters, start=1):
        packs.routing.set([slot, slot])
        alone = model(ids)
        packs.routing.set([slot, 0], [0.5, 1.0])
        half = model(ids)
        packs.routing.clear()
        base = model(ids)
        ref = merged_vocab_model(model_dir, adapters[name], tied)(ids)
        assert mx.abs(alone - ref).max().item() < TOL, name
        assert mx.abs(half[1] - base[1]).max().item() < TOL, name
        scaled = merged_vocab_model(model_dir, adapters[name], tied, scale=0.5)(ids[:1])
        assert mx.abs(half[0] - scaled[0]).max().item() < TOL, name


def test_install_wraps_the_embedding_and_the_head_without_changing_the_base(setup):
    tied, model_dir, _ = setup
    model, _ = load(str(model_dir))
    ids = _prompts(2, 5)
    before = model(ids)
    params = sum(v.size for _, v in nn.utils.tree_flatten(model.parameters()))
    packs = AdapterPacks.install(model, max_loras=2, max_rank=8)
    assert mx.array_equal(model(ids), before).item()
    embed = model.model.embed_tokens
    assert isinstance(embed, MultiLoRAEmbedding)
    assert packs.layers["model.embed_tokens"] is embed
    if tied:  # the head's packs sit on the embedding, its base is the embedding's as_linear
        assert packs.layers["lm_head"] is embed.head and isinstance(embed.head.base, TiedHead)
        assert "lm_head" not in model
    else:
        assert isinstance(model.lm_head, MultiLoRALinear) and packs.layers["lm_head"] is model.lm_head
    # the embedding's weight is counted once (the tied head holds it outside the tree)
    assert sum(v.size for _, v in nn.utils.tree_flatten(model.parameters())) == params
    assert packs.nbytes == 0


def test_packs_are_sized_to_what_is_loaded(setup):
    tied, model_dir, adapters = setup
    model, _ = load(str(model_dir))
    packs = AdapterPacks.install(model, max_loras=4, max_rank=16)
    g = packs.geometry
    V, H = g.vocab.vocab_size, g.vocab.hidden_size
    weights = read_checked(str(adapters["head"]), g, _config(model_dir))
    packs.fill(1, prepare_rows(weights, g))
    # the head alone: slots 0..1, rank 8, A^T [r, hidden] and scale * B [r, vocab] in float32
    assert packs.layers["lm_head"].nbytes == 2 * 8 * (H + V) * 4
    assert packs.layers["model.embed_tokens"].nbytes == 0
    assert packs.nbytes == g.pack_bytes([(8, weights.modules)])
    tok = read_checked(str(adapters["tok"]), g, _config(model_dir))
    k = tok.vocab.embedding_tokens
    assert tok.modules["model.embed_tokens"].rank == k == 6
    packs.fill(2, prepare_rows(tok, g))  # slots 0..3 now; 6 tokens take rank 8
    assert packs.layers["model.embed_tokens"].nbytes == 4 * 8 * (V + H) * 4
    packs.empty(1), packs.empty(2), packs.compact()
    assert packs.nbytes == 0
