"""Gemma, Gemma 2 and Gemma 3 (text): llama.cpp's gemma, gemma2 and gemma3 ->
mlx-lm's gemma, gemma2 and gemma3_text.

Tensors (gguf-py tensor_mapping.py; conversion/gemma.py GemmaModel, Gemma2Model,
Gemma3Model): Gemma's post_attention_layernorm is FFN_NORM; Gemma 2 and 3 have four
norms a block, post_attention_layernorm -> ATTN_POST_NORM, pre_feedforward_layernorm
-> FFN_NORM, post_feedforward_layernorm -> FFN_POST_NORM, and Gemma 3 q_norm / k_norm
-> ATTN_Q_NORM / ATTN_K_NORM. The output is token_embd (src/models/gemma*.cpp:
TENSOR_DUPLICATED), except a Gemma 3 file that carries output.weight.

Every norm is stored as ``1 + w`` (the ``modify_tensors`` of all three add 1 to each
tensor ending in "norm.weight"), where mlx-lm's RMSNorm computes with ``1 + weight``:
the ``weights`` hook stores ``s - 1``.

Metadata, as src/models/gemma*.cpp ``load_arch_hparams`` reads it:
  attention scale   1/sqrt(head_dim), or 1/sqrt(n_embd / n_head) for the 27B models
                    (gemma2: 46 layers, gemma3: 62): query_pre_attn_scalar (gemma2,
                    gemma3_text). llama.cpp never reads Hugging Face's
                    query_pre_attn_scalar; this is what it computes instead.
  gemma2            attn_logit_softcapping (default 50), final_logit_softcapping
                    (default 30); sliding window (default 4096) on the layers of
                    load_swa_pattern(ml, 2), which mlx-lm's gemma2 model does not
                    have: the context is capped at the window, below which a window
                    masks nothing (llama-hparams.h is_masked_swa: p1 - p0 >= n_swa).
  gemma3            sliding_window (none or 0: every layer global) on the layers of
                    load_swa_pattern(ml, 6) -> sliding_window, sliding_window_pattern;
                    rope.freq_base_swa (default 10000, llama_hparams) ->
                    rope_local_base_freq; linear rope scaling on the global layers
                    only (rope_freq_scale_train_swa stays 1), as mlx-lm's.
mlx-lm's gemma2 attention cannot take a batch's mask with grouped queries: the
``model`` hook (batched_masks) gives each layer's attention the missing axis.
Refused, naming the key: rope scaling for gemma and gemma2 (mlx-lm's nn.RoPE there
takes no scale), a gemma2 rope.freq_base_swa other than freq_base, a gemma3
final_logit_softcapping (mlx-lm's gemma3_text has none), layer patterns mlx-lm's
models cannot hold, head sizes per layer kind (attention.key_length_swa, ...), and
an output.weight in gemma or gemma2 (llama.cpp never reads it)."""

from __future__ import annotations

import functools

import numpy as np

from ...errors import ModelLoadError
from .base import BaseArchitecture

GEMMA_NORMS = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}
GEMMA2_NORMS = {
    "attn_norm": "input_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
GEMMA3_NORMS = {**GEMMA2_NORMS, "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
# llama.cpp's LLM_TYPE_27B, whose attention scale is 1/sqrt(n_embd / n_head)
_27B_LAYERS = {"gemma2": 46, "gemma3": 62}
# llama.cpp reads these for every architecture (llama-model.cpp); mlx-lm's Gemma
# models have one head size and one rope size for every layer
_PER_KIND_SIZES = (".attention.key_length_swa", ".attention.value_length_swa", ".rope.dimension_count_swa")


def _refuse(f, what: str) -> None:
    raise ModelLoadError(f"{f.path}: {what}, which mlx-lm's {f.arch.model_type} model cannot follow.")


def _common(f, config: dict, tensors: set[str]) -> dict:
    """What all three share: no rope scaling for gemma / gemma2, one head size, the
    output tied to token_embd where llama.cpp reads no other."""
    name = f.arch.name
    if "rope_scaling" in config and name != "gemma3":
        _refuse(f, f"{name}.rope.scaling.type is linear (factor {config['rope_scaling']['factor']:g})")
    for key in _PER_KIND_SIZES:
        if f.get(key) is not None and f.get_int(key) != config["head_dim"]:
            _refuse(f, f"{name}{key} is {f.get(key)}, not the full layers' {config['head_dim']}")
    if "output.weight" in tensors and name != "gemma3":
        raise ModelLoadError(
            f"{f.path} holds output.weight, which llama.cpp's {name} never reads (its output is "
            f"token_embd, src/models/{name}.cpp), and mlx-lm's {f.arch.model_type} model has no lm_head.")
    if name not in _27B_LAYERS:
        return {}
    hidden, n_head = config["hidden_size"], config["num_attention_heads"]
    is_27b = config["num_hidden_layers"] == _27B_LAYERS[name]
    return {"query_pre_attn_scalar": hidden // n_head if is_27b else config["head_dim"]}


def swa_layers(f, n_layers: int, period: int) -> list[bool]:
    """Which layers slide, as llama_model_base::load_swa_pattern reads it: an array
    (bool or int, missing layers full), else the period (``period`` by default), a
    layer sliding when il % n < n - 1 (llama_hparams::set_swa_pattern; 0: every layer)."""
    value = f.get(".attention.sliding_window_pattern")
    if isinstance(value, list):
        flags = [bool(v) for v in value[:n_layers]]
        return flags + [False] * (n_layers - len(flags))
    n = int(value) if value is not None else period
    return [n == 0 or i % n < n - 1 for i in range(n_layers)]


def _gemma2(f, config: dict, tensors: set[str]) -> dict:
    """gemma2.cpp: soft-capping; one rope base; sliding layers as a context cap."""
    out = _common(f, config, tensors)
    out["attn_logit_softcapping"] = f.get_float(".attn_logit_softcapping", 50.0)
    out["final_logit_softcapping"] = f.get_float(".final_logit_softcapping", 30.0)
    if not any(swa_layers(f, config["num_hidden_layers"], 2)):
        return out
    base, base_swa = config["rope_theta"], f.get_float(".rope.freq_base_swa", config["rope_theta"])
    if base_swa != base:
        _refuse(f, f"gemma2.rope.freq_base_swa is {base_swa:g}, not rope.freq_base's {base:g} "
                   "(one rope base for every layer)")
    window = f.get_int(".attention.sliding_window", 4096)  # gemma2.cpp's default
    if window < 1:
        _refuse(f, f"gemma2.attention.sliding_window is {window}")
    return {**out, "sliding_window": window,  # for the record: mlx-lm's gemma2 reads no window
            "max_position_embeddings": min(config["max_position_embeddings"], window)}


def _gemma3(f, config: dict, tensors: set[str]) -> dict:
    """gemma3.cpp: sliding layers every n-th global, their own rope base, no final cap."""
    out = _common(f, config, tensors)
    cap = f.get_float(".final_logit_softcapping", 0.0)
    if cap:
        _refuse(f, f"gemma3.final_logit_softcapping is {cap:g}")
    layers, window = config["num_hidden_layers"], f.get_int(".attention.sliding_window", 0)
    if window <= 0:  # no sliding window: every layer global (swa_type NONE)
        return {**out, "sliding_window_pattern": 1}
    flags = swa_layers(f, layers, 6)
    # mlx-lm's gemma3_text: layer i global iff i % p == p - 1, for p up to the layer count
    period = flags.index(False) + 1 if False in flags else None
    if period is None or flags != [i % period != period - 1 for i in range(layers)]:
        shown = f.get(".attention.sliding_window_pattern", 6)
        _refuse(f, f"gemma3.attention.sliding_window_pattern {shown} slides layers "
                   f"{[i for i, s in enumerate(flags) if s][:8]} of {layers} (not every n-th layer global)")
    return {**out, "sliding_window": window, "sliding_window_pattern": period,
            "rope_local_base_freq": f.get_float(".rope.freq_base_swa", 10000.0)}


def _norms(held: dict, config: dict) -> None:
    """Undo the converter's ``1 + w``: each norm ``s`` becomes ``w = s - 1``, which
    mlx-lm's RMSNorm turns back into ``1 + w``. That gives ``s`` exactly, in any binary
    float format that holds ``s``, wherever s >= 0.5: s - 1 is exact (Sterbenz's lemma
    for s in [0.5, 2]; above 1 the difference needs no more bits than s), and so is
    1 + (s - 1). Below 0.5 it is s within half an ulp of [0.5, 1) (2**-25 in float32).
    F16 and BF16 norms are widened to float32 first."""
    from ..codecs import BFloat16

    for name, value in held.items():
        if not name.endswith("norm.weight"):
            continue
        if isinstance(value, BFloat16):
            value = (value.bits.astype(np.uint32) << 16).view(np.float32)
        elif not isinstance(value, np.ndarray):
            raise ModelLoadError(f"the norm {name} is stored quantized; mola reads Gemma's norms as floats.")
        held[name] = np.asarray(value, dtype=np.float32) - np.float32(1)


def batched_masks(model, config: dict) -> None:
    """Let mlx-lm's gemma2 model take a batch's mask (mlx-lm 0.32.2, unchanged upstream):
    with grouped queries its scores are [B, kv heads, repeats, L, S], while a batch
    cache's mask (BatchKVCache.make_mask: left padding) is [B, 1, L, S], which numpy
    broadcasting aligns as [1, B, 1, L, S]. A batch of B rows then fails, or, where B
    equals the kv heads, masks head b of every row with row b's padding. Each layer's
    attention becomes _Gemma2Attention, which gives the mask its repeats axis; a row's
    scores are the same as alone (a 2-D or absent mask is left as it is)."""
    for layer in model.layers:
        layer.self_attn.__class__ = _gemma2_attention()


@functools.cache
def _gemma2_attention():
    from mlx_lm.models import gemma2

    class _Gemma2Attention(gemma2.Attention):
        def __call__(self, x, mask=None, cache=None):
            if self.repeats > 1 and getattr(mask, "ndim", 0) == 4:
                mask = mask[:, :, None]
            return super().__call__(x, mask, cache)

    return _Gemma2Attention


ARCHITECTURES = (
    BaseArchitecture("gemma", "gemma", "GemmaForCausalLM", norms=GEMMA_NORMS,
                     config=_common, weights=_norms),
    BaseArchitecture("gemma2", "gemma2", "Gemma2ForCausalLM", norms=GEMMA2_NORMS,
                     config=_gemma2, weights=_norms, model=batched_masks),
    BaseArchitecture("gemma3", "gemma3_text", "Gemma3ForCausalLM", norms=GEMMA3_NORMS,
                     config=_gemma3, weights=_norms),
)
