"""GGUF codecs (mola/models/codecs.py) on small GGUF files written with gguf-py:
kept codecs repack bit for bit into MLX's affine format (checked against gguf-py's
dequantization and against MLX's own GGUF reader), every other codec is dequantized
to gguf-py's values, and what cannot be read is refused by name."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter, quants

from mola.errors import ModelLoadError
from mola.adapters.formats.gguf_names import hf_row_order
from mola.models.codecs import BFloat16, Quantized, read_tensor
from mola.models.gguf import hf_name
from mola.models.loader import load_base_model
from mola.testing.gguf_model import random_blocks, save_gguf_model
from mola.testing.model import TinyModelSpec, make_tiny_model

KEPT = ["Q4_0", "Q4_1", "Q8_0"]
DEQUANTIZED = ["F16", "BF16", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ1_S", "IQ1_M",
               "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ4_NL", "IQ4_XS", "TQ1_0", "TQ2_0", "MXFP4"]
QUANTIZABLE = ("F16", "BF16", "TQ1_0", "TQ2_0", "MXFP4")  # gguf-py writes these from real values
# 256 wide so that every K-quant's 256-value blocks fit the rows
SPEC = TinyModelSpec(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
                     vocab_size=400, norm_noise=0.2)


def write_one(path, codec: str, data: np.ndarray | None = None, rng=None):
    """A GGUF file holding one [8, 256] tensor in ``codec``; returns (path, raw)."""
    kind = GGMLQuantizationType[codec]
    if data is not None:
        raw = quants.quantize(data, kind)
    else:
        raw = random_blocks(codec, 8, 256, rng or np.random.default_rng(0))
    w = GGUFWriter(str(path), "llama")
    w.add_tensor("blk.0.attn_q.weight", raw, raw_dtype=kind)
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    return path, raw


def dequantize(q: Quantized) -> np.ndarray:
    return np.array(mx.dequantize(mx.array(q.weight), mx.array(q.scales).astype(mx.float32),
                                  mx.array(q.biases).astype(mx.float32), group_size=32, bits=q.bits))


@pytest.mark.parametrize("codec", KEPT)
def test_kept_codecs_are_exact_mlx_affine_triples(codec, tmp_path):
    data = np.random.default_rng(1).normal(0, 0.5, (8, 256)).astype(np.float32)
    path, raw = write_one(tmp_path / "t.gguf", codec, data)
    q = read_tensor(GGUFReader(str(path)).tensors[0])
    assert isinstance(q, Quantized) and q.bits == (8 if codec == "Q8_0" else 4)
    # the same values as llama.cpp's dequantization (gguf-py), exactly
    np.testing.assert_array_equal(dequantize(q), quants.dequantize(raw, GGMLQuantizationType[codec]))
    # and the same bits as MLX's own C++ GGUF reader gives for these codecs
    theirs = mx.load(str(path))
    np.testing.assert_array_equal(q.weight, np.array(theirs["blk.0.attn_q.weight"]))
    np.testing.assert_array_equal(q.scales, np.array(theirs["blk.0.attn_q.scales"]))
    np.testing.assert_array_equal(q.biases, np.array(theirs["blk.0.attn_q.biases"]))


@pytest.mark.parametrize("codec", DEQUANTIZED)
def test_other_codecs_dequantize_to_gguf_py_values(codec, tmp_path):
    rng = np.random.default_rng(2)
    data = rng.normal(0, 0.5, (8, 256)).astype(np.float32) if codec in QUANTIZABLE else None
    path, raw = write_one(tmp_path / "t.gguf", codec, data, rng)
    got = read_tensor(GGUFReader(str(path)).tensors[0])
    expected = quants.dequantize(raw, GGMLQuantizationType[codec])
    if isinstance(got, BFloat16):
        got = np.array(mx.array(got.bits).view(mx.bfloat16).astype(mx.float32))
    assert np.isfinite(expected).all() and np.abs(expected).max() > 0
    np.testing.assert_array_equal(np.asarray(got, dtype=np.float32), expected)


@pytest.mark.parametrize("codec,message", [("Q8_1", "Q8_1"), ("I8", "I8")])
def test_codecs_mola_cannot_read_are_refused_by_name(codec, message, tmp_path):
    kind = GGMLQuantizationType[codec]
    path = tmp_path / "t.gguf"
    w = GGUFWriter(str(path), "llama")
    if codec == "I8":
        w.add_tensor("blk.0.attn_q.weight", np.ones((8, 256), dtype=np.int8))
    else:
        w.add_tensor("blk.0.attn_q.weight", np.zeros((8, 256 // 32 * 40), np.uint8), raw_dtype=kind)
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    with pytest.raises(ModelLoadError, match=rf"blk\.0\.attn_q\.weight.*{message}"):
        read_tensor(GGUFReader(str(path)).tensors[0])


# ---- whole models ------------------------------------------------------------------


@pytest.fixture(scope="module")
def wide_model(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("models") / "wide", SPEC)


def linear_weights(model) -> dict[str, np.ndarray]:
    out = {}
    for path, m in model.named_modules():
        if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
            out[path] = np.array(mx.dequantize(m.weight, m.scales, m.biases, m.group_size, m.bits))
        elif isinstance(m, (nn.Linear, nn.Embedding)):
            out[path] = np.array(m.weight.astype(mx.float32))
    return out


@pytest.mark.parametrize("codec", ["Q4_K", "Q6_K", "Q5_0", "Q8_0"])
def test_a_model_in_each_codec_holds_gguf_py_weights(codec, wide_model, tmp_path):
    """Every matrix of the loaded model (q/k rows back in HF order) equals gguf-py's
    dequantization of the file's tensor; only the kept codecs stay quantized."""
    path = save_gguf_model(tmp_path / f"{codec}.gguf", wide_model, codec)
    reference = {}
    for t in GGUFReader(str(path)).tensors:
        if len(t.data.shape) == 2:
            w = quants.dequantize(t.data, t.tensor_type)
            proj = t.name.split(".")[2] if t.name.startswith("blk.") else ""
            if proj in ("attn_q", "attn_k"):
                w = hf_row_order(w, SPEC.num_attention_heads if proj == "attn_q" else SPEC.num_key_value_heads)
            reference[hf_name(t.name).rpartition(".")[0]] = w
    for dtype in ("float32", "keep"):
        model = load_base_model(str(path), dtype=dtype).model
        got = linear_weights(model)
        assert set(got) == set(reference)
        # keep holds a codec MLX cannot hold as float16, like MLX and llama.cpp's GPU paths
        half = dtype == "keep" and codec not in KEPT
        assert (model.model.layers[0].mlp.up_proj.weight.dtype == mx.float16) == half
        for name, w in reference.items():
            np.testing.assert_allclose(got[name], w, rtol=1e-3 if half else 0, atol=1e-6, err_msg=name)
        quantized = [p for p, m in model.named_modules() if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding))]
        assert bool(quantized) == (dtype == "keep" and codec in KEPT)


def test_kept_and_dequantized_models_compute_the_same(wide_model, tmp_path):
    path = save_gguf_model(tmp_path / "q4.gguf", wide_model, "Q4_0", codecs={"token_embd.weight": "Q8_0"})
    tokens = mx.array([[5, 17, 42, 99, 3, 250]])
    kept, full = (load_base_model(str(path), dtype=d).model for d in ("keep", "float32"))
    assert isinstance(kept.model.embed_tokens, nn.QuantizedEmbedding)
    assert isinstance(kept.model.layers[0].mlp.down_proj, nn.QuantizedLinear)
    a, b = kept(tokens), full(tokens)
    assert a.dtype == mx.float32
    np.testing.assert_allclose(np.array(a), np.array(b), rtol=1e-4, atol=1e-4)
    half = load_base_model(str(path), dtype="float16").model
    assert half.model.layers[0].mlp.down_proj.weight.dtype == mx.float16
    np.testing.assert_allclose(np.array(half(tokens).astype(mx.float32)), np.array(b), atol=0.05)


def test_the_dtype_a_kept_model_computes_in():
    from mola.models.gguf import keep_dtype

    assert keep_dtype({"Q4_1", "Q8_0", "F32"}) == mx.float32  # SmolLM2's Q4_1 file
    assert keep_dtype({"Q4_K", "Q6_K"}) == mx.float16  # a Q4_K_M file
    assert keep_dtype({"F16", "Q8_0"}) == mx.float16
    assert keep_dtype({"BF16", "F32"}) == mx.bfloat16
