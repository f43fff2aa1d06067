"""llama (Llama, Mistral, SmolLM; with expert tensors Mixtral): convert_hf_to_gguf.py's
LlamaModel (conversion/llama.py), which also writes q/k rows in its rope order.

Llama 3.x's rope scaling (Hugging Face ``rope_scaling`` of rope_type "llama3") has no
metadata in a GGUF file: LlamaModel.generate_extra_tensors writes ``rope_freqs.weight``,
one factor per rotated pair, computed from factor, low_freq_factor, high_freq_factor and
original_max_position_embeddings; llama.cpp divides each pair's frequency by its factor
(src/models/llama.cpp: ggml_rope_ext with model.get_rope_factors). mlx-lm's llama applies
the same scaling with rope_utils.Llama3RoPE, built from those four numbers, so they are
recovered from the factors (:func:`llama3_scaling`) and the tensor is read as metadata.

Mistral files are llama too. A Mistral 7B v0.1 config's sliding_window (4096) is written
by no converter step (conversion/base.py TextModel.set_gguf_parameters has no sliding
window, and src/models/llama.cpp reads none), so llama.cpp attends over the whole
context; so does mlx-lm's llama, whose window needs layer_types, which Mistral's config
does not give: the two agree.
"""

from __future__ import annotations

import math

import numpy as np

from ...errors import ModelLoadError
from .base import BaseArchitecture, float32_decimal

_F32 = np.float32
_TWO_PI = _F32(2 * math.pi)  # the converter's 2 * math.pi, as torch uses it with a float32 tensor
_DECIMALS = range(7)  # the places high_freq_factor is tried with


def _config(f, config: dict, tensors: set[str]) -> dict:
    if config["model_type"] != "llama":
        return {}
    out = {"attention_bias": "blk.0.attn_q.bias" in tensors, "mlp_bias": "blk.0.ffn_up.bias" in tensors}
    if "rope_freqs.weight" in tensors:
        if config.get("rope_scaling"):
            raise ModelLoadError(
                f"{f.path} carries rope_freqs.weight and rope scaling {config['rope_scaling']}; "
                "llama.cpp applies both, mlx-lm's llama one rope scaling.")
        out["rope_scaling"] = llama3_scaling(f.path, _rope_freqs(f), config["head_dim"], config["rope_theta"])
    return out


def _rope_freqs(f) -> np.ndarray:
    tensor = next(t for t in f.reader.tensors if t.name == "rope_freqs.weight")
    if tensor.tensor_type.name != "F32":
        raise ModelLoadError(f"{f.path}: rope_freqs.weight is {tensor.tensor_type.name}; llama.cpp's "
                             "converter writes it as F32, which mola reads.")
    return np.asarray(tensor.data, dtype=_F32).reshape(-1)


def _powers(dim: int, base: float) -> np.ndarray:
    """base ** (arange(0, dim, 2) / dim) in float32, correctly rounded. The converter's
    torch.pow (Sleef's vectorized powf, within 1 ulp) may round the other way: see
    :func:`llama3_scaling`."""
    exponents = np.arange(0, dim, 2, dtype=_F32) / _F32(dim)
    return (np.float64(_F32(base)) ** exponents.astype(np.float64)).astype(_F32)


def converter_factors(powers: np.ndarray, factor: float, low: float, high: float, original: int) -> np.ndarray:
    """LlamaModel.generate_extra_tensors' rope factors for the frequencies 1 / ``powers``,
    in the float32 steps torch takes: ``c / t`` is ``t.reciprocal() * c``, a Python
    number meets a float32 tensor as a float32 (the wavelength bounds included)."""
    freqs = _F32(1) / powers
    wavelen = (_F32(1) / freqs) * _TWO_PI
    smooth = ((_F32(1) / wavelen) * _F32(original) - _F32(low)) / _F32(high - low)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):  # outside the band: unused
        mid = _F32(1) / ((_F32(1) - smooth) / _F32(factor) + smooth)
    out = np.where(wavelen > _F32(original / low), _F32(factor), mid)
    return np.where(wavelen < _F32(original / high), _F32(1), out).astype(_F32)


def llama3_scaling(path, factors: np.ndarray, dim: int, base: float) -> dict:
    """mlx-lm's ``rope_scaling`` (rope_type "llama3") whose converter factors are ``factors``.

    factor is the last (lowest-frequency) factor. In between the high-frequency 1s and the
    low-frequency ``factor`` s, 1 / r = 1 / factor + s (1 - 1 / factor) with s affine in
    1 / wavelength, 0 at wavelength original / low and 1 at original / high: two such
    factors give both wavelengths. Only those ratios matter (scaling all three by 2 gives
    the same factors bit for bit), so low_freq_factor is taken as 1 (Llama 3.1 to 3.3's),
    original_max_position_embeddings as the nearest integer, high_freq_factor as the
    shortest decimal that reproduces the file. The answer is checked: the converter's
    computation from it must give every factor of the file bit for bit in float32, with
    each frequency's power correctly rounded or one ulp either side (torch's powf is not
    reproducible here); else the file is refused."""
    half = dim // 2
    if factors.shape != (half,):
        raise ModelLoadError(f"{path}: rope_freqs.weight holds {factors.size} factors; llama.cpp "
                             f"needs one per rotated pair ({half}).")
    factor = float(factors[-1])
    inner = np.flatnonzero((factors != 1) & (factors != factors[-1]))
    if not factor > 1 or inner.size < 2:
        raise ModelLoadError(
            f"{path}: rope_freqs.weight ({_show(factors)}) is no llama 3 rope scaling mola can "
            "recover: it needs the factor > 1 at its low-frequency end and at least two "
            "factors in the smoothing band in between.")
    powers = _powers(dim, base)
    wavelen = (_F32(1) / (_F32(1) / powers)) * _TWO_PI
    (x0, x1), r = 1 / wavelen[inner[[0, -1]]].astype(np.float64), factors[inner[[0, -1]]].astype(np.float64)
    s0, s1 = (1 / r - 1 / factor) / (1 - 1 / factor)
    slope = (s1 - s0) / (x1 - x0)
    intercept = s0 - slope * x0
    fit = "no smoothing band"
    if slope > 0 > intercept:
        original = round(-slope / intercept)  # the wavelength where s = 0, times low_freq_factor 1
        high = original * (1 - intercept) / slope  # over the wavelength where s = 1
        fit = f"high_freq_factor ~{high:.6g} and original_max_position_embeddings {original}"
        for guess in dict.fromkeys(round(high, d) for d in _DECIMALS):
            if original > 0 and guess > 1 and _reproduces(factors, powers, factor, 1.0, guess, original):
                return {"rope_type": "llama3", "factor": float32_decimal(factor), "low_freq_factor": 1.0,
                        "high_freq_factor": float(guess), "original_max_position_embeddings": original}
    raise ModelLoadError(
        f"{path}: rope_freqs.weight ({_show(factors)}) is not what llama.cpp's converter writes for "
        f"llama 3 rope scaling with factor {factor:g}, low_freq_factor 1 and the band's best fit "
        f"({fit}), bit for bit; mola cannot map these factors onto mlx-lm's Llama3RoPE exactly.")


def _reproduces(factors, powers, factor, low, high, original) -> bool:
    ok = np.zeros(factors.shape, dtype=bool)
    for p in (np.nextafter(powers, _F32(0)), powers, np.nextafter(powers, _F32(np.inf))):
        ok |= converter_factors(p, factor, low, high, original) == factors
    return bool(ok.all())


def _show(factors: np.ndarray) -> str:
    return f"{factors.size} factors from {float(factors[0]):g} to {float(factors[-1]):g}"


LLAMA = BaseArchitecture("llama", "llama", "LlamaForCausalLM", globals={"rope_freqs": None}, config=_config)
# llama.cpp converts MixtralForCausalLM as "llama" with expert tensors (conversion/llama.py).
MIXTRAL = BaseArchitecture("llama", "mixtral", "MixtralForCausalLM")
ARCHITECTURES = (LLAMA,)
