"""Gemma, Gemma 2 and Gemma 3 (text) as llama.cpp's convert_hf_to_gguf.py writes them
(conversion/gemma.py GemmaModel, Gemma2Model, Gemma3Model), for gguf_model.py.

set_gguf_parameters: GemmaModel and Gemma2Model write their keys themselves, no
rope.freq_base or rope.dimension_count (llama.cpp takes 10000 and the head size);
Gemma2Model adds both soft-capping values and the sliding window; Gemma3Model (through
TextModel's: rope.freq_base, rope.freq_base_swa from rope_local_base_freq, linear
rope scaling) the final soft-capping when set and the sliding window unless the
pattern is 1, but no rope.dimension_count. It writes no sliding_window_pattern, which
leaves llama.cpp's default 6, the pattern of every Gemma 3; for a tiny model of
another period the twin writes the key llama.cpp reads (load_swa_pattern), as a
converter must for llama.cpp to compute that model.

modify_tensors: every tensor ending in "norm.weight" is written as 1 + w (all three
classes; Gemma3Model.norm_shift), in float32 here."""

from __future__ import annotations

import numpy as np

from .twin import Twin

# The tiny models' head size, not hidden / heads (64 / 4), as Gemma's 256 is not
# 2048 / 8 (gemma-2b); llama.cpp's attention scale is 1/sqrt of it, so the
# query_pre_attn_scalar that Hugging Face's config states is that too.
HEAD_DIM = 24
LLAMA_CPP_SWA_PERIOD = 6  # gemma3.cpp: load_swa_pattern(ml, 6)


def _plus_one(gguf_name: str, data: np.ndarray, config: dict) -> np.ndarray:
    return data + np.float32(1) if gguf_name.endswith("norm.weight") else data


def _drop(writer, *keys: str) -> None:
    """Keys gguf_model._hyperparameters wrote that this converter does not write."""
    for key in keys:
        writer.kv_data[0].pop(f"{writer.arch}.{key}", None)


def _gemma_hparams(writer, config: dict) -> None:
    _drop(writer, "rope.freq_base", "rope.dimension_count")


def _gemma2_hparams(writer, config: dict) -> None:
    _drop(writer, "rope.freq_base", "rope.dimension_count")
    writer.add_attn_logit_softcapping(config["attn_logit_softcapping"])
    writer.add_final_logit_softcapping(config["final_logit_softcapping"])
    writer.add_sliding_window(config["sliding_window"])


def _gemma3_hparams(writer, config: dict) -> None:
    from gguf import RopeScalingType

    _drop(writer, "rope.dimension_count")
    rope = config.get("rope_scaling") or {}
    if (rope.get("rope_type") or rope.get("type")) == "linear":
        writer.add_rope_scaling_type(RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope["factor"])
    if "rope_local_base_freq" in config:
        writer.add_rope_freq_base_swa(config["rope_local_base_freq"])
    if config.get("final_logit_softcapping"):
        writer.add_final_logit_softcapping(config["final_logit_softcapping"])
    period = config.get("sliding_window_pattern", LLAMA_CPP_SWA_PERIOD)
    if period != 1:
        writer.add_sliding_window(config["sliding_window"])
    if period != LLAMA_CPP_SWA_PERIOD:
        writer.add_sliding_window_pattern(period)


TWINS = {
    "gemma": Twin(tiny_config=lambda spec: {"head_dim": HEAD_DIM},
                  hparams=_gemma_hparams, tensor=_plus_one),
    # soft caps low enough to bite on the tiny model's scores and logits; mlx-lm's
    # gemma2 has no sliding window, so the window only caps the context mola serves
    # (longer than the family test's prompt and answer)
    "gemma2": Twin(tiny_config=lambda spec: {
        "head_dim": HEAD_DIM, "query_pre_attn_scalar": HEAD_DIM, "attn_logit_softcapping": 5.0,
        "final_logit_softcapping": 7.0, "sliding_window": 64},
        hparams=_gemma2_hparams, tensor=_plus_one),
    # a window shorter than the family test's prompt; every second layer global (the
    # tiny model has two); the local rope base apart from rope_theta, and the global
    # layers' linear scaling (Gemma 3 4B and up: factor 8)
    "gemma3_text": Twin(tiny_config=lambda spec: {
        "head_dim": HEAD_DIM, "query_pre_attn_scalar": HEAD_DIM, "sliding_window": 8,
        "sliding_window_pattern": 2, "rope_local_base_freq": 1000.0,
        "rope_scaling": {"rope_type": "linear", "factor": 4.0}},
        hparams=_gemma3_hparams, tensor=_plus_one),
}
