"""Repacks of llama.cpp's first codecs (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) into MLX's exact
affine form (codecs.py's table); each takes a tensor's raw blocks [rows, row bytes]."""

from __future__ import annotations

import numpy as np

from .codec_forms import Quantized, bits_of, blocks_of, f16, nibbles, triple


def q4_0(data: np.ndarray) -> Quantized:
    blocks = blocks_of(data, 18)  # d (f16), 16 bytes: q[j] low nibble, q[j + 16] high
    d = f16(blocks, 0)
    return triple(nibbles(blocks[:, 2:]), d, d * np.float16(-8), 4, len(data), np.float16)


def q4_1(data: np.ndarray) -> Quantized:
    blocks = blocks_of(data, 20)  # d (f16), m (f16), 16 bytes of nibbles as in Q4_0
    return triple(nibbles(blocks[:, 4:]), f16(blocks, 0), f16(blocks, 2), 4, len(data), np.float16)


def _q5(blocks: np.ndarray, qh_at: int) -> np.ndarray:
    """Q5_0/Q5_1's 5-bit q [n_blocks, 32]: bit j of the uint32 qh is q[j]'s high bit."""
    return nibbles(blocks[:, qh_at + 4:]) | (bits_of(blocks[:, qh_at:qh_at + 4], 32) << 4)


def q5_0(data: np.ndarray) -> Quantized:
    blocks = blocks_of(data, 22)  # d (f16), qh (u32), 16 bytes of nibbles: w = d * (q - 16)
    d = f16(blocks, 0)
    return triple(_q5(blocks, 2), d, d * np.float16(-16), 5, len(data), np.float16)


def q5_1(data: np.ndarray) -> Quantized:
    blocks = blocks_of(data, 24)  # d (f16), m (f16), qh (u32), 16 bytes: w = d * q + m
    return triple(_q5(blocks, 4), f16(blocks, 0), f16(blocks, 2), 5, len(data), np.float16)


def q8_0(data: np.ndarray) -> Quantized:
    blocks = blocks_of(data, 34)  # d (f16), 32 signed bytes
    d = f16(blocks, 0)
    q = blocks[:, 2:] ^ np.uint8(0x80)  # int8 q -> unsigned q + 128
    return triple(q, d, d * np.float16(-128), 8, len(data), np.float16)

