"""GGUF tensor types ("codecs") -> arrays mola can hold, read with gguf-py.

``--dtype keep`` keeps a codec quantized wherever MLX's affine format (``w = scales *
q + biases`` per group of 32 weights along a row, q unsigned, 2-8 bits) holds every
weight of it bit for bit; the repacks below are checked against gguf-py's
dequantization (llama.cpp's own Python port) in tests/test_models_codecs.py. A float
``--dtype`` (and, under keep too, every codec not kept) gets gguf-py's float32 values,
cast to that dtype. Bits per weight ("bpw") held kept: bits + 2 scales per 32 weights,
in the compute dtype models/gguf.py keep_dtype picks: float16 or float32 (float16
scales widened exactly), never float16 where a codec has float32 scales ("-").

    codec      file bpw  --dtype keep: bits, scales   held bpw  the exact form (d, dmin: the
                                                      computing file's float16 fields)
                                                      in f16/f32
    F32/F16/BF16         as stored (cast to the compute dtype)
    Q4_0       4.5       4 bits, float16              5 / 6     d*(q-8): scale d, bias -8d
    Q4_1       5.0       4 bits, float16              5 / 6     d*q + m
    Q5_0       5.5       5 bits, float16              6 / 7     d*(q-16): scale d, bias -16d
    Q5_1       6.0       5 bits, float16              6 / 7     d*q + m
    Q8_0       8.5       8 bits, float16              9 / 10    d*q8: q = q8 + 128, bias -128d
    Q3_K       3.44      8 bits, float16              9 / 10    d*(sc-32)*q3 is d times an
                                                                integer N in [-124, 128] (every
                                                                16-weight scale folded in): q =
                                                                128 - N, scale -d, bias 128d
    Q4_K       4.5       4 bits, float32              - / 6     (d*sc)*q - dmin*m per 32
    Q5_K       5.5       5 bits, float32              - / 7     the same, 5-bit q
    IQ4_NL     4.5       8 bits, float16              9 / 10    d*kv[q], kv (llama.cpp's
                                                                kvalues_iq4nl) integers in
                                                                [-127, 113]: q = kv + 128, bias -128d
    IQ4_XS     4.25      8 bits, float32              - / 10    (d*(ls-32))*kv[q] per 32: as IQ4_NL
    IQ3_S      3.44      4 bits, float32              - / 6     db*v, v odd in [-15, 15] (grid x
                                                                sign), db = d*(1+2s) per 32: q =
                                                                (v+15)/2, scale 2db, bias -15db
    IQ3_XXS    3.06      6 bits, float32              - / 8     db*v, v even in [-62, 62], db =
                                                                d*(0.5+s)/2 per 32: q = v/2 + 31,
                                                                scale 2db, bias -62db
    IQ2_XXS    2.06      8 bits, float32              - / 10    db*v, v in +-{8, 25, 43}, db =
                                                                d*(0.5+s)/4 per 32: q = v + 128
    IQ1_S      1.56      2 bits, float32              - / 4     dl*(g+delta), g in {-1, 0, 1},
                                                                delta +-1/8, dl = d*(2s+1) per 32:
                                                                q = g + 1, bias dl*(delta-1)
    Q6_K       6.56      a pair of 6-bit halves,      - / 16    (d*sc)*(q-32) per 16: each half
                         float32 (matrices only;                holds every other sub-block, scale
                         expert stacks are                      d*sc, bias -32*d*sc, and q = 32
                         dequantized)                           (exactly 0) in the other's places;
                                                                their sum is the weight (two
                                                                quantized matmuls:
                                                                models/quantized_pair.py)
    Q2_K, IQ2_XS,        dequantized by gguf-py to float32, then cast; under keep to
    IQ2_S, IQ1_M,        float32 (32 bpw) if the file has a float32-scaled kept codec,
    TQ1_0, TQ2_0,        else float16 (16 bpw, rounded); see "Not kept" below
    MXFP4, NVFP4
    the rest (Q8_1, Q8_K, refused, naming the codec and the tensor
    integers, F64, unknown ids)

Why float32 scales: d is float16 (an 11-bit significand) and sc, m are 6-bit, so
d*sc needs up to 17 significant bits, which neither float16 (11) nor bfloat16 (8)
holds; float32 (24) holds it exactly, and then scale*q is exact too (17 + 5 bits),
so the only rounding in scale*q + bias is the addition, the one rounding of gguf-py's
and llama.cpp's ``d1 * q - m1``. Likewise IQ4_XS's d*(ls-32) (16 bits, times 8-bit q: 24),
IQ3_S's and IQ3_XXS's and IQ2_XXS's db (16 bits, times q of at most 8 bits) and
IQ1_S's dl (14 bits). Where every product and bias is exact and the true value is
representable (all kept codecs but Q4_1, Q5_1, Q4_K, Q5_K, which round once exactly as
gguf-py does), MLX's result equals gguf-py's whatever order it computes in (fused or
not), signed zeros aside: where the integer is 0 and the scale negative, gguf-py's
product is -0.0 and MLX's scale*q + bias +0.0.

No exact single MLX matrix exists in general for the codecs below (MLX has no group
of 16 and at most 8 bits): a group of 32 is exact only if its 32 weights lie on one
arithmetic progression of at most 2^8 points.
  Q6_K (kept as a pair instead): w = d*sc*q, sc int8 per 16 weights, q in [-32, 31]: a
    group holds two sub-blocks, d*sc1*q1 and d*sc2*q2; their common step is
    d*gcd(sc1, sc2), which for llama.cpp's scales (normalized so that the largest |sc|
    is 127 or 128, the others unrelated) is mostly d, leaving about 127*63 = 8001
    points (13 bits). The pair costs 16 bpw: half of float32, and float16's size but
    exact where float16 rounds (d*sc*q has up to 23 significant bits); two matmuls.
Not kept:
  Q2_K: w = (d*sc)*q - dmin*m per 16 weights: the two sub-blocks of a group have
    different minima dmin*m1 != dmin*m2, which no step d*k reaches (d and dmin are
    unrelated float16 numbers). Exact alternative: d*(sc*q), sc*q in [0, 45], as a
    6-bit matrix plus the minima as a 2-bit one (10-12 bpw, two matmuls).
  IQ2_XS, IQ2_S: scales per 16 weights, w = d/8 * (2s+1) * v with v up to 43: two
    scales in a group leave up to 2*31*43 + 1 = 2667 points of d/8. IQ1_M: scales per
    16 and deltas per 8: up to 271 points of d/8 in a group.
  Not looked at closely, so not kept yet, though by the same reasoning exact forms
    exist: TQ1_0, TQ2_0 (d*(t-1), t ternary: 2 bits, scale d, bias -d) and MXFP4 (a
    power of two times e2m1 values in [-12, 12]: 5 bits with float32 scales, or MLX's
    own "mxfp4" mode).

MLX's own GGUF reader (mx.load) is not used: MLX 0.32.4 turns codecs it does not map
into float16, with wrong values for Q4_K (on random valid blocks: max error 32 on
weights of magnitude 47, against gguf-py), and raises on Q5_0/Q5_1/Q3_K/Q5_K/IQ*, so
one such tensor would keep a whole file from loading. The Q4_0/Q4_1/Q8_0 triples are
checked bit for bit against mx.load's in tests/test_models_codecs.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
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


# ---- repacks -----------------------------------------------------------------------


def _blocks(data: np.ndarray, block_bytes: int) -> np.ndarray:
    """[rows, row bytes] -> the blocks of all rows [rows * n_blocks, block_bytes]."""
    return np.ascontiguousarray(data).reshape(-1, block_bytes)


def _f16(blocks: np.ndarray, offset: int) -> np.ndarray:
    """The float16 field at byte ``offset`` of every block: [n_blocks]."""
    return np.ascontiguousarray(blocks[:, offset:offset + 2]).view(np.float16)[:, 0]


def _u32(blocks: np.ndarray, start: int, stop: int) -> np.ndarray:
    """Bytes [start, stop) of every block as little-endian uint32 [n_blocks, words]."""
    return np.ascontiguousarray(blocks[:, start:stop]).view("<u4")


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[..., 16] bytes -> [..., 32] values: the low nibbles, then the high ones."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _bits(field: np.ndarray, count: int) -> np.ndarray:
    """[n, bytes] -> [n, count] of its bits, little-endian (bit k of byte k // 8 first)."""
    return np.unpackbits(np.ascontiguousarray(field), axis=-1, count=count, bitorder="little")


def _pack(values: np.ndarray, bits: int, rows: int) -> np.ndarray:
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


def _triple(q: np.ndarray, scales: np.ndarray, biases: np.ndarray, bits: int, rows: int,
            dtype) -> Quantized:
    """Quantized from values q [rows * ..., 32 per group], scales and biases (one per
    group, in column order)."""
    return Quantized(_pack(q, bits, rows), np.asarray(scales, dtype).reshape(rows, -1),
                     np.asarray(biases, dtype).reshape(rows, -1), bits)


def _q4_0(data: np.ndarray) -> Quantized:
    blocks = _blocks(data, 18)  # d (f16), 16 bytes: q[j] low nibble, q[j + 16] high
    d = _f16(blocks, 0)
    return _triple(_nibbles(blocks[:, 2:]), d, d * np.float16(-8), 4, len(data), np.float16)


def _q4_1(data: np.ndarray) -> Quantized:
    blocks = _blocks(data, 20)  # d (f16), m (f16), 16 bytes of nibbles as in Q4_0
    return _triple(_nibbles(blocks[:, 4:]), _f16(blocks, 0), _f16(blocks, 2), 4, len(data), np.float16)


def _q5(blocks: np.ndarray, qh_at: int) -> np.ndarray:
    """Q5_0/Q5_1's 5-bit q [n_blocks, 32]: bit j of the uint32 qh is q[j]'s high bit."""
    return _nibbles(blocks[:, qh_at + 4:]) | (_bits(blocks[:, qh_at:qh_at + 4], 32) << 4)


def _q5_0(data: np.ndarray) -> Quantized:
    blocks = _blocks(data, 22)  # d (f16), qh (u32), 16 bytes of nibbles: w = d * (q - 16)
    d = _f16(blocks, 0)
    return _triple(_q5(blocks, 2), d, d * np.float16(-16), 5, len(data), np.float16)


def _q5_1(data: np.ndarray) -> Quantized:
    blocks = _blocks(data, 24)  # d (f16), m (f16), qh (u32), 16 bytes: w = d * q + m
    return _triple(_q5(blocks, 4), _f16(blocks, 0), _f16(blocks, 2), 5, len(data), np.float16)


def _q8_0(data: np.ndarray) -> Quantized:
    blocks = _blocks(data, 34)  # d (f16), 32 signed bytes
    d = _f16(blocks, 0)
    q = blocks[:, 2:] ^ np.uint8(0x80)  # int8 q -> unsigned q + 128
    return _triple(q, d, d * np.float16(-128), 8, len(data), np.float16)


def _scale_min_k4(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's 12 bytes of 6-bit scales and mins -> (sc, m) [n_blocks, 8]
    (llama.cpp's get_scale_min_k4, as gguf-py's Q4_K.get_scale_min)."""
    d, m, m_d = scales[:, 0:4], scales[:, 4:8], scales[:, 8:12]
    sc = np.concatenate([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc, mn


def _k_scales(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's (d*sc, -(dmin*m)) [n_blocks, 8] in float32, where both are exact."""
    d = _f16(blocks, 0).astype(np.float32)[:, None]
    dmin = _f16(blocks, 2).astype(np.float32)[:, None]
    sc, m = _scale_min_k4(blocks[:, 4:16])
    return d * sc.astype(np.float32), -(dmin * m.astype(np.float32))


def _q4_k(data: np.ndarray) -> Quantized:
    blocks = _blocks(data, 144)  # d, dmin (f16), 12 bytes of scales, 128 bytes of q
    qs = blocks[:, 16:].reshape(-1, 4, 1, 32)  # 64 weights per 32 bytes: low nibbles, high
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=2)  # [n, 4, 2, 32]: sub-blocks of 32
    return _triple(q, *_k_scales(blocks), 4, len(data), np.float32)


def _q5_k(data: np.ndarray) -> Quantized:
    blocks = _blocks(data, 176)  # d, dmin, 12 bytes of scales, qh[32], qs[128]
    qs = blocks[:, 48:].reshape(-1, 4, 1, 32)
    ql = np.concatenate([qs & 0x0F, qs >> 4], axis=2).reshape(-1, 8, 32)
    qh = (blocks[:, None, 16:48] >> np.arange(8, dtype=np.uint8)[:, None]) & 1  # bit j -> sub-block j
    q = ql | (qh << 4)
    return _triple(q, *_k_scales(blocks), 5, len(data), np.float32)


def _q3_k(data: np.ndarray) -> Quantized:
    """w = d * (sc - 32) * q, q in [-4, 3] (2 bits + the inverted hmask bit), sc 6-bit
    per 16 weights: d times N = (sc - 32) * q in [-124, 128], as 8 bits q' = 128 - N
    with scale -d and bias 128d (float16, both exact)."""
    blocks = _blocks(data, 110)  # hmask[32], qs[64], scales[12], d (f16)
    n = len(blocks)
    low, high = blocks[:, 96:104], blocks[:, 104:108]
    sc = (np.concatenate([low & 0x0F, low >> 4], axis=-1)
          | (((high[:, None, :] >> np.array([0, 2, 4, 6], np.uint8)[:, None]) & 3).reshape(n, 16) << 4))
    sc = sc.astype(np.int16) - 32  # [n, 16]
    ql = (blocks[:, None, 32:96].reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8)[:, None]) & 3
    qh = (blocks[:, None, 0:32] >> np.arange(8, dtype=np.uint8)[:, None]) & 1  # [n, 8, 32]
    q = ql.reshape(n, 16, 16).astype(np.int16) - 4 * (1 - qh.reshape(n, 16, 16).astype(np.int16))
    d = _f16(blocks, 108)
    scales = np.repeat(-d[:, None], 8, axis=1)
    return _triple(128 - sc[:, :, None] * q, scales, -scales * np.float16(128), 8, len(data), np.float16)


IQ4NL_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)  # kvalues_iq4nl
_IQ4NL_Q = np.array(IQ4NL_VALUES, np.int16).astype(np.uint8) ^ np.uint8(0x80)  # value + 128


def _iq4_nl(data: np.ndarray) -> Quantized:
    blocks = _blocks(data, 18)  # d (f16), 16 bytes of nibbles as in Q4_0, indexing kvalues
    d = _f16(blocks, 0)
    return _triple(_IQ4NL_Q[_nibbles(blocks[:, 2:])], d, d * np.float16(-128), 8, len(data), np.float16)


def _iq4_xs(data: np.ndarray) -> Quantized:
    blocks = _blocks(data, 136)  # d (f16), scales_h (u16), scales_l[4], qs[128]
    n = len(blocks)
    d = _f16(blocks, 0).astype(np.float32)[:, None]
    scales_h = np.ascontiguousarray(blocks[:, 2:4]).view("<u2")  # [n, 1]
    low = blocks[:, 4:8]
    ls_low = np.stack([low & 0x0F, low >> 4], axis=-1).reshape(n, 8)  # sub-block 2i, 2i + 1
    ls_high = (scales_h >> np.arange(0, 16, 2, dtype=np.uint16)) & 3
    dl = d * ((ls_low | (ls_high.astype(np.uint8) << 4)).astype(np.float32) - 32)  # exact: 16 bits
    q = _IQ4NL_Q[_nibbles(blocks[:, 8:].reshape(n, 8, 16))]
    return _triple(q, dl, dl * np.float32(-128), 8, len(data), np.float32)


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


def _iq2_xxs(data: np.ndarray) -> Quantized:
    """db * v, v in +-{8, 25, 43}, db = d * (0.5 + s) / 4 per 32: q = v + 128."""
    blocks = _blocks(data, 66)  # d (f16), 8 x (u32 four grid indices, u32 signs and scale)
    words = _u32(blocks, 2, 66).reshape(-1, 8, 2)
    index = np.ascontiguousarray(words[..., 0]).view(np.uint8).reshape(len(blocks), 32)
    v = _signed_grid("IQ2_XXS", index, words[..., 1])
    d = _f16(blocks, 0).astype(np.float32)[:, None]
    db = d * (np.float32(0.5) + (words[..., 1] >> 28).astype(np.float32)) * np.float32(0.25)
    return _triple(v + 128, db, db * np.float32(-128), 8, len(data), np.float32)


def _iq3_xxs(data: np.ndarray) -> Quantized:
    """db * v, v even in [-62, 62], db = d * (0.5 + s) / 2 per 32: q = v/2 + 31, scale 2db."""
    blocks = _blocks(data, 98)  # d (f16), 64 grid indices (4 weights each), 8 x u32 signs and scale
    aux = _u32(blocks, 66, 98)
    v = _signed_grid("IQ3_XXS", blocks[:, 2:66], aux)
    d = _f16(blocks, 0).astype(np.float32)[:, None]
    db = d * (np.float32(0.5) + (aux >> 28).astype(np.float32)) * np.float32(0.5)
    return _triple(v // 2 + 31, 2 * db, db * np.float32(-62), 6, len(data), np.float32)


def _iq3_s(data: np.ndarray) -> Quantized:
    """db * v, v odd in [-15, 15], db = d * (1 + 2s) per 32: q = (v + 15) / 2, scale 2db."""
    blocks = _blocks(data, 110)  # d (f16), qs[64], qh[8], signs[32], scales[4]
    n = len(blocks)
    index = blocks[:, 2:66].astype(np.uint16) | (_bits(blocks[:, 66:74], 64).astype(np.uint16) << 8)
    grid = _grid("IQ3_S")[index].reshape(n, 256)
    v = np.where(_bits(blocks[:, 74:106], 256), -grid, grid)
    s = blocks[:, 106:110]
    s = np.stack([s & 0x0F, s >> 4], axis=-1).reshape(n, 8)
    db = _f16(blocks, 0).astype(np.float32)[:, None] * (1 + 2 * s).astype(np.float32)
    return _triple((v + 15) // 2, 2 * db, db * np.float32(-15), 4, len(data), np.float32)


def _iq1_s(data: np.ndarray) -> Quantized:
    """dl * (g + delta), g in {-1, 0, 1}, delta +-1/8, dl = d * (2s + 1) per 32: q = g + 1,
    scale dl, bias dl * (delta - 1)."""
    blocks = _blocks(data, 50)  # d (f16), qs[32], qh (8 x u16: 4 x 3 index bits, 3-bit s, sign)
    n = len(blocks)
    qh = np.ascontiguousarray(blocks[:, 34:50]).view("<u2")  # [n, 8]
    high = (qh[..., None] >> np.array([0, 3, 6, 9], np.uint16)) & 7  # [n, 8, 4]
    index = blocks[:, 2:34].astype(np.uint16) | (high.reshape(n, 32) << 8)
    g = _grid("IQ1_S")[index].reshape(n, 8, 32)
    dl = _f16(blocks, 0).astype(np.float32)[:, None] * (2 * ((qh >> 12) & 7) + 1).astype(np.float32)
    delta = np.where(qh & 0x8000, np.float32(-0.125), np.float32(0.125))
    return _triple(g + 1, dl, dl * (delta - np.float32(1)), 2, len(data), np.float32)


_REPACK = {"Q4_0": _q4_0, "Q4_1": _q4_1, "Q5_0": _q5_0, "Q5_1": _q5_1, "Q8_0": _q8_0,
           "Q3_K": _q3_k, "Q4_K": _q4_k, "Q5_K": _q5_k, "IQ4_NL": _iq4_nl, "IQ4_XS": _iq4_xs,
           "IQ3_S": _iq3_s, "IQ3_XXS": _iq3_xxs, "IQ2_XXS": _iq2_xxs, "IQ1_S": _iq1_s}
assert set(_REPACK) == set(KEPT_FORMATS)


def _q6_k_pair(data: np.ndarray) -> QuantizedPair:
    """Q6_K [rows, row bytes] -> its exact QuantizedPair. Each block of 256: ql[128]
    (low nibbles), qh[64] (high 2 bits), 16 int8 scales, d (f16); w = (d*sc)*(q - 32)
    per 16 weights (gguf-py's Q6_K.dequantize_blocks, which this unpacks alike). A
    half's group of 32 holds one sub-block, q in [0, 63], scale d*sc (d's 11 bits times
    sc's 8: exact in float32), bias -32*scale, and q = 32 (w = 0 exactly) in the
    other sub-block's 16 places: scale*q is exact (24 bits) and so is its sum with
    the bias, whose true value (d*sc)*(q - 32) float32 holds."""
    rows = len(data)
    blocks = _blocks(data, 210)
    ql = blocks[:, :128].reshape(-1, 2, 1, 64) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
    ql = (ql & np.uint8(0x0F)).reshape(-1, 2, 128)
    qh = blocks[:, 128:192].reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)
    qh = (qh & np.uint8(0x03)).reshape(-1, 2, 128)
    q = (ql | (qh << np.uint8(4))).reshape(-1, 8, 2, 16)  # [n, group of 32, sub-block, 16]: q + 32
    scales = blocks[:, 192:208].view(np.int8).astype(np.float32).reshape(-1, 8, 2)
    step = _f16(blocks, 208).astype(np.float32)[:, None, None] * scales  # [n, 8, 2]: d*sc
    zero = np.full(q.shape[:-2] + (16,), 32, np.uint8)
    halves = []
    for j, values in enumerate((np.concatenate([q[:, :, 0], zero], -1), np.concatenate([zero, q[:, :, 1]], -1))):
        halves.append(_triple(values, step[..., j], np.float32(-32) * step[..., j], 6, rows, np.float32))
    return QuantizedPair(*halves)


def repack(data: np.ndarray, codec: str) -> Quantized | None:
    """A kept codec's raw blocks [(E,) rows, row bytes] -> its exact MLX affine form, or
    None where a float16 bias overflows (-8d, -16d, -128d, 128d past 65504)."""
    with np.errstate(over="ignore", invalid="ignore"):  # an overflow is caught just below
        packed = _REPACK[codec](data.reshape(-1, data.shape[-1]))
    if not (np.isfinite(packed.scales).all() and np.isfinite(packed.biases).all()):
        return None
    lead = data.shape[:-1]
    return Quantized(*(a.reshape(*lead, -1) for a in (packed.weight, packed.scales, packed.biases)),
                     packed.bits)


def read_tensor(tensor):
    """A gguf-py ReaderTensor -> np.ndarray (float32/float16), BFloat16, Quantized or
    QuantizedPair."""
    from gguf import GGMLQuantizationType as T
    from gguf import quants

    kind = tensor.tensor_type
    name = codec_name(kind)
    data = tensor.data
    if kind in (T.F32, T.F16):
        return np.asarray(data)
    if kind == T.BF16:
        return BFloat16(np.ascontiguousarray(data).view(np.uint16))
    if name in PAIRED_FORMATS and data.ndim == 2:
        return _q6_k_pair(np.asarray(data))
    if name in _REPACK and data.ndim in (2, 3):  # a matrix, or stacked experts [E, rows, bytes]
        packed = repack(np.asarray(data), name)
        if packed is not None:
            return packed
    try:
        return quants.dequantize(np.asarray(data), kind)
    except (NotImplementedError, KeyError, ValueError) as e:
        raise UnsupportedTensor(
            f"tensor '{tensor.name}' is stored as {name}, which mola cannot read: neither "
            f"kept quantized ({', '.join(KEPT)}) nor dequantized by gguf-py ({e})."
        ) from None
