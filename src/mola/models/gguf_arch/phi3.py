"""Phi-3, Phi-3.5 and Phi-4 (mini and 14B): convert_hf_to_gguf.py's Phi3MiniModel
(conversion/phi.py), which writes Phi3ForCausalLM's fused ``qkv_proj`` and
``gate_up_proj`` as they are (attn_qkv, ffn_up: gguf_names.FUSED_TENSORS), as
mlx-lm's phi3 model keeps them. llama.cpp computes it in src/models/phi3.cpp.

What the converter writes and how mola maps it:

- ``rope.dimension_count`` = int(partial_rotary_factor * n_embd) // n_head
  (Phi-4-mini: 96 of 128) -> mlx-lm's ``partial_rotary_factor`` = n_rot / head_dim,
  which mlx-lm turns back into int(head_dim * factor) rotated dimensions (checked
  to give n_rot again). Both rope the first n_rot dimensions in NEOX halves and
  pass the rest through.
- LongRoPE ("su"/"longrope" in config.json; Phi-3-mini-128k, Phi-3.5-mini,
  Phi-4-mini): the converter writes no rope.scaling.type (set_gguf_parameters does
  not call TextModel's), but the tensors rope_factors_long / rope_factors_short
  (generate_extra_tensors), ``rope.scaling.attn_factor`` = sqrt(1 + ln(s) /
  ln(orig)) for s = context_length / orig > 1, and ``rope.scaling.original_context_length``
  = orig. mlx-lm's SuScaledRoPE divides each frequency by long_factor and scales the
  rotated dimensions by that same sqrt(...) of max_position_embeddings /
  original_max_position_embeddings, as ggml_rope_ext does with freq_factors and
  attn_factor; so the factors (float32 in the file, float32 in mlx-lm) map exactly,
  and a stored attn_factor other than the one mlx-lm computes is refused.
  llama.cpp picks rope_factors_long when its context per sequence exceeds orig
  (llama_model::get_rope_factors), rope_factors_short otherwise; mlx-lm's phi3 always
  uses the long ones, which is llama.cpp at the model's full context (its default).
- ``sliding_window`` (Phi-3-mini's 2047; 0 for Phi-4): llama.cpp ignores it
  (llama_model_phi3::load_arch_hparams: "Phi SWA is currently disabled", swa_type
  NONE), and mlx-lm's phi3 has no sliding window either; they agree, so it is not
  mapped.

Refused by name: a head size that is not hidden / heads (mlx-lm's phi3 derives it),
rope scaling mlx-lm's phi3 cannot take (linear: its ModelArgs wants long factors;
longrope with a factor), one of the two factor tensors without the other, an
attn_factor without factors or not mlx-lm's."""

from __future__ import annotations

import math

import numpy as np

from ...errors import ModelLoadError
from .base import BaseArchitecture, float32_decimal

_LONG, _SHORT = "rope_factors_long.weight", "rope_factors_short.weight"


def _config(f, config: dict, tensors: set[str]) -> dict:
    hidden, n_head, head_dim = config["hidden_size"], config["num_attention_heads"], config["head_dim"]
    if head_dim != hidden // n_head:
        raise ModelLoadError(f"{f.path}: phi3.attention.key_length is {head_dim}, not hidden / heads "
                             f"({hidden // n_head}); mlx-lm's phi3 model derives the head size.")
    n_rot = f.get_int(".rope.dimension_count", head_dim)
    return {**_partial_rope(f, head_dim, n_rot), **_long_rope(f, config, tensors, n_rot)}


def _partial_rope(f, head_dim: int, n_rot: int) -> dict:
    """mlx-lm's partial_rotary_factor for llama.cpp's n_rot rotated dimensions."""
    if n_rot == head_dim:
        return {}
    factor = n_rot / head_dim
    if not 0 < n_rot < head_dim or n_rot % 2 or int(head_dim * factor) != n_rot:
        raise ModelLoadError(f"{f.path}: phi3.rope.dimension_count is {n_rot} of {head_dim} head "
                             "dimensions, which mlx-lm's phi3 partial_rotary_factor cannot express.")
    return {"partial_rotary_factor": factor}


def _long_rope(f, config: dict, tensors: set[str], n_rot: int) -> dict:
    """mlx-lm's SuScaledRoPE config for the file's LongRoPE factors, or {} for plain rope."""
    kind, factor = f.get(".rope.scaling.type", "none"), f.get(".rope.scaling.factor")
    if config.get("rope_scaling") is not None or (kind == "longrope" and factor not in (None, 0, 1)):
        raise ModelLoadError(f"{f.path} uses rope scaling '{kind}' with phi3.rope.scaling.factor "
                             f"{factor}, which mlx-lm's phi3 model does not apply.")
    attn_factor = float32_decimal(f.get(".rope.scaling.attn_factor", 1.0))
    held = [name for name in (_LONG, _SHORT) if name in tensors]
    if not held:
        if attn_factor != 1.0:
            raise ModelLoadError(f"{f.path}: phi3.rope.scaling.attn_factor is {attn_factor:g} without "
                                 "rope factors; mlx-lm's phi3 model scales only its LongRoPE.")
        return {}
    if len(held) == 1:
        raise ModelLoadError(f"{f.path} holds {held[0]} without the other LongRoPE factors; llama.cpp "
                             "would switch to plain rope on short contexts, which mlx-lm cannot follow.")
    long, short = _factors(f, _LONG, n_rot), _factors(f, _SHORT, n_rot)
    orig = f.get_int(".rope.scaling.original_context_length", config["max_position_embeddings"])
    scale = config["max_position_embeddings"] / orig
    mlx_scale = 1.0 if scale <= 1.0 else math.sqrt(1 + math.log(scale) / math.log(orig))
    if np.float32(mlx_scale) != np.float32(attn_factor):
        raise ModelLoadError(
            f"{f.path}: phi3.rope.scaling.attn_factor is {attn_factor:g}, but mlx-lm's phi3 LongRoPE "
            f"scales by {mlx_scale:g} (from context_length {config['max_position_embeddings']} over "
            f"rope.scaling.original_context_length {orig}).")
    return {"rope_scaling": {"type": "longrope", "long_factor": long, "short_factor": short},
            "original_max_position_embeddings": orig}


def _factors(f, name: str, n_rot: int) -> list[float]:
    """A rope factor tensor's values, as the decimals they were written from (each
    the same float32 again in mlx-lm: base.float32_decimal)."""
    tensor = next(t for t in f.reader.tensors if t.name == name)
    if tensor.tensor_type.name not in ("F32", "F16") or int(np.prod(tensor.shape)) != n_rot // 2:
        raise ModelLoadError(f"{f.path}: {name} is {tensor.tensor_type.name} {[int(n) for n in tensor.shape]}; "
                             f"mola reads float rope factors, one per rotated pair ({n_rot // 2}).")
    return [float32_decimal(v) for v in np.asarray(tensor.data, dtype=np.float32).reshape(-1)]


ARCHITECTURES = (
    BaseArchitecture("phi3", "phi3", "Phi3ForCausalLM", partial_rope=True,
                     globals={"rope_factors_long": None, "rope_factors_short": None},
                     rope_scalings=frozenset({"longrope"}), config=_config),
)
