"""phi3 as convert_hf_to_gguf.py's Phi3MiniModel (conversion/phi.py) writes it:
the fused qkv_proj / gate_up_proj under gguf-py's own names (attn_qkv, ffn_up), its
own set_gguf_parameters (it does not call TextModel's, so no rope.scaling.type),
and generate_extra_tensors' LongRoPE factors and attention factor.

The tiny model has what Phi-4-mini has: partial rope (partial_rotary_factor 0.75),
LongRoPE with long and short factors that differ, a context above the original one
(so the attention factor is not 1); and Phi-3-mini's sliding window, shorter than
the test prompt, which llama.cpp and mlx-lm both ignore."""

from __future__ import annotations

import math

import numpy as np

from .twin import Twin

PARTIAL_ROTARY_FACTOR = 0.75
ORIGINAL_CONTEXT = 512


def _tiny_config(spec) -> dict:
    head_dim = spec.hidden_size // spec.num_attention_heads
    pairs = int(head_dim * PARTIAL_ROTARY_FACTOR) // 2
    return {
        "partial_rotary_factor": PARTIAL_ROTARY_FACTOR,
        "sliding_window": 7,
        "original_max_position_embeddings": ORIGINAL_CONTEXT,
        "rope_scaling": {
            "type": "longrope",
            "long_factor": [round(1.0 + 0.37 * i ** 1.5, 4) for i in range(pairs)],
            "short_factor": [round(1.0 + 0.05 * i, 4) for i in range(pairs)],
        },
    }


def _hparams(writer, config: dict) -> None:
    """Phi3MiniModel.set_gguf_parameters, and the attention factor its
    generate_extra_tensors writes with the factors."""
    n_embd, n_head = config["hidden_size"], config["num_attention_heads"]
    max_pos = config["max_position_embeddings"]
    orig = config["original_max_position_embeddings"]  # the converter needs it
    rot_pct = config.get("partial_rotary_factor", 1.0)
    writer.add_context_length(max_pos)
    writer.add_rope_scaling_orig_ctx_len(orig)
    writer.add_embedding_length(n_embd)
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_head_count(n_head)
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_dimension_count(int(rot_pct * n_embd) // n_head)
    writer.add_rope_freq_base(config["rope_theta"])
    writer.add_sliding_window(config.get("sliding_window") or 0)
    rope = config.get("rope_scaling") or {}
    if rope.get("long_factor"):
        scale = max_pos / orig
        kind = (rope.get("rope_type") or rope.get("type") or "").lower()
        if kind in ("su", "longrope"):
            attn_factor = math.sqrt(1 + math.log(scale) / math.log(orig)) if scale > 1.0 else 1.0
        elif kind == "yarn":
            attn_factor = 0.1 * math.log(scale) + 1.0 if scale > 1.0 else 1.0
        else:
            raise NotImplementedError(f"rope scaling {kind}")
        writer.add_rope_scaling_attn_factors(attn_factor)


def _extra_tensors(config: dict) -> dict[str, np.ndarray]:
    rope = config.get("rope_scaling") or {}
    if not rope.get("long_factor"):
        return {}
    return {"rope_factors_long.weight": np.array(rope["long_factor"], dtype=np.float32),
            "rope_factors_short.weight": np.array(rope["short_factor"], dtype=np.float32)}


TWINS = {"phi3": Twin(tiny_config=_tiny_config, hparams=_hparams, extra_tensors=_extra_tensors)}
