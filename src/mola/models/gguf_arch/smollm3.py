"""smollm3 (SmolLM3): convert_hf_to_gguf.py's SmolLM3Model (conversion/llama.py), a
LlamaModel under its own architecture name: q/k rows in llama.cpp's rope order (undone
by gguf.py), nothing written beyond llama's keys.

Its NoPE layers are in no metadata: src/models/smollm3.cpp sets
``n_no_rope_layer_step = 4`` and ropes layer il only where (il + 1) % 4 != 0, whatever
the Hugging Face config's no_rope_layers said (the converter drops it). mlx-lm's smollm3
takes the same as no_rope_layer_interval 4, or per layer as no_rope_layers (1 = rope),
which is set explicitly here. llama.cpp's smollm3 reads no rope_freqs (metadata.py
refuses the tensor) and no biases beyond q/k/v."""

from __future__ import annotations

from .base import BaseArchitecture

NO_ROPE_LAYER_STEP = 4  # llama_model_smollm3::load_arch_hparams


def _config(f, config: dict, tensors: set[str]) -> dict:
    layers = config["num_hidden_layers"]
    return {
        "no_rope_layer_interval": NO_ROPE_LAYER_STEP,
        "no_rope_layers": [int((i + 1) % NO_ROPE_LAYER_STEP != 0) for i in range(layers)],
        "attention_bias": "blk.0.attn_q.bias" in tensors,
        "mlp_bias": "blk.0.ffn_up.bias" in tensors,
    }


ARCHITECTURES = (BaseArchitecture("smollm3", "smollm3", "SmolLM3ForCausalLM", config=_config),)
