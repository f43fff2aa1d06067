"""llama as convert_hf_to_gguf.py writes it (conversion/llama.py LlamaModel): the
common keys and q/k row order are gguf_model.py's; a config whose rope_scaling is
Llama 3's (rope_type "llama3") also gets generate_extra_tensors' ``rope_freqs.weight``,
and no rope scaling metadata (conversion/base.py TextModel.set_gguf_parameters:
"llama3": handled in generate_extra_tensors). Without it the twin is plain llama."""

from __future__ import annotations

import math

import numpy as np

from .twin import Twin


def _rope_freqs(config: dict) -> dict[str, np.ndarray]:
    """LlamaModel.generate_extra_tensors, step by step as torch takes it on float32
    tensors: ``freqs = 1.0 / (base ** (arange(0, dim, 2) / dim))`` (the power correctly
    rounded here; torch's is within an ulp), and per frequency, a Python number meeting a
    float32 tensor as a float32, ``c / t`` as ``t.reciprocal() * c``."""
    rope = config.get("rope_scaling") or {}
    if (rope.get("rope_type") or rope.get("type") or "").lower() != "llama3":
        return {}
    f32 = np.float32
    base = f32(config.get("rope_theta", 10000.0))
    dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    exponents = np.arange(0, dim, 2, dtype=f32) / f32(dim)
    freqs = f32(1.0) / (np.float64(base) ** exponents.astype(np.float64)).astype(f32)
    factor = rope.get("factor", 8.0)
    low_freq_factor = rope.get("low_freq_factor", 1.0)
    high_freq_factor = rope.get("high_freq_factor", 4.0)
    old_context_len = rope.get("original_max_position_embeddings", 8192)
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    rope_factors = []
    for freq in freqs:
        wavelen = (f32(1) / freq) * f32(2 * math.pi)
        if wavelen < f32(high_freq_wavelen):
            rope_factors.append(1)
        elif wavelen > f32(low_freq_wavelen):
            rope_factors.append(factor)
        else:
            smooth = ((f32(1) / wavelen) * f32(old_context_len) - f32(low_freq_factor)) / f32(
                high_freq_factor - low_freq_factor)
            rope_factors.append(f32(1) / ((f32(1) - smooth) / f32(factor) + smooth))
    return {"rope_freqs.weight": np.array(rope_factors, dtype=np.float32)}


TWINS = {"llama": Twin(extra_tensors=_rope_freqs)}
