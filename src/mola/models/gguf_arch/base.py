"""What mola knows of one llama.cpp architecture (``general.architecture``): the
mlx-lm model it becomes, the block tensors that are not LoRA-targetable linears
(norms, gpt-oss's sinks; the linears' names are adapters/formats/gguf_names.py's,
which the GGUF LoRA reader shares), and two hooks for what the generic reading in
metadata.py and gguf.py cannot say: the architecture's own metadata keys, and fixes
to the tensors as llama.cpp's converter wrote them (Gemma's ``1 + w`` norms).

The hooks take the opened file (models/gguf_file.GGUFFile: ``f.get(".key")`` reads
``{arch}.key``) without importing it, so that this package sits below gguf_file.py."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import numpy as np

# llama.cpp's block norms (gguf-py constants.py MODEL_TENSOR.ATTN_NORM, FFN_NORM,
# ATTN_Q_NORM, ATTN_K_NORM) -> mlx-lm's modules under model.layers.N, as llama,
# qwen2/3, their mixtures of experts, phi3, granite and smollm3 name them
LLAMA_NORMS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
}


@dataclass(frozen=True)
class BaseArchitecture:
    name: str  # general.architecture
    model_type: str  # the mlx-lm model module
    hf_class: str  # config.json "architectures", for `mola convert`
    default_rope_theta: float = 10000.0  # llama.cpp's default when the file has none
    # llama.cpp block tensor kind ("attn_norm"), or kind.leaf for a parameter that is
    # not a module's weight ("attn_sinks.weight") -> mlx-lm path under model.layers.N
    norms: Mapping[str, str] = field(default_factory=lambda: LLAMA_NORMS)
    # more top-level tensors (name without .weight) -> mlx-lm module, or None for a tensor
    # that ``config`` reads and that is no weight of the model (llama 3's rope_freqs)
    globals: Mapping[str, str | None] = field(default_factory=dict)
    # rope.scaling.type values (other than linear) that ``config`` maps itself
    rope_scalings: frozenset[str] = frozenset()
    # ``config`` maps a rope.dimension_count below the head size itself (phi3's
    # partial_rotary_factor); otherwise metadata.py refuses partial rope
    partial_rope: bool = False
    # (f, config so far, tensor names) -> config keys to set or override
    config: Callable[[object, dict, set[str]], dict] | None = None
    # (held tensors by mlx-lm name, config) -> None: fix them in place
    weights: Callable[[dict, dict], None] | None = None
    # (the built mlx-lm model, config) -> None: fix it in place where mlx-lm's class
    # cannot serve a batch as it serves one row (gemma2's masks)
    model: Callable[[object, dict], None] | None = None


def float32_decimal(value) -> float:
    """A float32 metadata value as the decimal it was written from (1e-05, not
    9.999999747378752e-06)."""
    return float(str(np.float32(value)))
