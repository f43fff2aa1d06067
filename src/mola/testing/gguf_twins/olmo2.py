"""olmo2 as convert_hf_to_gguf.py writes it (conversion/olmo.py Olmo2Model): the common
keys, and the tensors by gguf-py's names as they are (post_attention_layernorm is
ATTN_POST_NORM, post_feedforward_layernorm FFN_POST_NORM, q_norm / k_norm ATTN_Q_NORM /
ATTN_K_NORM of the whole projection); OLMo 2's config has no sliding_window, so none
is written."""

from __future__ import annotations

from .twin import Twin

TWINS = {"olmo2": Twin()}
