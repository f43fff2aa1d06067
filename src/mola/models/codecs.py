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

import numpy as np

# the held forms and codec tables live in codec_forms.py; callers import them from here
from .codec_forms import (F32_SCALES, FLOATS, GROUP_SIZE, KEPT, KEPT_FORMATS, PAIRED_FORMATS, BFloat16,  # noqa: F401
                          Quantized, QuantizedPair, UnsupportedTensor, codec_name, held_nbytes, is_kept, nbytes)
from .codecs_iq import iq1_s, iq2_xxs, iq3_s, iq3_xxs, iq4_nl, iq4_xs
from .codecs_k import q3_k, q4_k, q5_k, q6_k_pair
from .codecs_legacy import q4_0, q4_1, q5_0, q5_1, q8_0

_REPACK = {"Q4_0": q4_0, "Q4_1": q4_1, "Q5_0": q5_0, "Q5_1": q5_1, "Q8_0": q8_0,
           "Q3_K": q3_k, "Q4_K": q4_k, "Q5_K": q5_k, "IQ4_NL": iq4_nl, "IQ4_XS": iq4_xs,
           "IQ3_S": iq3_s, "IQ3_XXS": iq3_xxs, "IQ2_XXS": iq2_xxs, "IQ1_S": iq1_s}
assert set(_REPACK) == set(KEPT_FORMATS)


CHUNK_BYTES = 1 << 20  # raw bytes repacked at a time: the intermediates stay small (and in the CPU's cache)


def _alloc(part, rows: int, alloc=np.empty):
    """Empty arrays (``alloc(shape, dtype)``'s) of ``part``'s form (Quantized,
    QuantizedPair or an array) for ``rows`` rows."""
    if isinstance(part, np.ndarray):
        return alloc((rows, *part.shape[1:]), part.dtype)
    if isinstance(part, QuantizedPair):
        return QuantizedPair(_alloc(part.low, rows, alloc), _alloc(part.high, rows, alloc))
    return Quantized(*(alloc((rows, *a.shape[1:]), a.dtype) for a in (part.weight, part.scales, part.biases)),
                     part.bits)


def _put(out, part, start: int) -> None:
    if isinstance(part, np.ndarray):
        out[start:start + len(part)] = part
        return
    if isinstance(part, QuantizedPair):
        _put(out.low, part.low, start)
        _put(out.high, part.high, start)
        return
    for dst, src in ((out.weight, part.weight), (out.scales, part.scales), (out.biases, part.biases)):
        dst[start:start + len(src)] = src


def by_rows(fn, data: np.ndarray, alloc=None):
    """``fn`` (a repack) over ``data`` [rows, row bytes], CHUNK_BYTES of rows at a time
    (whole-array operations on each), written into arrays allocated once by ``alloc``
    (shape, dtype) -> array (None: np.empty, and a tensor of one chunk is ``fn``'s own)."""
    step = max(1, CHUNK_BYTES // max(1, data.shape[-1]))
    if len(data) <= step and alloc is None:
        return fn(data)
    first = fn(data[:step])
    out = _alloc(first, len(data), alloc or np.empty)
    _put(out, first, 0)
    for start in range(step, len(data), step):
        _put(out, fn(data[start:start + step]), start)
    return out


def repack(data: np.ndarray, codec: str, alloc=None) -> Quantized | None:
    """A kept codec's raw blocks [(E,) rows, row bytes] -> its exact MLX affine form, or
    None where a float16 bias overflows (-8d, -16d, -128d, 128d past 65504)."""
    with np.errstate(over="ignore", invalid="ignore"):  # an overflow is caught just below
        packed = by_rows(_REPACK[codec], data.reshape(-1, data.shape[-1]), alloc)
    if not (np.isfinite(packed.scales).all() and np.isfinite(packed.biases).all()):
        return None
    lead = data.shape[:-1]
    return Quantized(*(a.reshape(*lead, -1) for a in (packed.weight, packed.scales, packed.biases)),
                     packed.bits)


def read_tensor(tensor, keep: bool = True, alloc=None, data: np.ndarray | None = None):
    """A gguf-py ReaderTensor -> np.ndarray (float32/float16), BFloat16, Quantized or
    QuantizedPair. ``keep`` False (a float --dtype): a quantized codec straight as
    gguf-py's float32 values, which the kept forms equal dequantized (signed zeros
    aside), and which gguf-py computes faster than MLX dequantizes the 5- and 6-bit
    forms on a CPU (a Q6_K pair: about 7 times). ``alloc``: what the repacked or
    dequantized arrays are allocated by (by_rows); ``data``: the tensor's raw
    array to read instead of ``tensor.data`` (its rows reordered, say)."""
    from gguf import GGMLQuantizationType as T
    from gguf import quants

    kind = tensor.tensor_type
    name = codec_name(kind)
    data = tensor.data if data is None else data
    if kind in (T.F32, T.F16):
        return np.asarray(data)
    if kind == T.BF16:
        return BFloat16(np.ascontiguousarray(data).view(np.uint16))
    if keep and name in PAIRED_FORMATS and data.ndim == 2:
        return by_rows(q6_k_pair, np.asarray(data), alloc)
    if keep and name in _REPACK and data.ndim in (2, 3):  # a matrix, or stacked experts [E, rows, bytes]
        packed = repack(np.asarray(data), name, alloc)
        if packed is not None:
            return packed
    try:
        rows = np.asarray(data).reshape(-1, data.shape[-1])  # [(E *) rows, row bytes]
        return by_rows(lambda part: quants.dequantize(part, kind), rows, alloc).reshape(*data.shape[:-1], -1)
    except (NotImplementedError, KeyError, ValueError) as e:
        raise UnsupportedTensor(
            f"tensor '{tensor.name}' is stored as {name}, which mola cannot read: neither "
            f"kept quantized ({', '.join(KEPT)}) nor dequantized by gguf-py ({e})."
        ) from None
