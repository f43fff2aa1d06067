"""GGUF codecs (mola/models/codecs.py) on small GGUF files written with gguf-py:
kept codecs repack bit for bit into MLX's affine format (checked against gguf-py's
dequantization and against MLX's own GGUF reader), every other codec is dequantized
to gguf-py's values, and what cannot be read is refused by name."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFWriter, quants

from mola.errors import ModelLoadError
from mola.adapters.formats.gguf_names import hf_row_order
from mola.models.codecs import BFloat16, Quantized, QuantizedPair, held_nbytes, nbytes, read_tensor, repack
from mola.models.gguf import _to_mx, hf_name
from mola.models.loader import load_base_model
from mola.testing.gguf_model import SCALE_FIELDS, random_blocks, save_gguf_model
from mola.models.quantized_pair import QuantizedPairLinear
from mola.testing.model import TinyModelSpec, make_tiny_model

# codec -> (bits, scales' dtype) of the MLX affine form --dtype keep holds it in
KEPT = {"Q4_0": (4, np.float16), "Q4_1": (4, np.float16), "Q5_0": (5, np.float16), "Q5_1": (5, np.float16),
        "Q8_0": (8, np.float16), "Q3_K": (8, np.float16), "Q4_K": (4, np.float32), "Q5_K": (5, np.float32),
        "IQ4_NL": (8, np.float16), "IQ4_XS": (8, np.float32), "IQ3_S": (4, np.float32),
        "IQ3_XXS": (6, np.float32), "IQ2_XXS": (8, np.float32), "IQ1_S": (2, np.float32)}
# codec -> (bits, scales' dtype) of each half of the QuantizedPair it is kept as (matrices)
PAIRED = {"Q6_K": (6, np.float32)}
DEQUANTIZED = ["F16", "BF16", "Q2_K", "IQ1_M", "IQ2_XS", "IQ2_S", "TQ1_0", "TQ2_0", "MXFP4"]
QUANTIZABLE = ("F16", "BF16", "TQ1_0", "TQ2_0", "MXFP4")  # gguf-py writes these from real values
# 256 wide so that every K-quant's 256-value blocks fit the rows
SPEC = TinyModelSpec(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
                     vocab_size=400, norm_noise=0.2)


def write_one(path, codec: str, data: np.ndarray | None = None, rng=None, raw: np.ndarray | None = None):
    """A GGUF file holding one tensor in ``codec``: ``raw`` blocks, ``data`` quantized
    by gguf-py, or random valid [8, 256] blocks; returns (path, raw)."""
    kind = GGMLQuantizationType[codec]
    if raw is None and data is not None:
        raw = quants.quantize(data, kind)
    elif raw is None:
        raw = random_blocks(codec, 8, 256, rng or np.random.default_rng(0))
    w = GGUFWriter(str(path), "llama")
    w.add_tensor("blk.0.attn_q.weight", raw, raw_dtype=kind)
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    return path, raw


def dequantize(q: Quantized) -> np.ndarray:
    return np.array(mx.dequantize(mx.array(q.weight), mx.array(q.scales).astype(mx.float32),
                                  mx.array(q.biases).astype(mx.float32), group_size=32, bits=q.bits))


def assert_same_bits(got: np.ndarray, expected: np.ndarray) -> None:
    """Equal values, and equal float32 bit patterns wherever the value is not zero
    (gguf-py's d * 0 is -0.0 for a negative d, where MLX's d*q + b gives +0.0)."""
    np.testing.assert_array_equal(got, expected)
    nonzero = expected != 0
    np.testing.assert_array_equal(got[nonzero].view(np.uint32), expected[nonzero].view(np.uint32))


@pytest.mark.parametrize("codec", ["Q4_0", "Q4_1", "Q8_0"])
def test_codecs_mlx_reads_are_the_same_triples_as_mx_load(codec, tmp_path):
    data = np.random.default_rng(1).normal(0, 0.5, (8, 256)).astype(np.float32)
    path, raw = write_one(tmp_path / "t.gguf", codec, data)
    q = read_tensor(GGUFReader(str(path)).tensors[0])
    assert isinstance(q, Quantized) and q.bits == KEPT[codec][0]
    # the same values as llama.cpp's dequantization (gguf-py), exactly
    np.testing.assert_array_equal(dequantize(q), quants.dequantize(raw, GGMLQuantizationType[codec]))
    # and the same bits as MLX's own C++ GGUF reader gives for these codecs
    theirs = mx.load(str(path))
    np.testing.assert_array_equal(q.weight, np.array(theirs["blk.0.attn_q.weight"]))
    np.testing.assert_array_equal(q.scales, np.array(theirs["blk.0.attn_q.scales"]))
    np.testing.assert_array_equal(q.biases, np.array(theirs["blk.0.attn_q.biases"]))


@pytest.mark.parametrize("codec", KEPT)
def test_kept_codecs_repack_random_blocks_bit_for_bit(codec, tmp_path):
    """256 rows of random valid blocks (small positive float16 scale fields, every
    other byte random: K-quants' 6-bit sc and m take all 64 values) -> the exact MLX
    affine triple: mx.dequantize gives gguf-py's dequantization bit for bit."""
    raw = random_blocks(codec, 256, 256, np.random.default_rng(11))
    path, raw = write_one(tmp_path / "t.gguf", codec, raw=raw)
    q = read_tensor(GGUFReader(str(path)).tensors[0])
    bits, scale_dtype = KEPT[codec]
    assert isinstance(q, Quantized) and q.bits == bits and q.shape == (256, 256)
    assert q.scales.dtype == q.biases.dtype == scale_dtype and q.scales.shape == (256, 8)
    expected = quants.dequantize(raw, GGMLQuantizationType[codec])
    assert np.isfinite(expected).all() and np.abs(expected).max() > 0
    assert_same_bits(dequantize(q), expected)
    if scale_dtype == np.float32:  # float16 could not hold these scales
        assert (q.scales.astype(np.float16).astype(np.float32) != q.scales).any()


@pytest.mark.parametrize("codec", [*KEPT, *PAIRED])
def test_repacks_by_chunks_of_rows_are_the_whole_repack(codec, tmp_path, monkeypatch):
    """A tensor repacked a few rows at a time (CHUNK_BYTES, the last chunk shorter)
    is the tensor repacked at once, to the bit, and still gguf-py's values."""
    import mola.models.codecs as codecs

    raw = random_blocks(codec, 37, 512, np.random.default_rng(5))
    path, raw = write_one(tmp_path / "t.gguf", codec, raw=raw)
    whole = read_tensor(GGUFReader(str(path)).tensors[0])
    monkeypatch.setattr(codecs, "CHUNK_BYTES", 5 * raw.shape[-1])  # chunks of 5 rows: 8 chunks, the last of 2
    chunked = read_tensor(GGUFReader(str(path)).tensors[0])
    halves = (lambda v: (v.low, v.high)) if codec in PAIRED else (lambda v: (v,))
    for a, b in zip(halves(whole), halves(chunked)):
        for x, y in ((a.weight, b.weight), (a.scales, b.scales), (a.biases, b.biases)):
            assert x.dtype == y.dtype and x.shape == y.shape and x.tobytes() == y.tobytes()
    got = sum(dequantize(h) for h in halves(chunked))
    np.testing.assert_array_equal(got, quants.dequantize(raw, GGMLQuantizationType[codec]))


@pytest.mark.parametrize("codec", ["Q4_K", "Q6_K", "Q8_0", "Q2_K", "IQ2_XS"])
def test_dequantized_by_chunks_of_rows_is_gguf_py_whole(codec, tmp_path, monkeypatch):
    """A float --dtype's read (gguf-py's dequantization, a few rows at a time) is
    gguf-py's dequantization of the whole tensor, to the bit."""
    import mola.models.codecs as codecs

    raw = random_blocks(codec, 37, 512, np.random.default_rng(6))
    path, raw = write_one(tmp_path / "t.gguf", codec, raw=raw)
    monkeypatch.setattr(codecs, "CHUNK_BYTES", 5 * raw.shape[-1])
    got = read_tensor(GGUFReader(str(path)).tensors[0], keep=False)
    expected = quants.dequantize(raw, GGMLQuantizationType[codec])
    assert got.dtype == expected.dtype == np.float32 and got.shape == expected.shape == (37, 512)
    assert got.tobytes() == expected.tobytes()


@pytest.mark.parametrize("codec", ["Q4_K", "Q5_K"])
def test_k_quant_scales_are_gguf_py_products(codec):
    """scale = d*sc and bias = -(dmin*m) per 32 weights, the very float32 products
    gguf-py's (and llama.cpp's) dequantization multiplies q by and subtracts."""
    raw = random_blocks(codec, 256, 256, np.random.default_rng(12))
    blocks = raw.reshape(-1, GGML_QUANT_SIZES[GGMLQuantizationType[codec]][1])
    sc, m = quants.Q4_K.get_scale_min(blocks[:, 4:16])
    assert set(np.unique(sc)) == set(np.unique(m)) == set(range(64))  # the full 6-bit range
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)
    dmin = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
    q = repack(raw, codec)
    np.testing.assert_array_equal(q.scales.reshape(-1, 8).view(np.uint32), (d * sc.astype(np.float32)).view(np.uint32))
    np.testing.assert_array_equal(q.biases.reshape(-1, 8), -(dmin * m.astype(np.float32)))


@pytest.mark.parametrize("codec", KEPT)
def test_kept_codecs_are_exact_over_the_float16_range(codec):
    """Scale fields anywhere in float16 below 256 in magnitude (subnormals, negatives,
    every significand): the repack is still exact (the float32 products have room)."""
    rng = np.random.default_rng(13)
    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[codec]]
    raw = rng.integers(0, 256, (64 * 1024 // block, size), dtype=np.uint8)
    for offset in SCALE_FIELDS[codec]:
        field = rng.integers(0, 0x5C00, len(raw)).astype(np.uint16) | (rng.integers(0, 2, len(raw)) << 15).astype(np.uint16)
        raw[:, offset:offset + 2] = field.view(np.uint8).reshape(-1, 2)
    raw = raw.reshape(64, -1)
    q = repack(raw, codec)
    assert q is not None
    assert_same_bits(dequantize(q), quants.dequantize(raw, GGMLQuantizationType[codec]))


@pytest.mark.parametrize("codec", ["Q4_0", "Q5_0", "Q8_0", "Q3_K", "IQ4_NL"])
def test_a_float16_bias_past_its_range_is_dequantized(codec, tmp_path):
    """-8d, -16d, -128d, 128d beyond 65504: the tensor is dequantized, not kept wrong."""
    raw = random_blocks(codec, 8, 256, np.random.default_rng(14)).reshape(-1, GGML_QUANT_SIZES[GGMLQuantizationType[codec]][1])
    offset = SCALE_FIELDS[codec][0]
    raw[:, offset:offset + 2] = np.full(len(raw), 60000, np.float16).view(np.uint8).reshape(-1, 2)
    path, raw = write_one(tmp_path / "t.gguf", codec, raw=raw.reshape(8, -1))
    got = read_tensor(GGUFReader(str(path)).tensors[0])
    assert isinstance(got, np.ndarray)
    np.testing.assert_array_equal(got, quants.dequantize(raw, GGMLQuantizationType[codec]))


@pytest.mark.parametrize("codec", ["Q4_K", "Q5_K", "Q3_K", "IQ4_XS", "Q5_0"])
def test_stacked_experts_are_kept_expert_by_expert(codec, tmp_path):
    rng = np.random.default_rng(15)
    raw = np.stack([random_blocks(codec, 8, 256, rng) for _ in range(3)])  # [E, rows, bytes]
    path, raw = write_one(tmp_path / "t.gguf", codec, raw=raw)
    tensor = GGUFReader(str(path)).tensors[0]
    assert tensor.data.ndim == 3
    q = read_tensor(tensor)
    assert isinstance(q, Quantized) and q.shape == (3, 8, 256) and q.scales.shape == (3, 8, 8)
    assert_same_bits(dequantize(q), quants.dequantize(raw, GGMLQuantizationType[codec]))
    for e in range(3):  # expert e is the repack of its own blocks
        alone = repack(raw[e], codec)
        np.testing.assert_array_equal(q.weight[e], alone.weight)
        np.testing.assert_array_equal(q.scales[e], alone.scales)


# bits per weight --dtype keep holds each kept codec in, computing in float32 (float16
# scales widened) and in float16 (float32 scales stay float32)
BPW = {"Q6_K": (16, 16), "Q4_0": (6, 5), "Q4_1": (6, 5), "Q5_0": (7, 6), "Q5_1": (7, 6), "Q8_0": (10, 9), "Q3_K": (10, 9),
       "Q4_K": (6, 6), "Q5_K": (7, 7), "IQ4_NL": (10, 9), "IQ4_XS": (10, 10), "IQ3_S": (6, 6),
       "IQ3_XXS": (8, 8), "IQ2_XXS": (10, 10), "IQ1_S": (4, 4)}


@pytest.mark.parametrize("codec", [*KEPT, *PAIRED, "Q2_K", "F16", "BF16", "F32"])
def test_held_nbytes_is_what_a_tensor_takes_loaded(codec, tmp_path):
    """held_nbytes, from the type and shape alone, is the bytes _to_mx's arrays take,
    kept or not, in float32 and float16; nbytes is the bytes of the held value."""
    rng = np.random.default_rng(16)
    data = rng.normal(0, 1, (8, 256)).astype(np.float32) if codec in ("F16", "BF16", "F32") else None
    path, _ = write_one(tmp_path / "t.gguf", codec, data, rng)
    tensor = GGUFReader(str(path)).tensors[0]
    value = read_tensor(tensor)
    for dtype in (mx.float32, mx.float16):
        for keep in (True, False):
            arrays = _to_mx(value, dtype, keep)
            assert held_nbytes(tensor.tensor_type, tensor.shape, dtype.size, keep) == sum(a.nbytes for a in arrays.values())
    if codec in KEPT or codec in PAIRED:
        bits, scale_dtype = {**KEPT, **PAIRED}[codec]
        halves = 2 if codec in PAIRED else 1
        assert nbytes(value) == halves * (8 * 256 * bits // 8 + 2 * 8 * 8 * np.dtype(scale_dtype).itemsize)
        held = [held_nbytes(codec, (256, 8), size, True) * 8 / 2048 for size in (4, 2)]
        assert tuple(held) == BPW[codec]
    else:
        assert nbytes(value) == 8 * 256 * (2 if codec in ("F16", "BF16") else 4)


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
        if hasattr(m, "dequantized"):  # a QuantizedPair layer (Q6_K)
            out[path] = np.array(m.dequantized())
        elif isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
            out[path] = np.array(mx.dequantize(m.weight, m.scales, m.biases, m.group_size, m.bits))
        elif isinstance(m, (nn.Linear, nn.Embedding)):
            out[path] = np.array(m.weight.astype(mx.float32))
    return out


@pytest.mark.parametrize("codec", ["Q4_K", "Q6_K", "Q2_K", "Q3_K", "Q5_0", "Q8_0", "IQ4_XS"])
def test_a_model_in_each_codec_holds_gguf_py_weights(codec, wide_model, tmp_path):
    """Every matrix of the loaded model (q/k rows back in HF order) equals gguf-py's
    dequantization of the file's tensor; only the kept codecs stay quantized (Q6_K as
    a pair of halves), and the others (Q2_K) load too, dequantized."""
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
        kept = codec in KEPT or codec in PAIRED
        half = dtype == "keep" and not kept
        assert (model.model.layers[0].mlp.up_proj.weight.dtype == mx.float16) == half
        for name, w in reference.items():
            np.testing.assert_allclose(got[name], w, rtol=1e-3 if half else 0, atol=1e-6 if half else 0, err_msg=name)
        quantized = [m for _, m in model.named_modules() if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding))]
        assert bool(quantized) == (dtype == "keep" and kept)
        assert all(m.bits == {**KEPT, **PAIRED}[codec][0] and m.scales.dtype == mx.float32 for m in quantized)
        assert all(hasattr(m, "dequantized") == (codec in PAIRED) for m in quantized)


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


@pytest.mark.parametrize("codec", ["Q4_K", "Q5_K"])
def test_a_k_quant_model_kept_computes_as_dequantized(codec, wide_model, tmp_path):
    """A Q4_K_M-like file (Q4_K or Q5_K, with Q6_K ffn_down and attn_v, as llama.cpp's
    mixes do): kept, the K-quant layers are 4/5-bit QuantizedLinear with float32
    scales, Q6_K two 6-bit halves, every weight equals the float32 load's bit
    for bit, and the logits agree (the quantized matmul sums in its own order)."""
    mix = {"blk.0.ffn_down.weight": "Q6_K", "blk.1.attn_v.weight": "Q6_K"}
    path = save_gguf_model(tmp_path / f"{codec}_M.gguf", wide_model, codec, codecs=mix)
    kept, full = (load_base_model(str(path), dtype=d).model for d in ("keep", "float32"))
    bits = KEPT[codec][0]
    for module in (kept.model.layers[0].self_attn.q_proj, kept.model.layers[1].mlp.down_proj, kept.model.embed_tokens):
        assert isinstance(module, (nn.QuantizedLinear, nn.QuantizedEmbedding))
        assert (module.bits, module.group_size) == (bits, 32)
        assert module.scales.dtype == module.biases.dtype == mx.float32
    for module in (kept.model.layers[0].mlp.down_proj, kept.model.layers[1].self_attn.v_proj):
        assert type(module) is QuantizedPairLinear and module.bits == 6 and module.scales_high.dtype == mx.float32
    ours, theirs = linear_weights(kept), linear_weights(full)
    assert set(ours) == set(theirs)
    for name in ours:
        np.testing.assert_array_equal(ours[name], theirs[name], err_msg=name)
    tokens = mx.array([[5, 17, 42, 99, 3, 250]])
    a, b = kept(tokens), full(tokens)
    assert a.dtype == mx.float32 and np.abs(np.array(b)).max() > 1
    np.testing.assert_allclose(np.array(a), np.array(b), rtol=1e-5, atol=1e-5 * np.abs(np.array(b)).max())


def test_the_dtype_a_kept_model_computes_in():
    from mola.models.gguf import keep_dtype

    assert keep_dtype({"Q4_1", "Q8_0", "F32"}) == mx.float32  # SmolLM2's Q4_1 file
    assert keep_dtype({"Q4_K", "Q6_K"}) == mx.float32  # a Q4_K_M file: float32 scales
    assert keep_dtype({"Q6_K", "F32"}) == mx.float32  # Q6_K's halves: float32 scales
    assert keep_dtype({"Q4_K", "Q6_K", "F16"}) == mx.float32
    assert keep_dtype({"Q3_K", "Q5_0", "IQ4_NL", "F32"}) == mx.float32  # float16 scales widen exactly
    assert keep_dtype({"Q2_K", "F32"}) == mx.float16  # nothing kept needs float32
    assert keep_dtype({"F16", "Q8_0"}) == mx.float16
    assert keep_dtype({"BF16", "F32"}) == mx.bfloat16


def test_q6_k_is_kept_as_two_exact_halves(tmp_path):
    """Q6_K (scales per 16 weights, int8 over their whole range, d anywhere in float16
    below 256): two 6-bit halves with float32 scales, each holding every other
    sub-block and exact zeros between, whose sum is gguf-py's dequantization bit for
    bit; as stacked experts it stays dequantized."""
    rng = np.random.default_rng(17)
    raw = rng.integers(0, 256, (64 * 4, 210), dtype=np.uint8)
    field = rng.integers(0, 0x5C00, len(raw)).astype(np.uint16) | (rng.integers(0, 2, len(raw)) << 15).astype(np.uint16)
    raw[:, 208:210] = field.view(np.uint8).reshape(-1, 2)
    raw = raw.reshape(64, -1)  # 64 rows of 1024
    assert set(raw.reshape(-1, 210)[:, 192:208].view(np.int8).ravel()) == set(range(-128, 128))
    path, raw = write_one(tmp_path / "t.gguf", "Q6_K", raw=raw)
    pair = read_tensor(GGUFReader(str(path)).tensors[0])
    assert isinstance(pair, QuantizedPair) and pair.shape == (64, 1024) and pair.bits == 6
    low, high = dequantize(pair.low), dequantize(pair.high)
    assert pair.low.scales.dtype == pair.high.scales.dtype == np.float32
    assert (low.reshape(64, -1, 32)[..., 16:] == 0).all() and (high.reshape(64, -1, 32)[..., :16] == 0).all()
    assert_same_bits(low + high, quants.dequantize(raw, GGMLQuantizationType.Q6_K))
    stacked = np.stack([raw[:8], raw[8:16]])  # [E, rows, bytes]
    w = GGUFWriter(str(tmp_path / "e.gguf"), "llama")
    w.add_tensor("blk.0.ffn_down_exps.weight", stacked, raw_dtype=GGMLQuantizationType.Q6_K)
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    experts = read_tensor(GGUFReader(str(tmp_path / "e.gguf")).tensors[0])
    assert isinstance(experts, np.ndarray) and experts.shape == (2, 8, 1024)
