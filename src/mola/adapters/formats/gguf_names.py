"""llama.cpp's names for what mola maps, shared by the GGUF LoRA reader and writer
and the GGUF model loader: the architectures (general.architecture) and the mlx-lm
model types each fits, each block's tensor -> mlx-lm module (dense and
mixture-of-experts blocks), and llama's q/k row order.

Where the names come from (llama.cpp, ggml-org/llama.cpp):
  gguf-py/gguf/constants.py       MODEL_TENSOR -> "blk.{bid}.ffn_gate_exps", ...
  gguf-py/gguf/tensor_mapping.py  Hugging Face module -> MODEL_TENSOR (TensorNameMap)
  convert_hf_to_gguf.py (conversion/*.py in newer trees), which stacks the experts:
    qwen.py   Qwen2MoeModel.modify_tensors (qwen2moe, and qwen3moe through it):
              mlp.experts.{e}.{gate,up,down}_proj -> torch.stack -> ffn_{gate,up,down}_exps;
              mlp.gate -> ffn_gate_inp; mlp.shared_expert.* -> ffn_*_shexp;
              mlp.shared_expert_gate -> ffn_gate_inp_shexp
    llama.py  LlamaModel.modify_tensors (Mixtral is LlamaForCausalLM's arch "llama"):
              block_sparse_moe.experts.{e}.w1/w2/w3 -> feed_forward.experts.w1/w2/w3 ->
              ffn_gate_exps / ffn_down_exps / ffn_up_exps; block_sparse_moe.gate -> ffn_gate_inp
    gpt_oss.py GptOssModel: mlp.experts.gate_up_proj split (even rows gate, odd rows up)
              into ffn_gate_exps / ffn_up_exps, their biases .bias; mlp.router -> ffn_gate_inp
              (weight and bias); self_attn.sinks -> attn_sinks.weight;
              post_attention_layernorm -> post_attention_norm
A stacked expert tensor is numpy [E, out, in], ggml ne [in, out, E]; its LoRA factors
(convert_lora_to_gguf.py stacks lora_A and lora_B per expert the same way) are
lora_a numpy [E, r, in] (ne [in, r, E]) and lora_b numpy [E, out, r] (ne [r, out, E]).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Architecture:
    name: str  # general.architecture
    model_types: frozenset[str]  # mlx-lm model types of bases it fits
    permutes_qk: bool  # llama.cpp reorders q/k rows (and so LoRA B rows) for its rope


ARCHITECTURES = {
    # llama also covers Mistral (MistralForCausalLM converts as llama) and Mixtral
    # (MixtralForCausalLM: llama with expert tensors); granite and smollm3 are
    # LlamaModel's subclasses in convert_hf_to_gguf.py (conversion/granite.py GraniteModel,
    # conversion/llama.py SmolLM3Model), so their q/k rows are permuted too
    "llama": Architecture("llama", frozenset({"llama", "mistral", "mixtral"}), True),
    "granite": Architecture("granite", frozenset({"granite"}), True),
    "smollm3": Architecture("smollm3", frozenset({"smollm3"}), True),
    "gemma": Architecture("gemma", frozenset({"gemma"}), False),
    "gemma2": Architecture("gemma2", frozenset({"gemma2"}), False),
    "gemma3": Architecture("gemma3", frozenset({"gemma3_text"}), False),
    "phi3": Architecture("phi3", frozenset({"phi3"}), False),
    "olmo2": Architecture("olmo2", frozenset({"olmo2"}), False),
    "command-r": Architecture("command-r", frozenset({"cohere"}), False),
    "cohere2": Architecture("cohere2", frozenset({"cohere2"}), False),
    "qwen2": Architecture("qwen2", frozenset({"qwen2"}), False),
    "qwen3": Architecture("qwen3", frozenset({"qwen3"}), False),
    "qwen2moe": Architecture("qwen2moe", frozenset({"qwen2_moe"}), False),
    "qwen3moe": Architecture("qwen3moe", frozenset({"qwen3_moe"}), False),
    "gpt-oss": Architecture("gpt-oss", frozenset({"gpt_oss"}), False),
}


def architecture_for(model_type: str | None) -> Architecture | None:
    """The GGUF LoRA architecture of a base of mlx-lm type ``model_type``, if mola knows one."""
    return next((arch for arch in ARCHITECTURES.values() if model_type in arch.model_types), None)


# llama.cpp's per-block tensor -> the mlx-lm module under model.layers.N
ATTENTION_TENSORS = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
}
BLOCK_TENSORS = {  # a dense block
    **ATTENTION_TENSORS,
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Dense blocks whose linears are fused (gguf-py tensor_mapping.py: phi3's
# self_attn.qkv_proj is ATTN_QKV, its mlp.gate_up_proj FFN_UP; conversion/phi.py
# Phi3MiniModel writes them as they are)
FUSED_TENSORS = {
    "phi3": {"attn_qkv": "self_attn.qkv_proj", "attn_output": "self_attn.o_proj",
             "ffn_up": "mlp.gate_up_proj", "ffn_down": "mlp.down_proj"},
}
DENSE_MODULE_TENSORS = {module: tensor for table in (BLOCK_TENSORS, *FUSED_TENSORS.values())
                        for tensor, module in table.items()}

# The stacked expert tensors (numpy [E, out, in]).
EXPERT_TENSORS = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")


def _experts(router: str, stack: str, projs=("gate_proj", "up_proj", "down_proj")) -> dict[str, str]:
    return {"ffn_gate_inp": router, **{t: f"{stack}.{p}" for t, p in zip(EXPERT_TENSORS, projs)}}


# A mixture-of-experts block's feed-forward, per mlx-lm model type (the attention is
# ATTENTION_TENSORS): the router, the experts (an mlx-lm SwitchLinear, weight [E, out, in]),
# qwen2_moe's shared expert.
MOE_TENSORS = {
    "qwen3_moe": _experts("mlp.gate", "mlp.switch_mlp"),
    "qwen2_moe": {
        **_experts("mlp.gate", "mlp.switch_mlp"),
        "ffn_gate_inp_shexp": "mlp.shared_expert_gate",  # [1, hidden] (llama.cpp: a vector)
        "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
        "ffn_up_shexp": "mlp.shared_expert.up_proj",
        "ffn_down_shexp": "mlp.shared_expert.down_proj",
    },
    "mixtral": _experts("block_sparse_moe.gate", "block_sparse_moe.switch_mlp"),
    "gpt_oss": _experts("mlp.router", "mlp.experts"),
}
MOE_MODEL_TYPES = frozenset(MOE_TENSORS)
# Every mlx-lm block module llama.cpp names, whatever the model type (no two collide):
# what a GGUF LoRA can target (train/export.py checks an adapter's keys against it).
MODULE_TENSORS = {
    module: tensor for table in (BLOCK_TENSORS, *FUSED_TENSORS.values(), *MOE_TENSORS.values())
    for tensor, module in table.items()
}


def block_tensors(model_type: str | None) -> dict[str, str]:
    """llama.cpp tensor -> mlx-lm module under model.layers.N for a base of ``model_type``."""
    if model_type in FUSED_TENSORS:
        return FUSED_TENSORS[model_type]
    moe = MOE_TENSORS.get(model_type)
    return BLOCK_TENSORS if moe is None else {**ATTENTION_TENSORS, **moe}


def is_moe_tensor(kind: str) -> bool:
    """Whether a per-block tensor kind (``ffn_gate_exps``) belongs to a mixture of experts."""
    return any(kind in table and kind not in BLOCK_TENSORS for table in MOE_TENSORS.values())


_TENSOR_NAME = re.compile(r"blk\.(\d+)\.([a-z_]+)\.weight")
_MODULE_PATH = re.compile(r"model\.layers\.(\d+)\.([a-z_.]+)")


def module_path(tensor_base: str, model_type: str | None = None) -> str | None:
    """``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj`` for a base of
    ``model_type`` (None: a dense block); None if unmappable."""
    m = _TENSOR_NAME.fullmatch(tensor_base)
    table = block_tensors(model_type)
    if not m or m.group(2) not in table:
        return None
    return f"model.layers.{int(m.group(1))}.{table[m.group(2)]}"


def tensor_base_name(path: str, *, moe: bool = False) -> str | None:
    """``model.layers.3.self_attn.q_proj`` -> ``blk.3.attn_q.weight`` (None if
    unmappable); ``moe``: also the routers, experts and shared experts of MOE_TENSORS."""
    m = _MODULE_PATH.fullmatch(path)
    table = MODULE_TENSORS if moe else DENSE_MODULE_TENSORS
    if not m or m.group(2) not in table:
        return None
    return f"blk.{int(m.group(1))}.{table[m.group(2)]}.weight"


def llama_cpp_row_order(rows: np.ndarray, n_heads: int) -> np.ndarray:
    """Reorder the rows of a q/k projection (or its LoRA B, [out, r]) from Hugging
    Face's order to llama.cpp's: within each head of d rows, row s * d/2 + t moves
    to 2 * t + s (the two rotated halves become interleaved pairs)."""
    out = rows.shape[0]
    d = out // n_heads
    return rows.reshape(n_heads, 2, d // 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def hf_row_order(rows: np.ndarray, n_heads: int) -> np.ndarray:
    """The inverse of :func:`llama_cpp_row_order`."""
    out = rows.shape[0]
    d = out // n_heads
    return rows.reshape(n_heads, d // 2, 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)
