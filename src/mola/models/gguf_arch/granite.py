"""granite (IBM Granite 3.x, dense): convert_hf_to_gguf.py's GraniteModel
(conversion/granite.py), a LlamaModel: q/k rows in llama.cpp's rope order (undone by
gguf.py, gguf_names.ARCHITECTURES["granite"].permutes_qk), head_dim dropped (the head is
hidden / heads), and the Hugging Face multipliers written as llama.cpp's scales:

    granite.embedding_scale  -> embedding_multiplier  (embeddings times it)
    granite.residual_scale   -> residual_multiplier   (each block's two branches times it)
    granite.attention.scale  -> attention_multiplier  (the attention's q.k scale)
    granite.logit_scale      -> logits_scaling        (the logits divided by it)

as src/models/granite.cpp reads them (llama_model_granite::load_arch_hparams): the
logit scale is required, and a missing or zero embedding / residual / attention scale is
no scaling (1, 1, and llama.cpp's 1.0f / sqrtf(head size)); mlx-lm's granite model takes
the same values as float32 multipliers. Mixtures of experts (granitemoe) and the hybrid
and sliding-window variants are other llama.cpp architectures, not mapped here.

Refused: rope.scaling.finetuned false (llama.cpp's granite then ropes no layer; mlx-lm's
ropes every one), a deepstack_mapping (Granite 4 Vision's projector streams), a head
size other than hidden / heads (mlx-lm's granite derives it)."""

from __future__ import annotations

import numpy as np

from ...errors import ModelLoadError
from .base import BaseArchitecture, float32_decimal


def _config(f, config: dict, tensors: set[str]) -> dict:
    hidden, n_head, head_dim = config["hidden_size"], config["num_attention_heads"], config["head_dim"]
    if head_dim != hidden // n_head:
        _refuse(f, f"granite.attention.key_length is {head_dim}, not hidden / heads ({hidden // n_head})")
    finetuned = f.get(".rope.scaling.finetuned")
    if finetuned is not None and not bool(finetuned):
        _refuse(f, "granite.rope.scaling.finetuned is false, which turns rope off in every layer")
    if any(int(i) >= 0 for i in f.get(".deepstack_mapping", None) or ()):
        _refuse(f, "granite.deepstack_mapping injects vision projector streams into its layers")
    logit_scale = f.get(".logit_scale")
    if not logit_scale:
        _refuse(f, f"granite.logit_scale is {logit_scale!r} (llama.cpp requires it, and divides by it)")
    default_attention = float(np.float32(1) / np.sqrt(np.float32(head_dim)))  # llama.cpp's
    return {
        "embedding_multiplier": _scale(f, ".embedding_scale", 1.0),
        "residual_multiplier": _scale(f, ".residual_scale", 1.0),
        "attention_multiplier": _scale(f, ".attention.scale", default_attention),
        "logits_scaling": float32_decimal(logit_scale),
        "attention_bias": "blk.0.attn_q.bias" in tensors,
        "mlp_bias": "blk.0.ffn_up.bias" in tensors,
    }


def _scale(f, key: str, default: float) -> float:
    """A granite scale, where llama.cpp takes a missing or 0 one as ``default``."""
    value = f.get(key)
    return float32_decimal(value) if value else default


def _refuse(f, what: str) -> None:
    raise ModelLoadError(f"{f.path}: {what}; mlx-lm's granite model cannot follow it.")


ARCHITECTURES = (BaseArchitecture("granite", "granite", "GraniteForCausalLM", config=_config),)
