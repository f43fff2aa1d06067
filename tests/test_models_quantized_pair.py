"""Layers held as two quantized halves (mola/models/quantized_pair.py), what a GGUF
Q6_K matrix is kept as: a linear and an embedding (rows, and as a tied head) compute
what their dequantized weight computes; mola's MultiLoRALinear and mlx-lm's
LoRALinear wrap the linear as a QuantizedLinear; a Q6_K model (its tied embedding
too) kept answers as dequantized; `mola convert` writes the pairs as float layers
mlx-lm loads; and tensor parallelism, which would cut the low half alone, is refused."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from gguf import GGMLQuantizationType, quants

from mola.lora.layer import MultiLoRALinear
from mola.lora.routing import LoRARouting
from mola.models.codecs_k import q6_k_pair as _q6_k_pair
from mola.models.convert import convert
from mola.models.loader import load_base_model
from mola.models.quantized_pair import QuantizedPairEmbedding, QuantizedPairLinear, make_pairs, unpair
from mola.testing.gguf_model import random_blocks, save_gguf_model
from mola.testing.model import TinyModelSpec, make_tiny_model

ROWS, COLS = 48, 512


@pytest.fixture(scope="module")
def blocks():
    """Random valid Q6_K blocks [ROWS, COLS] and gguf-py's dequantization of them."""
    raw = random_blocks("Q6_K", ROWS, COLS, np.random.default_rng(3))
    return raw, quants.dequantize(raw, GGMLQuantizationType.Q6_K)


def loaded(layer, raw, bias=None):
    pair = _q6_k_pair(raw)
    arrays = {"weight": pair.low.weight, "scales": pair.low.scales, "biases": pair.low.biases,
              "weight_high": pair.high.weight, "scales_high": pair.high.scales, "biases_high": pair.high.biases}
    if bias is not None:
        arrays["bias"] = bias
    layer.load_weights([(k, mx.array(v)) for k, v in arrays.items()], strict=True)
    return layer


def test_a_pair_linear_computes_what_its_dequantized_weight_computes(blocks):
    raw, w = blocks
    bias = np.random.default_rng(4).normal(size=ROWS).astype(np.float32)
    layer = loaded(QuantizedPairLinear(COLS, ROWS, True, 32, 6), raw, bias)
    np.testing.assert_array_equal(np.array(layer.dequantized()), w)
    x = np.random.default_rng(5).normal(size=(3, 5, COLS)).astype(np.float32)
    want = x @ w.T + bias
    np.testing.assert_allclose(np.array(layer(mx.array(x))), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def test_a_pair_embedding_gives_exact_rows_and_a_tied_head(blocks):
    raw, w = blocks
    layer = loaded(QuantizedPairEmbedding(ROWS, COLS, 32, 6), raw)
    ids = mx.array([[0, 7, 47, 7]])
    np.testing.assert_array_equal(np.array(layer(ids)), w[[0, 7, 47, 7]][None])
    x = np.random.default_rng(6).normal(size=(2, COLS)).astype(np.float32)
    want = x @ w.T
    np.testing.assert_allclose(np.array(layer.as_linear(mx.array(x))), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def test_lora_wraps_a_pair_as_a_quantized_linear(blocks):
    """MultiLoRALinear (slot 1 written) and mlx-lm's LoRALinear take the pair's dims
    and call it: base plus the LoRA product, as with the dequantized weight."""
    from mlx_lm.tuner.lora import LoRALinear

    raw, w = blocks
    base = loaded(QuantizedPairLinear(COLS, ROWS, False, 32, 6), raw)
    x = np.random.default_rng(7).normal(size=(2, 1, COLS)).astype(np.float32)
    routing = LoRARouting()
    layer = MultiLoRALinear.from_base(base, routing, num_slots=2, max_rank=4)
    assert (layer.input_dims, layer.output_dims) == (COLS, ROWS)
    a = np.random.default_rng(8).normal(size=(COLS, 4)).astype(np.float32) / 20
    b = np.random.default_rng(9).normal(size=(4, ROWS)).astype(np.float32)
    layer.set_factors(1, mx.array(a), mx.array(b), 2.0)
    routing.set([0, 1])
    got = np.array(layer(mx.array(x)))
    want = x @ w.T + np.array([0.0, 2.0])[:, None, None] * (x @ a @ b)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    tuned = LoRALinear.from_base(base, r=4)
    assert tuned.lora_a.shape == (COLS, 4)
    base_only = x @ w.T  # lora_b starts at 0
    np.testing.assert_allclose(np.array(tuned(mx.array(x))), base_only, rtol=1e-5, atol=1e-5 * np.abs(base_only).max())


def test_make_pairs_and_unpair_round_trip(blocks):
    raw, w = blocks

    class Two(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(COLS, ROWS, bias=False)
            self.embed = nn.Embedding(ROWS, COLS)

    model = Two()
    make_pairs(model, ["proj", "embed"], 32, 6)
    assert isinstance(model.proj, QuantizedPairLinear) and isinstance(model.embed, QuantizedPairEmbedding)
    loaded(model.proj, raw), loaded(model.embed, raw)
    assert sorted(unpair(model, mx.float32)) == ["embed", "proj"]
    assert type(model.proj) is nn.Linear and type(model.embed) is nn.Embedding
    np.testing.assert_array_equal(np.array(model.proj.weight), w)
    np.testing.assert_array_equal(np.array(model.embed.weight), w)


@pytest.fixture(scope="module")
def q6_k_tied(tmp_path_factory):
    """A Q6_K file of a tied model (its token_embd Q6_K too, as llama.cpp's Q4_K_M gives a
    tied embedding), with its mlx-lm directory."""
    root = tmp_path_factory.mktemp("q6k")
    spec = TinyModelSpec(hidden_size=256, intermediate_size=512, vocab_size=400)
    model_dir = make_tiny_model(root / "model", spec)
    import json

    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    weights = mx.load(str(model_dir / "model.safetensors"))
    weights.pop("lm_head.weight", None)
    mx.save_safetensors(str(model_dir / "model.safetensors"), weights)
    return save_gguf_model(root / "q6_k.gguf", model_dir, "Q6_K")


def test_a_q6_k_model_kept_answers_as_dequantized(q6_k_tied):
    kept = load_base_model(str(q6_k_tied), dtype="keep")
    full = load_base_model(str(q6_k_tied), dtype="float32")
    assert isinstance(kept.model.model.embed_tokens, QuantizedPairEmbedding)
    assert isinstance(kept.model.model.layers[0].mlp.down_proj, QuantizedPairLinear)
    np.testing.assert_array_equal(np.array(kept.model.model.embed_tokens.dequantized()),
                                  np.array(full.model.model.embed_tokens.weight))
    tokens = mx.array([[5, 17, 42, 99, 3, 250]])
    a, b = np.array(kept.model(tokens)), np.array(full.model(tokens))
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * np.abs(b).max())


def test_mola_convert_writes_the_pairs_as_float_layers(q6_k_tied, tmp_path):
    from mlx_lm import load

    out = convert(q6_k_tied, tmp_path / "out", dtype="keep")
    model, _ = load(str(out))
    full = load_base_model(str(q6_k_tied), dtype="float32").model
    assert type(model.model.layers[0].mlp.down_proj) is nn.Linear
    tokens = mx.array([[5, 17, 42, 99, 3, 250]])
    np.testing.assert_array_equal(np.array(model(tokens)), np.array(full(tokens)))


def test_a_model_with_pairs_is_not_sharded(q6_k_tied):
    """mlx's tensor-parallel layers would keep a pair's low half alone: refused, naming
    the way out, before any group is touched."""
    from mola.errors import ModelLoadError
    from mola.models.loader import _shard

    model = load_base_model(str(q6_k_tied), dtype="keep").model
    with pytest.raises(ModelLoadError, match=r"Q6_K matrices .* --dtype float16 or float32"):
        _shard(model, group=None, path=q6_k_tied)
