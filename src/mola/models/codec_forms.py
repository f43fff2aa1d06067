"""The forms a GGUF tensor takes in mola once read (codecs.py): float numpy arrays,
BFloat16 bit patterns, MLX affine-quantized triples (Quantized) and pairs of them
(QuantizedPair); which codecs stay quantized under ``--dtype keep`` (KEPT_FORMATS,
PAIRED_FORMATS); the bytes each takes; and the bit-level helpers the repacks share
(codecs_legacy.py, codecs_k.py, codecs_iq.py)."""

from __future__ import annotations

from dataclasses import dataclass
from math import prod

import numpy as np

from ..errors import ModelLoadError

GROUP_SIZE = 32  # every kept codec quantizes groups of 32 along the input dimension


class UnsupportedTensor(ModelLoadError):
    """A GGUF tensor mola cannot turn into exact weights."""


@dataclass(frozen=True)
class Quantized:
    """MLX's affine quantization of a [rows, cols] matrix (or of stacked experts'
    [E, rows, cols]): w = scales * q + biases per group of GROUP_SIZE columns."""

    weight: np.ndarray  # uint32 [(E,) rows, cols * bits / 32]
    scales: np.ndarray  # float16 or float32 (KEPT_FORMATS) [(E,) rows, cols / 32]
    biases: np.ndarray  # the same dtype and shape as scales
    bits: int

    @property
    def shape(self) -> tuple[int, ...]:
        return (*self.weight.shape[:-1], self.weight.shape[-1] * 32 // self.bits)


@dataclass(frozen=True)
class QuantizedPair:
    """A matrix [rows, cols] held as the sum of two affine-quantized halves of the same
    shape, each holding every other 16-weight sub-block and zeros between (Q6_K: see
    the module docstring); models/quantized_pair.py computes with it."""

    low: Quantized  # sub-blocks 0, 2, 4, ... (the first 16 weights of each group of 32)
    high: Quantized  # sub-blocks 1, 3, 5, ... (the last 16)

    @property
    def shape(self) -> tuple[int, ...]:
        return self.low.shape

    @property
    def bits(self) -> int:
        return self.low.bits


# A tensor as mola holds it: a float numpy array (bfloat16 as its uint16 bits, see
# BFloat16), a Quantized triple or a QuantizedPair.
@dataclass(frozen=True)
class BFloat16:
    bits: np.ndarray  # uint16, the bfloat16 values' bit patterns

    @property
    def shape(self) -> tuple[int, ...]:
        return self.bits.shape


# codec -> (bits, scales' dtype) of its MLX affine form (the module docstring's table)
KEPT_FORMATS: dict[str, tuple[int, type]] = {
    "Q4_0": (4, np.float16), "Q4_1": (4, np.float16), "Q5_0": (5, np.float16),
    "Q5_1": (5, np.float16), "Q8_0": (8, np.float16), "Q3_K": (8, np.float16),
    "Q4_K": (4, np.float32), "Q5_K": (5, np.float32), "IQ4_NL": (8, np.float16),
    "IQ4_XS": (8, np.float32), "IQ3_S": (4, np.float32), "IQ3_XXS": (6, np.float32),
    "IQ2_XXS": (8, np.float32), "IQ1_S": (2, np.float32),
}
# codec -> (bits, scales' dtype) of each half of its QuantizedPair (matrices only)
PAIRED_FORMATS: dict[str, tuple[int, type]] = {"Q6_K": (6, np.float32)}
KEPT = (*KEPT_FORMATS, *PAIRED_FORMATS)
F32_SCALES = tuple(c for c, (_, dt) in {**KEPT_FORMATS, **PAIRED_FORMATS}.items() if dt == np.float32)


def is_kept(codec, ndim: int) -> bool:
    """Whether ``--dtype keep`` keeps a tensor of ``codec`` and ``ndim`` dimensions
    quantized: a KEPT_FORMATS matrix or expert stack, a PAIRED_FORMATS matrix."""
    name = codec_name(codec)
    return (name in KEPT_FORMATS and ndim in (2, 3)) or (name in PAIRED_FORMATS and ndim == 2)
FLOATS = ("F32", "F16", "BF16")


def codec_name(kind) -> str:
    return getattr(kind, "name", str(kind))


# ---- sizes -----------------------------------------------------------------------


def nbytes(value) -> int:
    """The bytes a held value takes: a numpy (or mx) array, BFloat16 or Quantized."""
    if isinstance(value, QuantizedPair):
        return nbytes(value.low) + nbytes(value.high)
    if isinstance(value, Quantized):
        return int(value.weight.nbytes + value.scales.nbytes + value.biases.nbytes)
    if isinstance(value, BFloat16):
        return int(value.bits.nbytes)
    return int(value.nbytes)


def held_nbytes(tensor_type, shape, dtype_bytes: int, keep: bool) -> int:
    """The bytes a GGUF tensor of ``tensor_type`` (a GGMLQuantizationType or its name)
    and ``shape`` (any order, e.g. a ReaderTensor's ne) takes once loaded, from its type
    and shape alone: kept quantized (``keep`` and a KEPT codec, a matrix or expert
    stack: weight + scales + biases, the scales widened to float32 where the compute
    dtype is float32, as models/gguf.py ``_to_mx`` does), else as ``dtype_bytes``-byte
    floats (the compute dtype's size: 2 or 4). An estimate only where the data decide:
    a kept codec whose -8d/-16d/-128d bias overflows float16 is dequantized instead."""
    n = prod(int(s) for s in shape)
    name = codec_name(tensor_type)
    if keep and is_kept(name, len(shape)) and n % GROUP_SIZE == 0:
        bits, scale_dtype = {**KEPT_FORMATS, **PAIRED_FORMATS}[name]
        scale_bytes = 4 if dtype_bytes == 4 else np.dtype(scale_dtype).itemsize
        halves = 2 if name in PAIRED_FORMATS else 1
        return halves * (n * bits // 8 + 2 * (n // GROUP_SIZE) * scale_bytes)
    return n * dtype_bytes


# ---- helpers the repacks share -----------------------------------------------------


def blocks_of(data: np.ndarray, block_bytes: int) -> np.ndarray:
    """[rows, row bytes] -> the blocks of all rows [rows * n_blocks, block_bytes]."""
    return np.ascontiguousarray(data).reshape(-1, block_bytes)


def f16(blocks: np.ndarray, offset: int) -> np.ndarray:
    """The float16 field at byte ``offset`` of every block: [n_blocks]."""
    return np.ascontiguousarray(blocks[:, offset:offset + 2]).view(np.float16)[:, 0]


def u32(blocks: np.ndarray, start: int, stop: int) -> np.ndarray:
    """Bytes [start, stop) of every block as little-endian uint32 [n_blocks, words]."""
    return np.ascontiguousarray(blocks[:, start:stop]).view("<u4")


def nibbles(qs: np.ndarray) -> np.ndarray:
    """[..., 16] bytes -> [..., 32] values: the low nibbles, then the high ones."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def u64_of(byte: int) -> np.uint64:
    """A byte in every byte of a uint64 (a mask for whole-word operations)."""
    return np.uint64(int.from_bytes(bytes([byte]) * 8, "little"))


# (shift, the bits that stay, the bits moved down, the bits moved up) of the three
# swaps nibble_words makes in each 16-, 32- and 64-bit lane of a uint64
_SWAPS = tuple((np.uint64(k), np.uint64(keep), np.uint64(down), np.uint64(up)) for k, keep, down, up in (
    (4, 0xF00FF00FF00FF00F, 0x00F000F000F000F0, 0x0F000F000F000F00),
    (8, 0xFF0000FFFF0000FF, 0x0000FF000000FF00, 0x00FF000000FF0000),
    (16, 0xFFFF00000000FFFF, 0x00000000FFFF0000, 0x0000FFFF00000000)))


def nibble_words(qs: np.ndarray) -> np.ndarray:
    """[..., 8k] bytes -> uint32 [..., k, 2]: of each 8 bytes, the word of their low
    nibbles and the word of their high ones, in MLX's 4-bit order (nibble j of a word
    is byte j's). On whole 64-bit words: swapping the middle two quarters of each
    16-bit lane makes its bytes (low nibbles, high nibbles) of its two bytes; of each
    32-bit lane, then of the 64-bit word, gathers the low ones below the high ones."""
    x = np.ascontiguousarray(qs).view("<u8")
    for k, keep, down, up in _SWAPS:
        x = (x & keep) | ((x >> k) & down) | ((x << k) & up)
    return x.view("<u4").reshape(*x.shape, 2)


def bits_of(field: np.ndarray, count: int) -> np.ndarray:
    """[n, bytes] -> [n, count] of its bits, little-endian (bit k of byte k // 8 first)."""
    return np.unpackbits(np.ascontiguousarray(field), axis=-1, count=count, bitorder="little")


def pack(values: np.ndarray, bits: int, rows: int) -> np.ndarray:
    """Unsigned ``bits``-bit values (any shape, row-major in column order, ``rows``
    rows) -> MLX's packing [rows, cols * bits / 32] uint32: a little-endian bit
    stream, value k of a row in bits [k*bits, (k+1)*bits)."""
    values = np.ascontiguousarray(values, dtype=np.uint8).reshape(rows, -1)
    if bits == 8:
        packed = values
    elif bits == 4:
        packed = values[:, 0::2] | (values[:, 1::2] << 4)
    else:  # 8 values -> ``bits`` bytes: value k at stream bits [bits*k, bits*(k+1))
        eight = values.reshape(rows, -1, 8)
        packed = np.zeros((*eight.shape[:-1], bits), np.uint8)
        for k in range(8):
            byte, shift = divmod(bits * k, 8)
            packed[..., byte] |= eight[..., k] << np.uint8(shift)  # uint8: the high bits drop
            if shift + bits > 8:
                packed[..., byte + 1] |= eight[..., k] >> np.uint8(8 - shift)
    return np.ascontiguousarray(packed).reshape(rows, -1).view("<u4")


def triple(q: np.ndarray, scales: np.ndarray, biases: np.ndarray, bits: int, rows: int,
            dtype) -> Quantized:
    """Quantized from values q [rows * ..., 32 per group], scales and biases (one per
    group, in column order)."""
    return Quantized(pack(q, bits, rows), np.asarray(scales, dtype).reshape(rows, -1),
                     np.asarray(biases, dtype).reshape(rows, -1), bits)

