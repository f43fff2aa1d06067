"""PEFT's embedding LoRA, LoRA on lm_head and trainable tokens as its files
hold them (mola/adapters/formats/peft_vocab.py): keys, the config's forms,
PEFT's copies of the base's layers, and each refusal naming its problem."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest

from mola.adapters.formats import read_adapter
from mola.adapters.formats.peft import CONFIG_FILE, PREFIX, WEIGHTS_FILE
from mola.adapters.vocab import file_parts
from mola.adapters.weights import LoRAWeights, ModuleLoRA
from mola.errors import InvalidAdapter
from mola.testing.peft_vocab import save_peft_vocab_adapter

V, H = 512, 64
EMBED = "model.embed_tokens"
CONFIG = {"model_type": "llama", "vocab_size": V, "hidden_size": H}


def _emb(r=4, scale=2.0):
    rng = np.random.default_rng(r)
    return ModuleLoRA(mx.array(rng.normal(size=(V, r)).astype(np.float32)),
                      mx.array(rng.normal(size=(r, H)).astype(np.float32)), scale)


def _rows(k):
    return mx.array(np.random.default_rng(k).normal(size=(k, H)).astype(np.float32))


def _read(path):
    return read_adapter(path, model_type="llama", model_config=CONFIG)


def test_embedding_lora_keys_and_scale(tmp_path):
    emb = _emb()
    w = _read(save_peft_vocab_adapter(tmp_path / "a", embedding=emb))
    keys = set(mx.load(str(tmp_path / "a" / WEIGHTS_FILE)))
    assert keys == {f"{PREFIX}{EMBED}.lora_embedding_A", f"{PREFIX}{EMBED}.lora_embedding_B"}
    m = w.modules[EMBED]  # a = lora_embedding_A.T [vocab, r], b = lora_embedding_B.T [r, hidden]
    assert m.a.shape == (V, 4) and m.b.shape == (4, H) and m.scale == 2.0
    assert mx.array_equal(m.a, emb.a).item() and mx.array_equal(m.b, emb.b).item()
    assert file_parts(w) == {"embedding_lora_rank": 4, "head_lora_rank": 0, "embedding_tokens": 0,
                             "head_tokens": 0, "tied": False}


def test_head_lora_is_a_linear(tmp_path):
    head = ModuleLoRA(mx.ones((H, 8)), mx.ones((8, V)), 0.5)
    w = _read(save_peft_vocab_adapter(tmp_path / "h", LoRAWeights("h", "peft", {"lm_head": head})))
    assert w.modules["lm_head"].a.shape == (H, 8) and file_parts(w)["head_lora_rank"] == 8


@pytest.mark.parametrize("as_list", [True, False])
def test_trainable_tokens_as_a_list_or_by_layer(tmp_path, as_list):
    rows = _rows(3)
    path = save_peft_vocab_adapter(tmp_path / "t", tokens={EMBED: ([7, 3, 99], rows)}, tokens_as_list=as_list)
    config = json.loads((path / CONFIG_FILE).read_text())
    assert config["trainable_token_indices"] == ([7, 3, 99] if as_list else {"embed_tokens": [7, 3, 99]})
    assert f"{PREFIX}{EMBED}.token_adapter.trainable_tokens_delta" in mx.load(str(path / WEIGHTS_FILE))
    w = _read(path)
    (t,) = w.vocab.tokens
    assert t.path == EMBED and t.indices == (7, 3, 99) and t.tied and mx.array_equal(t.values, rows).item()
    assert not w.modules  # made into factors against the base (mola.adapters.vocab)
    assert file_parts(w)["embedding_tokens"] == 3


def test_separate_head_tokens_are_not_tied(tmp_path):
    path = save_peft_vocab_adapter(tmp_path / "t", tokens={EMBED: ([1, 2], _rows(2)), "lm_head": ([5], _rows(1))})
    tokens = {t.path: t for t in _read(path).vocab.tokens}
    assert not tokens[EMBED].tied and tokens["lm_head"].indices == (5,)


def test_copies_of_the_base_layers_are_not_read(tmp_path):
    copies = {f"{PREFIX}{EMBED}.base_layer.weight": mx.zeros((V, H)), f"{PREFIX}lm_head.weight": mx.zeros((V, H))}
    w = _read(save_peft_vocab_adapter(tmp_path / "c", embedding=_emb(), base_copies=copies))
    assert set(w.modules) == {EMBED}


def test_ensure_weight_tying_is_kept_for_the_base(tmp_path):
    w = _read(save_peft_vocab_adapter(tmp_path / "e", embedding=_emb(), ensure_weight_tying=True))
    assert w.vocab.tie_embedding_lora and file_parts(w)["tied"]


def _tok(ids=(1, 2), rows=None):
    return {EMBED: (list(ids), _rows(len(ids)) if rows is None else rows)}


REFUSALS = {
    # name: (writer arguments, what the message must name)
    "resized vocabulary": (dict(embedding=_emb(), base_copies={f"{PREFIX}{EMBED}.base_layer.weight": mx.zeros((V + 2, H))}),
                           ["514 token rows", "vocabulary has 512", "resized"]),
    "rows of another count": (dict(tokens={EMBED: ([1, 2, 3], _rows(2))}),
                              ["trainable_tokens_delta has shape (2, 64)", "tokens [1, 2, 3]"]),
    "repeated token": (dict(tokens={EMBED: ([4, 4], _rows(2))}), ["repeats a token", "[4, 4]"]),
    "negative token": (dict(tokens={EMBED: ([-1], _rows(1))}), ["non-empty list of token ids", "[-1]"]),
    "rows without indices": (dict(tokens=_tok(), config_extra={"trainable_token_indices": None}),
                             ["holds trainable token rows", "no trainable_token_indices"]),
    "rows of an unnamed layer": (dict(tokens=_tok(), config_extra={"trainable_token_indices": {"wte": [1, 2]}}),
                                 ["model.embed_tokens", "does not name"]),
    "tied with other head ids": (dict(tokens={EMBED: ([1, 2], _rows(2)), "lm_head": ([3], _rows(1))},
                                      ensure_weight_tying=True), ["ensure_weight_tying", "[1, 2]", "[3]"]),
    "lora_embedding_B missing": (dict(embedding=_emb()), ["has no lora_embedding_B"]),
    "rank against r": (dict(embedding=_emb(), config_extra={"rank_pattern": {EMBED: 8}}),
                       ["rank mismatch in model.embed_tokens", "r=8"]),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_refusals_name_the_problem(tmp_path, case):
    args, words = REFUSALS[case]
    path = save_peft_vocab_adapter(tmp_path / "bad", **args)
    if case == "lora_embedding_B missing":
        tensors = {k: v for k, v in mx.load(str(path / WEIGHTS_FILE)).items() if "lora_embedding_B" not in k}
        mx.save_safetensors(str(path / WEIGHTS_FILE), tensors)
    with pytest.raises(InvalidAdapter) as e:
        _read(path)
    assert all(w in str(e.value) for w in words), str(e.value)


def test_added_tokens_beyond_the_vocabulary_are_refused_by_name(tmp_path):
    path = save_peft_vocab_adapter(tmp_path / "added", tokens=_tok())
    (path / "added_tokens.json").write_text(json.dumps({"<tool>": V, "<|im_end|>": 2, "</tool>": V + 1}))
    with pytest.raises(InvalidAdapter) as e:
        _read(path)
    assert "'<tool>' (512)" in str(e.value) and "'</tool>' (513)" in str(e.value) and "<|im_end|>" not in str(e.value)


def test_other_embeddings_stay_refused(tmp_path):
    path = save_peft_vocab_adapter(tmp_path / "wte", embedding=_emb(), config_extra={"target_modules": ["wte"]})
    with pytest.raises(InvalidAdapter, match=r"\['wte'\].*embed_tokens and lm_head only"):
        _read(path)
