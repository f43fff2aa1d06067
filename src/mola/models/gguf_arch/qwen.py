"""Qwen 2, 2.5 and 3, dense and mixtures of experts: convert_hf_to_gguf.py's
Qwen2Model, Qwen3Model, Qwen2MoeModel, Qwen3MoeModel (conversion/qwen.py). The
experts' config keys are moe_config.py's."""

from __future__ import annotations

from .base import BaseArchitecture

ARCHITECTURES = (
    BaseArchitecture("qwen2", "qwen2", "Qwen2ForCausalLM"),
    BaseArchitecture("qwen3", "qwen3", "Qwen3ForCausalLM"),
    BaseArchitecture("qwen2moe", "qwen2_moe", "Qwen2MoeForCausalLM"),
    BaseArchitecture("qwen3moe", "qwen3_moe", "Qwen3MoeForCausalLM"),
)
