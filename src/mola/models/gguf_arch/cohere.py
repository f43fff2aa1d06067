"""Command R / R+ / Aya (llama.cpp ``command-r`` -> mlx-lm ``cohere``) and Command R7B
(``cohere2`` -> mlx-lm ``cohere2``): convert_hf_to_gguf.py's CommandR2Model and
Cohere2Model (conversion/command_r.py); llama.cpp computes them in
src/models/command-r.cpp and cohere2.cpp.

Both: one LayerNorm per block (LLM_NORM, no bias: attn_norm -> input_layernorm)
feeding attention and MLP in parallel, the output tied to token_embd (llama.cpp
loads no output tensor; mlx-lm's models have no lm_head), logits times
``{arch}.logit_scale``, ``{arch}.attention.layer_norm_epsilon`` -> layer_norm_eps,
q/k in Hugging Face's order (the converters do not permute them) roped in
consecutive pairs (llama.cpp's LLAMA_ROPE_TYPE_NORM, mlx-lm's traditional=True).

command-r: logit_scale is optional (llama.cpp scales only by a non-zero one: 1.0
here). Command R+'s per-head q/k norms (blk.N.attn_q_norm / attn_k_norm, ggml ne
[head_dim, n_head], numpy [n_head, head_dim], as mlx-lm's LayerNorm2D weight) set
use_qk_norm; llama.cpp loads them where the model has 64 layers or more, mlx-lm
wherever they are, so mola follows the tensors. Norm and attention biases (mlx-lm's
layer_norm_bias, attention_bias) follow the tensors too.

cohere2: ``attention.sliding_window`` -> sliding_window; llama.cpp's pattern
(load_swa_pattern: ``attention.sliding_window_pattern`` as a per-layer array or a
period, default 4; layer i slides where i % n < n - 1) -> mlx-lm's period
``sliding_window_pattern`` (layer i is global where i % n == n - 1), and rope only on
the sliding layers in both. Both rope with ``rope.freq_base`` (cohere2.cpp leaves
``rope.freq_base_swa`` unused), so it is not read.

Refused by name: a head size that is not hidden / heads (both mlx-lm models derive
it), an output tensor (untied), rope scaling (mlx-lm's nn.RoPE here takes none), one
of q/k norm without the other, quantized q/k norms, for cohere2 a layer pattern
mlx-lm's period cannot say and a missing logit scale, sliding window or epsilon
(which llama.cpp requires)."""

from __future__ import annotations

from ...errors import ModelLoadError
from ..codecs import Quantized
from .base import BaseArchitecture, float32_decimal

# the block norms (constants.py MODEL_TENSOR) -> mlx-lm's cohere modules
COHERE_NORMS = {"attn_norm": "input_layernorm", "attn_q_norm": "self_attn.q_norm",
                "attn_k_norm": "self_attn.k_norm"}


def _common(f, config: dict, tensors: set[str]) -> dict:
    """The keys both architectures read alike."""
    name, hidden, n_head = f.arch.name, config["hidden_size"], config["num_attention_heads"]
    if config["head_dim"] * n_head != hidden:
        raise ModelLoadError(f"{f.path}: {name}.attention.key_length is {config['head_dim']}, not "
                             f"hidden / heads ({hidden // n_head}); mlx-lm's {f.arch.model_type} "
                             "model derives the head size.")
    if "output.weight" in tensors:
        raise ModelLoadError(f"{f.path} holds output.weight, but llama.cpp's {name} and mlx-lm's "
                             f"{f.arch.model_type} model tie the output to token_embd.")
    if config.get("rope_scaling") is not None:
        raise ModelLoadError(f"{f.path} uses rope scaling {config['rope_scaling']}, which mlx-lm's "
                             f"{f.arch.model_type} model does not apply.")
    eps = f.get(".attention.layer_norm_epsilon")
    if eps is None:
        raise ModelLoadError(f"{f.path} has no {name}.attention.layer_norm_epsilon, which llama.cpp needs.")
    return {"layer_norm_eps": float32_decimal(eps),
            "layer_norm_bias": "blk.0.attn_norm.bias" in tensors,
            "attention_bias": "blk.0.attn_q.bias" in tensors}


def _command_r_config(f, config: dict, tensors: set[str]) -> dict:
    q_norm, k_norm = "blk.0.attn_q_norm.weight" in tensors, "blk.0.attn_k_norm.weight" in tensors
    if q_norm != k_norm:
        raise ModelLoadError(f"{f.path} holds {'q' if q_norm else 'k'} norms without "
                             f"{'k' if q_norm else 'q'} norms; mlx-lm's cohere model has both or neither.")
    scale = f.get(".logit_scale")
    return {**_common(f, config, tensors), "use_qk_norm": q_norm,
            "logit_scale": float32_decimal(scale) if scale else 1.0}


def _cohere2_config(f, config: dict, tensors: set[str]) -> dict:
    for key in (".logit_scale", ".attention.sliding_window"):
        if f.get(key) is None:
            raise ModelLoadError(f"{f.path} has no cohere2{key}, which llama.cpp needs.")
    return {**_common(f, config, tensors), "logit_scale": f.get_float(".logit_scale"),
            "sliding_window": f.get_int(".attention.sliding_window"),
            "sliding_window_pattern": _period(f, config["num_hidden_layers"])}


def _period(f, n_layers: int) -> int:
    """mlx-lm's sliding_window_pattern for llama.cpp's (llama_model_base::load_swa_pattern
    with its default 4, llama_hparams::set_swa_pattern)."""
    pattern = f.get(".attention.sliding_window_pattern", 4)
    slides = ([bool(v) for v in pattern] if isinstance(pattern, list)
              else [pattern == 0 or i % pattern < pattern - 1 for i in range(n_layers)])
    for period in range(1, n_layers + 1):  # mlx-lm's cohere2 indexes layer period - 1's cache
        if slides == [i % period != period - 1 for i in range(n_layers)]:
            return period
    raise ModelLoadError(f"{f.path}: cohere2.attention.sliding_window_pattern {pattern} (sliding layers "
                         f"{[i for i, s in enumerate(slides) if s]} of {n_layers}) is no period of "
                         "mlx-lm's cohere2 model, whose layer period - 1 of each period is global.")


def _weights(held: dict, config: dict) -> None:
    """q/k norms stay float: mlx-lm's LayerNorm2D holds no quantized weight (the
    converter writes every ``*_norm.weight`` in F32)."""
    for name, value in held.items():
        if name.endswith(("q_norm.weight", "k_norm.weight")) and isinstance(value, Quantized):
            raise ModelLoadError(f"{name} is quantized; mlx-lm's cohere q/k norms are float weights.")


ARCHITECTURES = (
    BaseArchitecture("command-r", "cohere", "CohereForCausalLM", norms=COHERE_NORMS,
                     config=_command_r_config, weights=_weights),
    BaseArchitecture("cohere2", "cohere2", "Cohere2ForCausalLM", norms={"attn_norm": "input_layernorm"},
                     config=_cohere2_config),
)
