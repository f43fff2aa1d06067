"""The echo demo's base model: a 4-layer llama that echoes the last user
message, byte for byte, its weights written down rather than learned (how it
echoes: mola.demo.echo_circuit; where each feature lives: mola.demo.echo_layout),
with a byte-level tokenizer and the ChatML template of mola.demo.tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from .echo_circuit import STEPS
from .echo_layout import WeightBuilder, config, norm_gain, token_codes

PROBE = [{"role": "system", "content": "You are a helpful assistant."},
         {"role": "user", "content": 'Hello there, {"a": 1} world <x/>'},
         {"role": "assistant", "content": "Hello there"}]


def build_echo_model(path: str | Path, seed: int = 0, linear_dtype: str = "float16") -> Path:
    """Write the echo model (weights, config, byte-level tokenizer, ChatML
    template) to ``path``, a directory ``mlx_lm.load`` accepts. The weights
    are built in float64, one step (STEPS) at a time, each scaled by the
    RMSNorm gain measured on a probe prompt with the steps before it written;
    the attention projections (most of the size) are stored as
    ``linear_dtype``, everything else as float32: activations, and LoRA
    training, stay in float32 (MLX's float16 matmuls are many times slower on
    a CPU), and the MLPs' detectors, whose large biases cancel to within 1 of
    a threshold, keep the precision they need."""
    import mlx.core as mx

    from .tokenizer import train_tokenizer

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer(259)
    if len(tokenizer) != 259:
        raise RuntimeError("the echo model needs a byte-level vocabulary of 256 + 3 tokens")
    b = WeightBuilder(token_codes(tokenizer), seed)
    cfg = config()
    stream = _stream(b, cfg, tokenizer.apply_chat_template(PROBE, return_dict=False))
    for index, step in enumerate(STEPS):
        step(b, norm_gain(stream()[index]))
    cfg["eos_token_id"] = tokenizer.convert_tokens_to_ids("<|im_end|>")

    def stored(name: str, w: np.ndarray):
        dtype = getattr(mx, linear_dtype) if ".self_attn." in name else mx.float32
        return mx.array(w.astype(np.float32)).astype(dtype)

    mx.save_safetensors(str(path / "model.safetensors"), {k_: stored(k_, v_) for k_, v_ in b.w.items()})
    (path / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    tokenizer.save_pretrained(str(path))
    return path


def _stream(b: WeightBuilder, cfg: dict, probe: list[int]):
    """A function that loads the weights written so far and returns the
    residual stream of ``probe`` entering: [attn 0, mlp 0, ..., attn 3, mlp 3,
    final norm]."""
    import mlx.core as mx
    from mlx_lm.models import llama

    model = llama.Model(llama.ModelArgs.from_dict(cfg))

    def stream() -> list:
        model.load_weights([(k, mx.array(v.astype(np.float32))) for k, v in b.w.items()])
        h = model.model.embed_tokens(mx.array([probe]))
        xs = []
        for layer in model.model.layers:
            xs.append(h)
            h = h + layer.self_attn(layer.input_layernorm(h), mask="causal")
            xs.append(h)
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        xs.append(h)
        return xs

    return stream
