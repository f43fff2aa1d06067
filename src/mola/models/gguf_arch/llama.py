"""llama (Llama, Mistral, SmolLM; with expert tensors Mixtral): convert_hf_to_gguf.py's
LlamaModel (conversion/llama.py), which also writes q/k rows in its rope order."""

from __future__ import annotations

from .base import BaseArchitecture


def _config(f, config: dict, tensors: set[str]) -> dict:
    if config["model_type"] != "llama":
        return {}
    return {"attention_bias": "blk.0.attn_q.bias" in tensors, "mlp_bias": "blk.0.ffn_up.bias" in tensors}


LLAMA = BaseArchitecture("llama", "llama", "LlamaForCausalLM", config=_config)
# llama.cpp converts MixtralForCausalLM as "llama" with expert tensors (conversion/llama.py).
MIXTRAL = BaseArchitecture("llama", "mixtral", "MixtralForCausalLM")
ARCHITECTURES = (LLAMA,)
