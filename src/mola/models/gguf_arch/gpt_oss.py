"""gpt-oss: convert_hf_to_gguf.py's GptOssModel (conversion/gpt_oss.py, gguf-py
tensor_mapping.py): post_attention_layernorm is ATTN_POST_NORM, and self_attn.sinks is
written as attn_sinks.weight. The experts' config keys are moe_config.py's."""

from __future__ import annotations

from .base import BaseArchitecture

ARCHITECTURES = (
    BaseArchitecture("gpt-oss", "gpt_oss", "GptOssForCausalLM", norms={
        "attn_norm": "input_layernorm",
        "post_attention_norm": "post_attention_layernorm",
        "attn_sinks.weight": "self_attn.sinks",
    }),
)
