"""Repacks of llama.cpp's K-quants (Q3_K, Q4_K, Q5_K, and Q6_K as a pair) into MLX's
exact affine forms (codecs.py's table); each takes a tensor's raw blocks [rows, row bytes]."""

from __future__ import annotations

import numpy as np

from .codec_forms import Quantized, QuantizedPair, blocks_of, f16, nibble_words, pack, triple, u64_of


def _scale_min_k4(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's 12 bytes of 6-bit scales and mins (bytes 4-15 of each block) ->
    (sc, m) uint8 [n_blocks, 8] (llama.cpp's get_scale_min_k4, as gguf-py's
    Q4_K.get_scale_min), computed on their three 32-bit words d, m, m_d: sc is d's
    low 6 bits, then m_d's low nibbles and d's top 2 bits; m likewise from m and
    m_d's high nibbles."""
    d, m, md = np.ascontiguousarray(blocks[:, 4:16]).view("<u4").T
    sc, mn = np.empty((2, len(blocks), 2), "<u4")
    sc[:, 0] = d & 0x3F3F3F3F
    sc[:, 1] = (md & 0x0F0F0F0F) | ((d >> 2) & 0x30303030)
    mn[:, 0] = m & 0x3F3F3F3F
    mn[:, 1] = ((md >> 4) & 0x0F0F0F0F) | ((m >> 2) & 0x30303030)
    return sc.view(np.uint8), mn.view(np.uint8)


def _k_scales(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's (d*sc, -(dmin*m)) [n_blocks, 8] in float32, where both are exact."""
    d = f16(blocks, 0).astype(np.float32)[:, None]
    dmin = f16(blocks, 2).astype(np.float32)[:, None]
    sc, m = _scale_min_k4(blocks)
    return d * sc, -(dmin * m)


def q4_k(data: np.ndarray) -> Quantized:
    blocks = blocks_of(data, 144)  # d, dmin (f16), 12 bytes of scales, 128 bytes of q
    # each 32 bytes c: sub-block 2c in the low nibbles, 2c + 1 in the high ones, 4 words each
    words = nibble_words(blocks[:, 16:]).reshape(-1, 4, 4, 2)  # [n, c, word, low/high]
    weight = np.ascontiguousarray(words.transpose(0, 1, 3, 2)).reshape(len(data), -1)  # [rows, cols / 8]
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


_NIBBLE_SHIFTS = np.array([0, 4], np.uint64).reshape(1, 2, 1, 1, 1)  # [h, which nibble, b, w, n]
_PAIR_SHIFTS = np.array([0, 2, 4, 6], np.uint64).reshape(1, 4, 1, 1)  # [h, t, w, n]
_SIX_BIT_MERGES = tuple((np.uint64(k), np.uint64(low), np.uint64(high)) for k, low, high in (
    (2, 0x00FF00FF00FF00FF, 0xFF00FF00FF00FF00), (4, 0x0000FFFF0000FFFF, 0xFFFF0000FFFF0000),
    (8, 0x00000000FFFFFFFF, 0xFFFFFFFF00000000)))
_FILLER = pack(np.full(16, 32, np.uint8), 6, 1).reshape(3, 1)  # 16 q = 32 (w = 0): 3 words


def _six_bit_words(v: np.ndarray) -> np.ndarray:
    """uint64 [..., 2, n], each word eight 6-bit values a byte, two words 16 values ->
    uint64 [..., 2, n] of 48 bits each: the values' little-endian 6-bit stream."""
    for k, low, high in _SIX_BIT_MERGES:  # lanes of 16, 32, 64 bits: the upper half's value moved down
        v = (v & low) | ((v & high) >> k)
    return v


def q6_k_pair(data: np.ndarray) -> QuantizedPair:
    """Q6_K [rows, row bytes] -> its exact QuantizedPair. Each block of 256: ql[128]
    (low nibbles), qh[64] (high 2 bits), 16 int8 scales, d (f16); w = (d*sc)*(q - 32)
    per 16 weights (gguf-py's Q6_K.dequantize_blocks, which this unpacks alike). A
    half's group of 32 holds one sub-block, q in [0, 63], scale d*sc (d's 11 bits times
    sc's 8: exact in float32), bias -32*scale, and q = 32 (w = 0 exactly) in the
    other sub-block's 16 places: scale*q is exact (24 bits) and so is its sum with
    the bias, whose true value (d*sc)*(q - 32) float32 holds.

    Weight 128h + 32t + i of a block (group 4h + t, t = 2a + b) is ql[64h + 32b + i]'s
    nibble a and bits 2t, 2t + 1 of qh[32h + i]: computed on 64-bit words of 8 i
    (w = i // 8), transposed so that every operation runs along the blocks n."""
    rows = len(data)
    blocks = blocks_of(data, 210)
    n = len(blocks)
    ql = np.ascontiguousarray(np.ascontiguousarray(blocks[:, :128]).view("<u8").T)  # [h, b, w, n]
    qh = np.ascontiguousarray(np.ascontiguousarray(blocks[:, 128:192]).view("<u8").T)  # [h, w, n]
    low = (ql.reshape(2, 1, 2, 4, n) >> _NIBBLE_SHIFTS) & u64_of(0x0F)  # [h, a, b, w, n]
    high = (qh.reshape(2, 1, 4, n) >> _PAIR_SHIFTS) & u64_of(0x03)  # [h, t, w, n]
    v = low.reshape(2, 4, 4, n) | (high << np.uint64(4))  # [h, t, w, n]: q + 32, a byte each
    c = _six_bit_words(v).reshape(8, 2, 2, n)  # [group, sub-block, its two words, n]
    c0, c1 = c[:, :, 0], c[:, :, 1]
    scales = blocks[:, 192:208].view(np.int8).astype(np.float32).reshape(-1, 8, 2)
    step = f16(blocks, 208).astype(np.float32)[:, None, None] * scales  # [n, 8, 2]: d*sc
    halves = []
    for j in range(2):  # half j: sub-block j of each group, the filler in the other's 3 words
        words = np.empty((8, 2, 3, n), np.uint32)  # [group, sub-block, word, n]: 96 bits a sub-block
        words[:, j, 0] = c0[:, j]
        words[:, j, 1] = (c0[:, j] >> np.uint64(32)) | (c1[:, j] << np.uint64(16))
        words[:, j, 2] = c1[:, j] >> np.uint64(16)
        words[:, 1 - j] = _FILLER
        weight = np.ascontiguousarray(words.reshape(48, n).T).reshape(rows, -1)  # [rows, cols * 6 / 32]
        halves.append(Quantized(weight, step[..., j].reshape(rows, -1),
                                (np.float32(-32) * step[..., j]).reshape(rows, -1), 6))
    return QuantizedPair(*halves)
