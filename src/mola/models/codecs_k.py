"""Repacks of llama.cpp's K-quants (Q3_K, Q4_K, Q5_K, and Q6_K as a pair) into MLX's
exact affine forms (codecs.py's table); each takes a tensor's raw blocks [rows, row bytes]."""

from __future__ import annotations

import numpy as np

from .codec_forms import Quantized, QuantizedPair, blocks_of, f16, nibble_words, pack, triple


def _scale_min_k4(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's 12 bytes of 6-bit scales and mins -> (sc, m) [n_blocks, 8]
    (llama.cpp's get_scale_min_k4, as gguf-py's Q4_K.get_scale_min)."""
    d, m, m_d = scales[:, 0:4], scales[:, 4:8], scales[:, 8:12]
    sc = np.concatenate([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc, mn


def _k_scales(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's (d*sc, -(dmin*m)) [n_blocks, 8] in float32, where both are exact."""
    d = f16(blocks, 0).astype(np.float32)[:, None]
    dmin = f16(blocks, 2).astype(np.float32)[:, None]
    sc, m = _scale_min_k4(blocks[:, 4:16])
    return d * sc.astype(np.float32), -(dmin * m.astype(np.float32))


def q4_k(data: np.ndarray) -> Quantized:
    blocks = blocks_of(data, 144)  # d, dmin (f16), 12 bytes of scales, 128 bytes of q
    low, high = nibble_words(blocks[:, 16:].reshape(-1, 4, 32))  # 32 bytes: sub-blocks 2c, 2c + 1
    weight = np.stack([low, high], axis=2).reshape(len(data), -1)  # [rows, cols / 8]: 4 words a group
    scales, biases = _k_scales(blocks)
    return Quantized(weight, scales.reshape(len(data), -1), biases.reshape(len(data), -1), 4)


def q5_k(data: np.ndarray) -> Quantized:
    blocks = blocks_of(data, 176)  # d, dmin, 12 bytes of scales, qh[32], qs[128]
    qs = blocks[:, 48:].reshape(-1, 4, 1, 32)
    ql = np.concatenate([qs & 0x0F, qs >> 4], axis=2).reshape(-1, 8, 32)
    qh = (blocks[:, None, 16:48] >> np.arange(8, dtype=np.uint8)[:, None]) & 1  # bit j -> sub-block j
    q = ql | (qh << 4)
    return triple(q, *_k_scales(blocks), 5, len(data), np.float32)


def q3_k(data: np.ndarray) -> Quantized:
    """w = d * (sc - 32) * q, q in [-4, 3] (2 bits + the inverted hmask bit), sc 6-bit
    per 16 weights: d times N = (sc - 32) * q in [-124, 128], as 8 bits q' = 128 - N
    with scale -d and bias 128d (float16, both exact)."""
    blocks = blocks_of(data, 110)  # hmask[32], qs[64], scales[12], d (f16)
    n = len(blocks)
    low, high = blocks[:, 96:104], blocks[:, 104:108]
    sc = (np.concatenate([low & 0x0F, low >> 4], axis=-1)
          | (((high[:, None, :] >> np.array([0, 2, 4, 6], np.uint8)[:, None]) & 3).reshape(n, 16) << 4))
    sc = sc.astype(np.int16) - 32  # [n, 16]
    ql = (blocks[:, None, 32:96].reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8)[:, None]) & 3
    qh = (blocks[:, None, 0:32] >> np.arange(8, dtype=np.uint8)[:, None]) & 1  # [n, 8, 32]
    q = ql.reshape(n, 16, 16).astype(np.int16) - 4 * (1 - qh.reshape(n, 16, 16).astype(np.int16))
    d = f16(blocks, 108)
    scales = np.repeat(-d[:, None], 8, axis=1)
    return triple(128 - sc[:, :, None] * q, scales, -scales * np.float16(128), 8, len(data), np.float16)


def q6_k_pair(data: np.ndarray) -> QuantizedPair:
    """Q6_K [rows, row bytes] -> its exact QuantizedPair. Each block of 256: ql[128]
    (low nibbles), qh[64] (high 2 bits), 16 int8 scales, d (f16); w = (d*sc)*(q - 32)
    per 16 weights (gguf-py's Q6_K.dequantize_blocks, which this unpacks alike). A
    half's group of 32 holds one sub-block, q in [0, 63], scale d*sc (d's 11 bits times
    sc's 8: exact in float32), bias -32*scale, and q = 32 (w = 0 exactly) in the
    other sub-block's 16 places: scale*q is exact (24 bits) and so is its sum with
    the bias, whose true value (d*sc)*(q - 32) float32 holds."""
    rows = len(data)
    blocks = blocks_of(data, 210)
    ql = blocks[:, :128].reshape(-1, 2, 1, 64) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
    ql = (ql & np.uint8(0x0F)).reshape(-1, 2, 128)
    qh = blocks[:, 128:192].reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)
    qh = (qh & np.uint8(0x03)).reshape(-1, 2, 128)
    q = (ql | (qh << np.uint8(4))).reshape(-1, 8, 2, 16)  # [n, group of 32, sub-block, 16]: q + 32
    scales = blocks[:, 192:208].view(np.int8).astype(np.float32).reshape(-1, 8, 2)
    step = f16(blocks, 208).astype(np.float32)[:, None, None] * scales  # [n, 8, 2]: d*sc
    # Each half's group of 32 is one sub-block's 16 values and 16 q = 32, 12 bytes each at
    # 6 bits (stream-aligned), so the sub-blocks are packed once and set beside a filler.
    packed = pack(q, 6, rows).view(np.uint8).reshape(*q.shape[:-1], 12)  # [n, 8, 2, 12]
    filler = np.broadcast_to(pack(np.full(16, 32, np.uint8), 6, 1).view(np.uint8), packed.shape[:-2] + (12,))
    halves = []
    for j, parts in enumerate(((packed[:, :, 0], filler), (filler, packed[:, :, 1]))):
        weight = np.concatenate(parts, -1).reshape(rows, -1).view("<u4")  # [rows, cols * 6 / 32]
        halves.append(Quantized(weight, step[..., j].reshape(rows, -1),
                                (np.float32(-32) * step[..., j]).reshape(rows, -1), 6))
    return QuantizedPair(*halves)


