"""smollm3 as convert_hf_to_gguf.py writes it (conversion/llama.py SmolLM3Model, a
LlamaModel: q/k rows permuted by gguf_model.py, nothing beyond llama's keys; the
config's no_rope_layers is not written, llama.cpp takes every 4th layer as NoPE)."""

from __future__ import annotations

from .twin import Twin


def _tiny_config(spec) -> dict:
    """What SmolLM3's config.json says of its NoPE layers (every 4th, the pattern
    llama.cpp assumes): a model of 4 or more layers has some."""
    return {"no_rope_layer_interval": 4,
            "no_rope_layers": [int((i + 1) % 4 != 0) for i in range(spec.num_hidden_layers)]}


TWINS = {"smollm3": Twin(tiny_config=_tiny_config)}
