"""Repacks of llama.cpp's i-quants (IQ4_NL, IQ4_XS, IQ2_XXS, IQ3_XXS, IQ3_S, IQ1_S) into
MLX's exact affine forms (codecs.py's table); each takes a tensor's raw blocks [rows, row bytes]."""

from __future__ import annotations

from functools import cache

import numpy as np

from .codec_forms import Quantized, bits_of, blocks_of, f16, nibbles, triple, u32

IQ4NL_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)  # kvalues_iq4nl
_IQ4NL_Q = np.array(IQ4NL_VALUES, np.int16).astype(np.uint8) ^ np.uint8(0x80)  # value + 128


def iq4_nl(data: np.ndarray) -> Quantized:
    blocks = blocks_of(data, 18)  # d (f16), 16 bytes of nibbles as in Q4_0, indexing kvalues
    d = f16(blocks, 0)
    return triple(_IQ4NL_Q[nibbles(blocks[:, 2:])], d, d * np.float16(-128), 8, len(data), np.float16)


def iq4_xs(data: np.ndarray) -> Quantized:
    blocks = blocks_of(data, 136)  # d (f16), scales_h (u16), scales_l[4], qs[128]
    n = len(blocks)
    d = f16(blocks, 0).astype(np.float32)[:, None]
    scales_h = np.ascontiguousarray(blocks[:, 2:4]).view("<u2")  # [n, 1]
    low = blocks[:, 4:8]
    ls_low = np.stack([low & 0x0F, low >> 4], axis=-1).reshape(n, 8)  # sub-block 2i, 2i + 1
    ls_high = (scales_h >> np.arange(0, 16, 2, dtype=np.uint16)) & 3
    dl = d * ((ls_low | (ls_high.astype(np.uint8) << 4)).astype(np.float32) - 32)  # exact: 16 bits
    q = _IQ4NL_Q[nibbles(blocks[:, 8:].reshape(n, 8, 16))]
    return triple(q, dl, dl * np.float32(-128), 8, len(data), np.float32)


@cache
def _grid(codec: str) -> np.ndarray:
    """gguf-py's copy of llama.cpp's grid table for an IQ codec, as integers [entries, k]."""
    from gguf import quants

    cls = getattr(quants, codec)
    cls.init_grid()
    return cls.grid.reshape(cls.grid_shape).astype(np.int16)


@cache
def _ksigns() -> np.ndarray:
    """llama.cpp's ksigns_iq2xs: 7 sign bits -> 8 (the 8th makes the count even), [128, 8]."""
    from gguf import quants

    table = np.frombuffer(quants.IQ2_XXS.ksigns, np.uint8)
    return np.where((table[:, None] >> np.arange(8, dtype=np.uint8)) & 1, -1, 1).astype(np.int16)


def _signed_grid(codec: str, index: np.ndarray, aux: np.ndarray) -> np.ndarray:
    """IQ2_XXS/IQ3_XXS: grid values [n, 8 sub-blocks, 32] with the signs of ``aux``
    (uint32 [n, 8]: four 7-bit sign indices, one per 8 weights)."""
    n = len(index)
    grid = _grid(codec)[index].reshape(n, 8, 4, 8)
    signs = _ksigns()[(aux[..., None] >> np.array([0, 7, 14, 21], np.uint32)) & 0x7F]  # [n, 8, 4, 8]
    return (grid * signs).reshape(n, 8, 32)


def iq2_xxs(data: np.ndarray) -> Quantized:
    """db * v, v in +-{8, 25, 43}, db = d * (0.5 + s) / 4 per 32: q = v + 128."""
    blocks = blocks_of(data, 66)  # d (f16), 8 x (u32 four grid indices, u32 signs and scale)
    words = u32(blocks, 2, 66).reshape(-1, 8, 2)
    index = np.ascontiguousarray(words[..., 0]).view(np.uint8).reshape(len(blocks), 32)
    v = _signed_grid("IQ2_XXS", index, words[..., 1])
    d = f16(blocks, 0).astype(np.float32)[:, None]
    db = d * (np.float32(0.5) + (words[..., 1] >> 28).astype(np.float32)) * np.float32(0.25)
    return triple(v + 128, db, db * np.float32(-128), 8, len(data), np.float32)


def iq3_xxs(data: np.ndarray) -> Quantized:
    """db * v, v even in [-62, 62], db = d * (0.5 + s) / 2 per 32: q = v/2 + 31, scale 2db."""
    blocks = blocks_of(data, 98)  # d (f16), 64 grid indices (4 weights each), 8 x u32 signs and scale
    aux = u32(blocks, 66, 98)
    v = _signed_grid("IQ3_XXS", blocks[:, 2:66], aux)
    d = f16(blocks, 0).astype(np.float32)[:, None]
    db = d * (np.float32(0.5) + (aux >> 28).astype(np.float32)) * np.float32(0.5)
    return triple(v // 2 + 31, 2 * db, db * np.float32(-62), 6, len(data), np.float32)


def iq3_s(data: np.ndarray) -> Quantized:
    """db * v, v odd in [-15, 15], db = d * (1 + 2s) per 32: q = (v + 15) / 2, scale 2db."""
    blocks = blocks_of(data, 110)  # d (f16), qs[64], qh[8], signs[32], scales[4]
    n = len(blocks)
    index = blocks[:, 2:66].astype(np.uint16) | (bits_of(blocks[:, 66:74], 64).astype(np.uint16) << 8)
    grid = _grid("IQ3_S")[index].reshape(n, 256)
    v = np.where(bits_of(blocks[:, 74:106], 256), -grid, grid)
    s = blocks[:, 106:110]
    s = np.stack([s & 0x0F, s >> 4], axis=-1).reshape(n, 8)
    db = f16(blocks, 0).astype(np.float32)[:, None] * (1 + 2 * s).astype(np.float32)
    return triple((v + 15) // 2, 2 * db, db * np.float32(-15), 4, len(data), np.float32)


def iq1_s(data: np.ndarray) -> Quantized:
    """dl * (g + delta), g in {-1, 0, 1}, delta +-1/8, dl = d * (2s + 1) per 32: q = g + 1,
    scale dl, bias dl * (delta - 1)."""
    blocks = blocks_of(data, 50)  # d (f16), qs[32], qh (8 x u16: 4 x 3 index bits, 3-bit s, sign)
    n = len(blocks)
    qh = np.ascontiguousarray(blocks[:, 34:50]).view("<u2")  # [n, 8]
    high = (qh[..., None] >> np.array([0, 3, 6, 9], np.uint16)) & 7  # [n, 8, 4]
    index = blocks[:, 2:34].astype(np.uint16) | (high.reshape(n, 32) << 8)
    g = _grid("IQ1_S")[index].reshape(n, 8, 32)
    dl = f16(blocks, 0).astype(np.float32)[:, None] * (2 * ((qh >> 12) & 7) + 1).astype(np.float32)
    delta = np.where(qh & 0x8000, np.float32(-0.125), np.float32(0.125))
    return triple(g + 1, dl, dl * (delta - np.float32(1)), 2, len(data), np.float32)


