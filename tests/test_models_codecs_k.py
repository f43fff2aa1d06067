"""The K-quant repacks (mola/models/codecs_k.py), which compute on whole 64- and
32-bit words, against a reference that unpacks each block's values one field at a
time as gguf-py does and packs them with codec_forms.pack (a value at a time into
MLX's bit stream): the same bits, written into numpy or into MLX's own arrays
(mx_buffers.empty), whole or a few rows at a time. That the values are gguf-py's
dequantization is tests/test_models_codecs.py's."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import quants

import mola.models.codecs as codecs
from mola.models import mx_buffers
from mola.models.codec_forms import QuantizedPair, pack
from mola.models.codecs_k import q4_k, q6_k_pair
from mola.testing.gguf_model import random_blocks


def _f16(blocks: np.ndarray, at: int) -> np.ndarray:
    return blocks[:, at:at + 2].copy().view(np.float16).astype(np.float32)  # [n, 1]


def q4_k_reference(raw: np.ndarray):
    """(weight, scales, biases) of a Q4_K tensor [rows, bytes]: sub-block 2c is the low
    nibbles of bytes 32c..32c+31, 2c+1 their high ones (gguf-py's Q4_K)."""
    rows, blocks = len(raw), raw.reshape(-1, 144)
    qs = blocks[:, 16:].reshape(-1, 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
    q = (qs & 0x0F).reshape(rows, -1)  # [rows, cols], in column order
    sc, m = quants.Q4_K.get_scale_min(blocks[:, 4:16])
    d, dmin = _f16(blocks, 0), _f16(blocks, 2)
    scales = (d * sc.reshape(-1, 8).astype(np.float32)).reshape(rows, -1)
    biases = -(dmin * m.reshape(-1, 8).astype(np.float32)).reshape(rows, -1)
    return pack(q, 4, rows), scales, biases


def q6_k_reference(raw: np.ndarray):
    """((weight, scales, biases) of each half) of a Q6_K tensor [rows, bytes]: q as
    gguf-py's Q6_K unpacks it (before its - 32), one half's sub-blocks beside 16 q = 32."""
    rows, blocks = len(raw), raw.reshape(-1, 210)
    ql = blocks[:, :128].reshape(-1, 2, 1, 64) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
    qh = blocks[:, 128:192].reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)
    q = ((ql & 0x0F).reshape(-1, 8, 32) | ((qh & 0x03).reshape(-1, 8, 32) << 4)).reshape(-1, 8, 2, 16)
    step = _f16(blocks, 208)[:, :, None] * blocks[:, 192:208].view(np.int8).astype(np.float32).reshape(-1, 8, 2)
    halves = []
    for j in range(2):
        values = np.full(q.shape, 32, np.uint8)
        values[:, :, j] = q[:, :, j]
        halves.append((pack(values, 6, rows), step[..., j].reshape(rows, -1),
                       (np.float32(-32) * step[..., j]).reshape(rows, -1)))
    return halves


def _triples(value):
    parts = (value.low, value.high) if isinstance(value, QuantizedPair) else (value,)
    return [(p.weight, p.scales, p.biases) for p in parts]


def assert_same_triples(got, expected) -> None:
    assert len(got) == len(expected)
    for triple, reference in zip(got, expected):
        for a, b in zip(triple, reference):
            assert a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


@pytest.mark.parametrize("codec, repack, reference", [("Q4_K", q4_k, lambda r: [q4_k_reference(r)]),
                                                      ("Q6_K", q6_k_pair, q6_k_reference)])
@pytest.mark.parametrize("seed", [0, 1])
def test_k_quant_words_are_the_reference_bits(codec, repack, reference, seed):
    raw = random_blocks(codec, 24, 1024, np.random.default_rng(seed))
    # every byte value in every field: the shifts and masks cannot drop a bit unseen
    assert (np.bincount(raw.reshape(-1), minlength=256) > 0).all()
    assert_same_triples(_triples(repack(raw)), reference(raw))


@pytest.mark.parametrize("codec, reference", [("Q4_K", lambda r: [q4_k_reference(r)]), ("Q6_K", q6_k_reference)])
def test_written_into_mlx_arrays_by_chunks_of_rows_is_the_reference(codec, reference, monkeypatch):
    """read_tensor as a load runs it: a few rows at a time (the last chunk shorter),
    into MLX's arrays, which as_mx then hands out without a copy."""
    raw = random_blocks(codec, 37, 512, np.random.default_rng(7))
    monkeypatch.setattr(codecs, "CHUNK_BYTES", 5 * raw.shape[-1])

    class Tensor:  # what read_tensor reads of a gguf-py ReaderTensor
        from gguf import GGMLQuantizationType
        tensor_type, data, name = GGMLQuantizationType[codec], raw, "blk.0.ffn_down.weight"

    value = codecs.read_tensor(Tensor, True, mx_buffers.empty)
    triples = _triples(value)
    assert_same_triples(triples, reference(raw))
    for triple in triples:
        assert all(mx_buffers.owner(a) is not None for a in triple)
