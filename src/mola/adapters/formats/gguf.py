"""llama.cpp GGUF LoRA adapters (what llama.cpp's convert_lora_to_gguf.py writes):

    general.type = "adapter", adapter.type = "lora", adapter.lora.alpha (float32),
    general.architecture = "llama" | "qwen2" | "qwen3" | "qwen2moe" | "qwen3moe" | "gpt-oss"
    blk.3.attn_q.weight.lora_a   ne = [in, r]    (numpy, as GGUFReader gives it: [r, in])
    blk.3.attn_q.weight.lora_b   ne = [r, out]   (numpy: [out, r])
    blk.3.ffn_up_exps.weight.lora_a   ne = [in, r, E]    (numpy: [E, r, in])
    blk.3.ffn_up_exps.weight.lora_b   ne = [r, out, E]   (numpy: [E, out, r])

The experts' factors are stacked per expert, as convert_lora_to_gguf.py stacks them
(torch.stack of each expert's lora_A and lora_B, through the base converter's own
expert merge) and llama.cpp applies them (llama-graph.cpp build_lora_mm_id:
ggml_mul_mat_id on lora_a then lora_b with the routed expert ids; llama-adapter.cpp
checks a->ne[0] == in, b->ne[1] == out, a->ne[1] == b->ne[0]). Which mlx-lm module a
tensor is depends on the base (gguf_names.py): ``ffn_gate_inp`` is qwen's ``mlp.gate``,
Mixtral's ``block_sparse_moe.gate``, gpt-oss's ``mlp.router``.

llama.cpp applies delta(x) = s * mul_mat(b, mul_mat(a, x)), i.e. in numpy terms
x @ a.T @ b.T, with s = alpha / r when alpha != 0 and 1 otherwise (src/llama-adapter.h,
``llama_adapter_lora_weight::get_scale``; r is lora_b's ne[0]). So mola's [in, r] / [r, out]
factors are the transposes of the stored arrays.

For ``llama`` (which also covers Mistral bases: HF's MistralForCausalLM converts as
llama), llama.cpp's converter reorders the rows of q_proj and k_proj within each head
for its rope kernel (``LlamaModel.permute``), and its LoRA converter applies the same
reordering to lora_b of attn_q / attn_k. mola's bases are mlx-lm models in Hugging
Face's row order, so those lora_b rows are put back; that needs the base's head counts,
which an adapter file does not store. qwen2 and qwen3 are not permuted.
"""

from __future__ import annotations

import math
from pathlib import Path

import mlx.core as mx

from ...errors import InvalidAdapter
from ..weights import LoRAWeights, ModuleLoRA, invocation_tokens, with_invocation
from .gguf_names import ARCHITECTURES, MOE_MODEL_TYPES, Architecture, block_tensors, is_moe_tensor, module_path
from .gguf_tensors import module_lora

GGUF_MAGIC = b"GGUF"

KEY_GENERAL_TYPE = "general.type"
KEY_ARCHITECTURE = "general.architecture"
KEY_ADAPTER_TYPE = "adapter.type"
KEY_LORA_ALPHA = "adapter.lora.alpha"
KEY_ALORA_TOKENS = "adapter.alora.invocation_tokens"  # gguf-py: Keys.Adapter.ALORA_INVOCATION_TOKENS


def is_gguf_file(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(4) == GGUF_MAGIC
    except OSError:
        return False


# ---- reading -------------------------------------------------------------------


def _field_value(reader, key: str):
    """A scalar or string metadata value (None when absent). Works on gguf
    versions without ReaderField.contents()."""
    from gguf import GGUFValueType

    field = reader.fields.get(key)
    if field is None or not field.types:
        return None
    kind = field.types[0]
    if kind == GGUFValueType.STRING:
        return bytes(field.parts[field.data[0]]).decode("utf-8", errors="replace")
    if kind == GGUFValueType.ARRAY:
        return [field.parts[i].tolist()[0] if field.types[-1] != GGUFValueType.STRING
                else bytes(field.parts[i]).decode("utf-8", errors="replace") for i in field.data]
    return field.parts[field.data[0]].tolist()[0]


def read_metadata(path: Path) -> tuple[dict, dict[str, str]]:
    """A GGUF file's scalar and string metadata, and each tensor's type name
    (``F32``, ``Q8_0``, ...), without reading tensor data."""
    from gguf import GGUFValueType

    from .gguf_reader import GGUFFileReader

    try:
        reader = GGUFFileReader(str(path))
    except Exception as e:  # truncated or corrupt
        raise InvalidAdapter(f"{path} is not a readable GGUF file: {e}") from None
    fields = {key: _field_value(reader, key) for key, field in reader.fields.items()
              if field.types and field.types[0] != GGUFValueType.ARRAY}
    types = {t.name: getattr(t.tensor_type, "name", str(t.tensor_type)) for t in reader.tensors}
    return fields, types


def _head_counts(reader, arch: str, model_config: dict | None) -> tuple[int | None, int | None]:
    config = model_config or {}
    n_head = config.get("num_attention_heads")
    n_kv_head = config.get("num_key_value_heads")
    if n_head is None:  # model GGUFs store these; an adapter normally does not
        n_head = _field_value(reader, f"{arch}.attention.head_count")
        n_kv_head = _field_value(reader, f"{arch}.attention.head_count_kv")
    if n_head is not None and n_kv_head is None:
        n_kv_head = n_head
    return n_head, n_kv_head


def _check_header(reader, path: Path) -> tuple[Architecture, float]:
    """The adapter's architecture and adapter.lora.alpha, or InvalidAdapter naming
    what makes it something other than a plain llama.cpp LoRA."""
    if getattr(reader, "byte_order", "I") != "I":
        raise InvalidAdapter(
            f"{path} is a GGUF file of the other byte order (big-endian); mola reads "
            "little-endian GGUF adapters only."
        )
    general_type = _field_value(reader, KEY_GENERAL_TYPE)
    if general_type != "adapter":
        found = "no general.type" if general_type is None else f"general.type '{general_type}'"
        raise InvalidAdapter(
            f"{path} has {found}; a llama.cpp LoRA adapter has general.type 'adapter' "
            "(a GGUF model cannot be served as an adapter)."
        )
    adapter_type = _field_value(reader, KEY_ADAPTER_TYPE)
    if adapter_type != "lora":
        found = "no adapter.type" if adapter_type is None else f"adapter.type '{adapter_type}'"
        raise InvalidAdapter(
            f"{path} has {found}; mola serves LoRA adapters only (adapter.type 'lora')."
        )
    arch_name = _field_value(reader, KEY_ARCHITECTURE)
    arch = ARCHITECTURES.get(arch_name) if isinstance(arch_name, str) else None
    if arch is None:
        raise InvalidAdapter(
            f"{path} is a GGUF LoRA for architecture '{arch_name}', which mola cannot map "
            f"onto mlx-lm modules (supported: {', '.join(ARCHITECTURES)})."
        )
    alpha = _field_value(reader, KEY_LORA_ALPHA)
    if alpha is None:
        alpha = 0.0  # llama.cpp reads a missing alpha as 0, i.e. scale 1
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)):
        raise InvalidAdapter(f"{path}: {KEY_LORA_ALPHA} must be a number, got {alpha!r}.")
    if not math.isfinite(alpha):
        raise InvalidAdapter(f"{path}: {KEY_LORA_ALPHA} is {alpha}.")
    return arch, float(alpha)


def _layout(path: Path, arch: Architecture, model_type: str | None, kinds: set[str]) -> str:
    """The mlx-lm model type whose block layout the adapter's tensors map onto:
    the base's, or (without a base) the one the architecture and the tensors
    name (llama with expert tensors: mixtral)."""
    moe_kinds = sorted(k for k in kinds if is_moe_tensor(k))
    moe_types = sorted(arch.model_types & MOE_MODEL_TYPES)
    if model_type is None:
        dense_types = sorted(arch.model_types - MOE_MODEL_TYPES)
        return moe_types[0] if moe_types and (moe_kinds or not dense_types) else dense_types[0]
    if model_type not in arch.model_types:
        raise InvalidAdapter(
            f"{path} is a LoRA for a '{arch.name}' model (general.architecture), but the base "
            f"model's type is '{model_type}' (a '{arch.name}' adapter fits "
            f"{', '.join(sorted(arch.model_types))} bases)."
        )
    if moe_kinds and model_type not in MOE_MODEL_TYPES:
        raise InvalidAdapter(
            f"{path} holds mixture-of-experts LoRA tensors ({', '.join(moe_kinds[:4])}), but the "
            f"base model ('{model_type}') is dense: it is a LoRA for a "
            f"{' / '.join(moe_types) or 'mixture-of-experts'} base."
        )
    return model_type


def _pairs(reader, path: Path, arch: Architecture, model_type: str | None):
    """(layout, {tensor base name: {"lora_a": tensor, "lora_b": tensor}})."""
    factors, norms, others = [], [], []
    for tensor in reader.tensors:
        base, dot, leaf = tensor.name.rpartition(".")
        if dot and leaf in ("lora_a", "lora_b"):
            factors.append((base, leaf, tensor))
        elif tensor.name.endswith("_norm.weight"):
            norms.append(tensor.name)
        else:
            others.append(tensor.name)
    kinds = {base.split(".")[2] for base, _, _ in factors if base.count(".") == 3}
    layout = _layout(path, arch, model_type, kinds)
    if others:
        raise InvalidAdapter(
            f"{path} holds tensor '{others[0]}', which is not a LoRA factor "
            "(expected names ending in .lora_a / .lora_b)."
        )
    pairs: dict[str, dict[str, object]] = {}
    unmappable = []
    for base, leaf, tensor in factors:
        if module_path(base, layout) is None:
            unmappable.append(tensor.name)
        else:
            pairs.setdefault(base, {})[leaf] = tensor
    if unmappable:
        shown = ", ".join(unmappable[:5]) + (" ..." if len(unmappable) > 5 else "")
        served = ",".join(block_tensors(layout))
        raise InvalidAdapter(
            f"{path} holds LoRA tensors mola cannot map onto the linears of a '{layout}' model "
            f"(its blocks take blk.N.{{{served}}}): {shown}"
        )
    if norms:
        shown = ", ".join(norms[:5]) + (" ..." if len(norms) > 5 else "")
        raise InvalidAdapter(
            f"{path} holds norm weights ({shown}); llama.cpp ignores them, but mola does not "
            "drop part of an adapter silently."
        )
    return layout, pairs


def read_gguf_adapter(
    path: Path,
    dtype: mx.Dtype | None = None,
    model_type: str | None = None,
    *,
    model_config: dict | None = None,
    rows_as_stored: bool = False,
) -> LoRAWeights:
    """Read (and evaluate) a llama.cpp GGUF LoRA file.

    ``model_type`` is the base's mlx-lm model type; ``model_config`` its
    config.json (it supplies ``model_type`` when that is not given, the head
    counts needed to put llama's q/k LoRA rows back in Hugging Face's order, and
    the expert count an expert LoRA must have). Experts' factors are read as
    a [E, in, r] and b [E, r, out] (see weights.ModuleLoRA).
    Shapes are checked against the model later, by :func:`mola.adapters.weights.validate`.
    ``rows_as_stored`` leaves llama's q/k rows in llama.cpp's order (shapes and
    scales are the same), to describe an adapter without its base.
    """
    path = Path(path)
    reader = _open(path)
    arch, alpha = _check_header(reader, path)
    config = model_config or {}
    layout, pairs = _pairs(reader, path, arch, model_type if model_type is not None else config.get("model_type"))
    num_experts = config.get("num_experts") or config.get("num_local_experts")
    heads = {} if rows_as_stored else _heads_to_reorder(reader, path, arch, pairs, model_config)
    modules: dict[str, ModuleLoRA] = {}
    for base, factors in sorted(pairs.items(), key=lambda kv: _natural(kv[0])):
        modules[module_path(base, layout)] = module_lora(path, base, factors, alpha, num_experts,
                                                         heads.get(base.split(".")[2]), dtype)
    try:
        mx.eval([(m.a, m.b) for m in modules.values()])
    except Exception as e:
        raise InvalidAdapter(f"{path} could not be read: {e}") from None
    return with_invocation(LoRAWeights(source=str(path), format="gguf", modules=modules),
                           _invocation_tokens(reader, path))


def _invocation_tokens(reader, path: Path) -> tuple[int, ...] | None:
    """An activated LoRA's invocation tokens (KEY_ALORA_TOKENS, which llama.cpp's
    src/llama-adapter.cpp reads into alora_invocation_tokens); None: a plain LoRA."""
    value = _field_value(reader, KEY_ALORA_TOKENS) if KEY_ALORA_TOKENS in reader.fields else None
    return invocation_tokens(value, f"{path}: {KEY_ALORA_TOKENS}")


def _open(path: Path):
    from .gguf_reader import GGUFFileReader

    try:
        return GGUFFileReader(str(path))
    except Exception as e:  # truncated or corrupt: numpy/struct/value errors
        raise InvalidAdapter(f"{path} is not a readable GGUF file: {e}") from None


def _heads_to_reorder(reader, path: Path, arch: Architecture, pairs: dict, model_config: dict | None) -> dict:
    """{"attn_q": n_head, "attn_k": n_kv_head} when llama.cpp stored those
    lora_b rows in its rope order (llama), else {}."""
    if not arch.permutes_qk or not any(b.split(".")[2] in ("attn_q", "attn_k") for b in pairs):
        return {}
    n_head, n_kv_head = _head_counts(reader, arch.name, model_config)
    if n_head is None:
        raise InvalidAdapter(
            f"{path} is a '{arch.name}' LoRA on attn_q/attn_k, whose lora_b rows llama.cpp "
            "stores in its own rope order; putting them back in the base model's order "
            "needs the base's num_attention_heads / num_key_value_heads, which the adapter "
            "does not store (read it with the base model's config)."
        )
    return {"attn_q": n_head, "attn_k": n_kv_head}


def _natural(name: str):
    return [int(p) if p.isdigit() else p for p in name.split(".")]
