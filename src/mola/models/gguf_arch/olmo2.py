"""olmo2 (OLMo 2): convert_hf_to_gguf.py's Olmo2Model (conversion/olmo.py), which writes
the tensors by gguf-py's names (tensor_mapping.py) as they are. The block has no input
norms: its attention output and its feed-forward output are normed before they join the
residual (post_attention_norm -> post_attention_layernorm, post_ffw_norm ->
post_feedforward_layernorm), and q and k are RMS-normed over the whole projection before
the heads are split (attn_q_norm / attn_k_norm of n_head * head_dim, as mlx-lm's olmo2
q_norm / k_norm; src/models/olmo2.cpp builds the norm before its reshape). The
attention scale is 1 / sqrt(head size) in both.

Refused: attention.sliding_window (OLMo 3, which llama.cpp converts as olmo2 with
interleaved sliding-window layers, and whose yarn rope keeps the sliding layers
unscaled: mlx-lm's olmo3 model, not mapped here)."""

from __future__ import annotations

from ...errors import ModelLoadError
from .base import BaseArchitecture

OLMO2_NORMS = {
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}


def _config(f, config: dict, tensors: set[str]) -> dict:
    window = f.get(".attention.sliding_window")
    if window:  # llama_model_olmo2::load_arch_hparams: n_swa > 0 turns the windows on
        raise ModelLoadError(
            f"{f.path}: olmo2.attention.sliding_window is {window} (OLMo 3's interleaved "
            "sliding-window attention); mola maps llama.cpp's olmo2 without windows (OLMo 2).")
    return {"attention_bias": "blk.0.attn_q.bias" in tensors}


ARCHITECTURES = (BaseArchitecture("olmo2", "olmo2", "Olmo2ForCausalLM", norms=OLMO2_NORMS, config=_config),)
