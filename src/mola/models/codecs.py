"""GGUF tensor types ("codecs") -> arrays mola can hold, read with gguf-py.

What mola does with each codec:

    F32, F16, BF16              as stored
    Q4_0, Q4_1, Q8_0            kept quantized: repacked, bit for bit, into MLX's affine
                                format (group 32; 4 or 8 bits; float16 scales and biases),
                                which represents them exactly: Q4_0  w = d * (q - 8),
                                Q4_1  w = d * q + m,  Q8_0  w = d * q  (q signed)
    every other codec gguf-py   dequantized to float32 by gguf-py (llama.cpp's own
    dequantizes (K-quants,      Python port of its dequantization), then cast to the
    Q5_0/1, IQ*, TQ*, MXFP4,    model's dtype (tests/test_models_codecs.py checks each
    NVFP4)                      but NVFP4)
    the rest (Q8_1, Q8_K,       refused, naming the codec and the tensor
    integers, F64, unknown ids)

MLX's own GGUF reader (mx.load) is not used: MLX 0.32.4 turns codecs it does not map
into float16, with wrong values for Q4_K (on random valid blocks: max error 32 on
weights of magnitude 47, against gguf-py), and raises on Q5_0/Q5_1/Q3_K/Q5_K/IQ*, so
one such tensor would keep a whole file from loading. The kept codecs' triples are
checked bit for bit against mx.load's in tests/test_models_codecs.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import ModelLoadError

GROUP_SIZE = 32  # every kept codec quantizes blocks of 32 along the input dimension


class UnsupportedTensor(ModelLoadError):
    """A GGUF tensor mola cannot turn into exact weights."""


@dataclass(frozen=True)
class Quantized:
    """MLX's affine quantization of a [rows, cols] matrix (or of stacked experts'
    [E, rows, cols]): w = scales * q + biases per group of GROUP_SIZE columns."""

    weight: np.ndarray  # uint32 [(E,) rows, cols * bits / 32]
    scales: np.ndarray  # float16 [(E,) rows, cols / 32]
    biases: np.ndarray  # float16 [(E,) rows, cols / 32]
    bits: int

    @property
    def shape(self) -> tuple[int, ...]:
        return (*self.weight.shape[:-1], self.weight.shape[-1] * 32 // self.bits)


# A tensor as mola holds it: a float numpy array (bfloat16 as its uint16 bits, see
# BFloat16) or a Quantized triple.
@dataclass(frozen=True)
class BFloat16:
    bits: np.ndarray  # uint16, the bfloat16 values' bit patterns

    @property
    def shape(self) -> tuple[int, ...]:
        return self.bits.shape


KEPT = ("Q4_0", "Q4_1", "Q8_0")
FLOATS = ("F32", "F16", "BF16")


def codec_name(kind) -> str:
    return getattr(kind, "name", str(kind))


def _blocks(data: np.ndarray, block_bytes: int) -> np.ndarray:
    rows = data.shape[0]
    return np.ascontiguousarray(data).reshape(rows, -1, block_bytes)  # [rows, n_blocks, bytes]


def _f16(blocks: np.ndarray, offset: int) -> np.ndarray:
    """The float16 field at byte ``offset`` of every block: [rows, n_blocks]."""
    return np.ascontiguousarray(blocks[..., offset:offset + 2]).view(np.float16)[..., 0]


def _pack(values: np.ndarray, bits: int) -> np.ndarray:
    """Unsigned ``bits``-bit values [rows, n_blocks, 32] (in column order) -> MLX's
    packing: uint32 words, element k of a word in bits [k*bits, (k+1)*bits)."""
    rows = values.shape[0]
    if bits == 4:
        values = values[..., 0::2] | (values[..., 1::2] << 4)  # [rows, n_blocks, 16] bytes
    return np.ascontiguousarray(values.astype(np.uint8)).reshape(rows, -1).view("<u4")


def _q4_0(data: np.ndarray) -> Quantized:
    blocks = _blocks(data, 18)  # d (f16), 16 bytes: q[j] low nibble, q[j + 16] high
    d = _f16(blocks, 0)
    qs = blocks[..., 2:]
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)  # [rows, n_blocks, 32]
    return Quantized(_pack(q, 4), d, (d * np.float16(-8)).astype(np.float16), 4)


def _q4_1(data: np.ndarray) -> Quantized:
    blocks = _blocks(data, 20)  # d (f16), m (f16), 16 bytes of nibbles as in Q4_0
    d, m = _f16(blocks, 0), _f16(blocks, 2)
    qs = blocks[..., 4:]
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)
    return Quantized(_pack(q, 4), d, m, 4)


def _q8_0(data: np.ndarray) -> Quantized:
    blocks = _blocks(data, 34)  # d (f16), 32 signed bytes
    d = _f16(blocks, 0)
    q = blocks[..., 2:] ^ np.uint8(0x80)  # int8 q -> unsigned q + 128
    return Quantized(_pack(q, 8), d, (d * np.float16(-128)).astype(np.float16), 8)


_REPACK = {"Q4_0": _q4_0, "Q4_1": _q4_1, "Q8_0": _q8_0}


def read_tensor(tensor):
    """A gguf-py ReaderTensor -> np.ndarray (float32/float16), BFloat16 or Quantized."""
    from gguf import GGMLQuantizationType as T
    from gguf import quants

    kind = tensor.tensor_type
    name = codec_name(kind)
    data = tensor.data
    if kind in (T.F32, T.F16):
        return np.asarray(data)
    if kind == T.BF16:
        return BFloat16(np.ascontiguousarray(data).view(np.uint16))
    if name in _REPACK and data.ndim in (2, 3):  # a matrix, or stacked experts [E, rows, bytes]
        packed = _REPACK[name](data.reshape(-1, data.shape[-1]))
        if np.isfinite(packed.biases).all():  # -8d / -128d past float16's range: dequantize
            lead = data.shape[:-1]
            return Quantized(*(a.reshape(*lead, -1) for a in (packed.weight, packed.scales, packed.biases)),
                             packed.bits)
    try:
        return quants.dequantize(np.asarray(data), kind)
    except (NotImplementedError, KeyError, ValueError) as e:
        raise UnsupportedTensor(
            f"tensor '{tensor.name}' is stored as {name}, which mola cannot read: neither "
            f"kept quantized ({', '.join(KEPT)}) nor dequantized by gguf-py ({e})."
        ) from None
