"""GGUF LoRA tensors into mola's factors: each tensor read (F32, F16, BF16 or a
llama.cpp quantized type, dequantized), each lora_a / lora_b pair checked and
transposed into a [in, r] and b [r, out] (experts: [E, in, r] and [E, r, out];
see gguf.py for the layout), llama's q/k rows put back in Hugging Face's
order, and the adapter's scale alpha / r applied as llama.cpp applies it.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np

from ...errors import InvalidAdapter
from ..weights import ModuleLoRA
from .gguf_names import EXPERT_TENSORS, hf_row_order


def module_lora(path: Path, base: str, factors: dict, alpha: float, num_experts: int | None,
                heads: int | None, dtype: mx.Dtype | None) -> ModuleLoRA:
    """The ModuleLoRA of one tensor pair ``base`` (blk.N.kind.weight): its
    factors checked and transposed, lora_b's rows reordered for ``heads``
    heads when given (llama's attn_q / attn_k), scale alpha / r."""
    if set(factors) != {"lora_a", "lora_b"}:
        missing = ({"lora_a", "lora_b"} - set(factors)).pop()
        raise InvalidAdapter(f"{path}: the LoRA tensor pair for '{base}' has no {missing}.")
    a_np, b_np, a_bf16, b_bf16 = _factors(path, base, factors, num_experts)
    if heads is not None:
        if heads <= 0 or b_np.shape[1] % (2 * heads):
            raise InvalidAdapter(
                f"{path}: '{base}' lora_b has {b_np.shape[1]} rows, which do not split into "
                f"{heads} heads of even size; is this the right base model?"
            )
        b_np = hf_row_order(b_np.T, heads).T
    rank = a_np.shape[-1]
    scale = alpha / rank if alpha else 1.0
    a = mx.array(np.ascontiguousarray(a_np))  # [in, r] or [E, in, r]
    b = mx.array(np.ascontiguousarray(b_np))  # [r, out] or [E, r, out]
    if a_bf16:
        a = a.astype(mx.bfloat16)
    if b_bf16:
        b = b.astype(mx.bfloat16)
    if dtype is not None:
        a, b = a.astype(dtype), b.astype(dtype)
    return ModuleLoRA(a=a, b=b, scale=scale)


def _tensor_array(tensor, where: str, ndim: int = 2) -> tuple[np.ndarray, bool]:
    """The tensor as an ``ndim``-D numpy array in GGUFReader's (reversed) order, and
    whether it was stored as bfloat16."""
    from gguf import GGMLQuantizationType, quants

    kind = tensor.tensor_type
    name = getattr(kind, "name", str(kind))
    if kind == GGMLQuantizationType.F32:
        data = np.array(tensor.data, dtype=np.float32)
    elif kind == GGMLQuantizationType.F16:
        data = np.array(tensor.data, dtype=np.float16)
    else:
        try:
            data = quants.dequantize(np.asarray(tensor.data), kind)
        except NotImplementedError:
            data = None
        if data is None or data.dtype != np.float32:
            raise InvalidAdapter(
                f"{where}: tensor '{tensor.name}' has type {name}, which mola cannot read as "
                "LoRA weights (F32, F16, BF16 and llama.cpp's quantized float types are supported)."
            )
    ne = [int(n) for n in tensor.shape]
    while len(ne) > ndim and ne[-1] == 1:
        ne.pop()
    if len(ne) == 1:  # a vector is a matrix with ne[1] == 1, as in ggml
        ne.append(1)
    if len(ne) != ndim:
        what = ("stacked per expert: lora_a ne [in, rank, experts], lora_b ne [rank, out, experts]"
                if ndim == 3 else "matrices")
        raise InvalidAdapter(
            f"{where}: tensor '{tensor.name}' has {len(ne)} dimensions (ne {ne}); "
            f"its LoRA factors must be {what}."
        )
    return data.reshape(ne[::-1]), kind == GGMLQuantizationType.BF16


def _factors(path: Path, base: str, factors: dict, num_experts: int | None):
    """A tensor pair's factors, checked as llama.cpp's loader checks them:
    (a [in, r], b [r, out], a_bf16, b_bf16) for a linear (b in the file's row
    order), and [E, in, r] / [E, r, out] for an expert tensor's stacks."""
    expert = base.split(".")[2] in EXPERT_TENSORS
    a_np, a_bf16 = _tensor_array(factors["lora_a"], str(path), ndim=3 if expert else 2)  # [(E,) r, in]
    b_np, b_bf16 = _tensor_array(factors["lora_b"], str(path), ndim=3 if expert else 2)  # [(E,) out, r]
    ne_a, ne_b = list(a_np.shape[::-1]), list(b_np.shape[::-1])
    if a_np.shape[:-2] != b_np.shape[:-2] or a_np.shape[-2] != b_np.shape[-1]:
        raise InvalidAdapter(
            f"{path}: '{base}' has lora_a of rank {a_np.shape[-2]} (ne {ne_a}) but lora_b of rank "
            f"{b_np.shape[-1]} (ne {ne_b}); llama.cpp expects lora_a ne = [in, rank{', experts' * expert}] "
            f"and lora_b ne = [rank, out{', experts' * expert}] with the same rank"
            f"{' and expert count' * expert}."
        )
    if expert and num_experts is not None and a_np.shape[0] != num_experts:
        raise InvalidAdapter(
            f"{path}: '{base}' holds LoRA factors for {a_np.shape[0]} experts (lora_a ne {ne_a}), "
            f"but the base model has {num_experts} experts per layer."
        )
    return a_np.swapaxes(-1, -2), b_np.swapaxes(-1, -2), a_bf16, b_bf16
