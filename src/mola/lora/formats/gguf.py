"""llama.cpp GGUF LoRA adapters (what llama.cpp's convert_lora_to_gguf.py writes):

    general.type = "adapter", adapter.type = "lora", adapter.lora.alpha (float32),
    general.architecture = "llama" | "qwen2" | "qwen3"
    blk.3.attn_q.weight.lora_a   ne = [in, r]    (numpy, as GGUFReader gives it: [r, in])
    blk.3.attn_q.weight.lora_b   ne = [r, out]   (numpy: [out, r])

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
import re
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np

from ...errors import InvalidAdapter
from ..weights import LoRAWeights, ModuleLoRA

GGUF_MAGIC = b"GGUF"

KEY_GENERAL_TYPE = "general.type"
KEY_ARCHITECTURE = "general.architecture"
KEY_ADAPTER_TYPE = "adapter.type"
KEY_LORA_ALPHA = "adapter.lora.alpha"
KEY_ALORA_TOKENS = "adapter.alora.invocation_tokens"

# llama.cpp's per-block tensor -> the mlx-lm module under model.layers.N
BLOCK_TENSORS = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
MODULE_TENSORS = {module: tensor for tensor, module in BLOCK_TENSORS.items()}

_TENSOR_NAME = re.compile(r"blk\.(\d+)\.([a-z_]+)\.weight")
_MODULE_PATH = re.compile(r"model\.layers\.(\d+)\.(self_attn\.[a-z_]+|mlp\.[a-z_]+)")


@dataclass(frozen=True)
class Architecture:
    name: str  # general.architecture
    model_types: frozenset[str]  # mlx-lm model types of bases it fits
    permutes_qk: bool  # llama.cpp reorders q/k rows (and so LoRA B rows) for its rope


ARCHITECTURES = {
    "llama": Architecture("llama", frozenset({"llama", "mistral"}), True),
    "qwen2": Architecture("qwen2", frozenset({"qwen2"}), False),
    "qwen3": Architecture("qwen3", frozenset({"qwen3"}), False),
}


def architecture_for(model_type: str | None) -> Architecture | None:
    """The GGUF LoRA architecture of a base of mlx-lm type ``model_type``, if mola knows one."""
    return next((arch for arch in ARCHITECTURES.values() if model_type in arch.model_types), None)


def is_gguf_file(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(4) == GGUF_MAGIC
    except OSError:
        return False


# ---- names and the q/k row order, shared with the writer (gguf_writer.py) -----


def module_path(tensor_base: str) -> str | None:
    """``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj`` (None if unmappable)."""
    m = _TENSOR_NAME.fullmatch(tensor_base)
    if not m or m.group(2) not in BLOCK_TENSORS:
        return None
    return f"model.layers.{int(m.group(1))}.{BLOCK_TENSORS[m.group(2)]}"


def tensor_base_name(path: str) -> str | None:
    """``model.layers.3.self_attn.q_proj`` -> ``blk.3.attn_q.weight`` (None if unmappable)."""
    m = _MODULE_PATH.fullmatch(path)
    if not m or m.group(2) not in MODULE_TENSORS:
        return None
    return f"blk.{int(m.group(1))}.{MODULE_TENSORS[m.group(2)]}.weight"


def llama_cpp_row_order(rows: np.ndarray, n_heads: int) -> np.ndarray:
    """Reorder the rows of a q/k projection (or its LoRA B, [out, r]) from Hugging
    Face's order to llama.cpp's: within each head of d rows, row s * d/2 + t moves
    to 2 * t + s (the two rotated halves become interleaved pairs)."""
    out = rows.shape[0]
    d = out // n_heads
    return rows.reshape(n_heads, 2, d // 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def hf_row_order(rows: np.ndarray, n_heads: int) -> np.ndarray:
    """The inverse of :func:`llama_cpp_row_order`."""
    out = rows.shape[0]
    d = out // n_heads
    return rows.reshape(n_heads, d // 2, 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


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
    from gguf import GGUFReader, GGUFValueType

    try:
        reader = GGUFReader(str(path))
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


def _tensor_array(tensor, where: str) -> tuple[np.ndarray, bool]:
    """The tensor as a 2-D numpy array in GGUFReader's (reversed) order, and
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
    while len(ne) > 2 and ne[-1] == 1:
        ne.pop()
    if len(ne) == 1:  # a vector is a matrix with ne[1] == 1, as in ggml
        ne.append(1)
    if len(ne) != 2:
        raise InvalidAdapter(
            f"{where}: tensor '{tensor.name}' has {len(ne)} dimensions (ne {ne}); "
            "LoRA factors must be matrices."
        )
    return data.reshape(ne[1], ne[0]), kind == GGMLQuantizationType.BF16


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
    config.json (it supplies ``model_type`` when that is not given, and the head
    counts needed to put llama's q/k LoRA rows back in Hugging Face's order).
    Shapes are checked against the model later, by :func:`mola.lora.weights.validate`.
    ``rows_as_stored`` leaves llama's q/k rows in llama.cpp's order (shapes and
    scales are the same), to describe an adapter without its base.
    """
    from gguf import GGUFReader

    path = Path(path)
    where = str(path)
    try:
        reader = GGUFReader(str(path))
    except Exception as e:  # truncated or corrupt: numpy/struct/value errors
        raise InvalidAdapter(f"{path} is not a readable GGUF file: {e}") from None
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
    if KEY_ALORA_TOKENS in reader.fields:
        raise InvalidAdapter(
            f"{path} is an activated LoRA (it has {KEY_ALORA_TOKENS}): it applies only after "
            "its invocation tokens, which mola does not implement; it is not served as a plain LoRA."
        )

    arch_name = _field_value(reader, KEY_ARCHITECTURE)
    arch = ARCHITECTURES.get(arch_name) if isinstance(arch_name, str) else None
    if arch is None:
        raise InvalidAdapter(
            f"{path} is a GGUF LoRA for architecture '{arch_name}', which mola cannot map "
            f"onto mlx-lm modules (supported: {', '.join(ARCHITECTURES)})."
        )
    if model_type is None and model_config:
        model_type = model_config.get("model_type")
    if model_type is not None and model_type not in arch.model_types:
        raise InvalidAdapter(
            f"{path} is a LoRA for a '{arch.name}' model (general.architecture), but the base "
            f"model's type is '{model_type}' (a '{arch.name}' adapter fits "
            f"{', '.join(sorted(arch.model_types))} bases)."
        )

    alpha = _field_value(reader, KEY_LORA_ALPHA)
    if alpha is None:
        alpha = 0.0  # llama.cpp reads a missing alpha as 0, i.e. scale 1
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)):
        raise InvalidAdapter(f"{path}: {KEY_LORA_ALPHA} must be a number, got {alpha!r}.")
    if not math.isfinite(alpha):
        raise InvalidAdapter(f"{path}: {KEY_LORA_ALPHA} is {alpha}.")

    pairs: dict[str, dict[str, object]] = {}
    unmappable, norms = [], []
    for tensor in reader.tensors:
        name = tensor.name
        base, dot, leaf = name.rpartition(".")
        if dot and leaf in ("lora_a", "lora_b"):
            if module_path(base) is None:
                unmappable.append(name)
            else:
                pairs.setdefault(base, {})[leaf] = tensor
        elif name.endswith("_norm.weight"):
            norms.append(name)
        else:
            raise InvalidAdapter(
                f"{path} holds tensor '{name}', which is not a LoRA factor "
                "(expected names ending in .lora_a / .lora_b)."
            )
    if unmappable:
        shown = ", ".join(unmappable[:5]) + (" ..." if len(unmappable) > 5 else "")
        raise InvalidAdapter(
            f"{path} holds LoRA tensors mola cannot map onto the model's linears "
            f"(only blk.N.{{{','.join(BLOCK_TENSORS)}}} are served): {shown}"
        )
    if norms:
        shown = ", ".join(norms[:5]) + (" ..." if len(norms) > 5 else "")
        raise InvalidAdapter(
            f"{path} holds norm weights ({shown}); llama.cpp ignores them, but mola does not "
            "drop part of an adapter silently."
        )

    modules: dict[str, ModuleLoRA] = {}
    n_head = n_kv_head = None
    reorder = arch.permutes_qk and not rows_as_stored
    if reorder and any(b.split(".")[2] in ("attn_q", "attn_k") for b in pairs):
        n_head, n_kv_head = _head_counts(reader, arch.name, model_config)
        if n_head is None:
            raise InvalidAdapter(
                f"{path} is a '{arch.name}' LoRA on attn_q/attn_k, whose lora_b rows llama.cpp "
                "stores in its own rope order; putting them back in the base model's order "
                "needs the base's num_attention_heads / num_key_value_heads, which the adapter "
                "does not store (read it with the base model's config)."
            )
    for base, factors in sorted(pairs.items(), key=lambda kv: _natural(kv[0])):
        if set(factors) != {"lora_a", "lora_b"}:
            missing = ({"lora_a", "lora_b"} - set(factors)).pop()
            raise InvalidAdapter(f"{path}: the LoRA tensor pair for '{base}' has no {missing}.")
        a_np, a_bf16 = _tensor_array(factors["lora_a"], where)  # [r, in]
        b_np, b_bf16 = _tensor_array(factors["lora_b"], where)  # [out, r]
        if a_np.shape[0] != b_np.shape[1]:
            raise InvalidAdapter(
                f"{path}: '{base}' has lora_a of rank {a_np.shape[0]} (ne {list(a_np.shape[::-1])}) "
                f"but lora_b of rank {b_np.shape[1]} (ne {list(b_np.shape[::-1])}); llama.cpp "
                "expects lora_a ne = [in, rank] and lora_b ne = [rank, out]."
            )
        kind = base.split(".")[2]
        if reorder and kind in ("attn_q", "attn_k"):
            heads = n_head if kind == "attn_q" else n_kv_head
            if heads <= 0 or b_np.shape[0] % (2 * heads):
                raise InvalidAdapter(
                    f"{path}: '{base}' lora_b has {b_np.shape[0]} rows, which do not split into "
                    f"{heads} heads of even size; is this the right base model?"
                )
            b_np = hf_row_order(b_np, heads)
        rank = b_np.shape[1]
        scale = float(alpha) / rank if alpha else 1.0
        a = mx.array(np.ascontiguousarray(a_np.T))
        b = mx.array(np.ascontiguousarray(b_np.T))
        if a_bf16:
            a = a.astype(mx.bfloat16)
        if b_bf16:
            b = b.astype(mx.bfloat16)
        if dtype is not None:
            a, b = a.astype(dtype), b.astype(dtype)
        modules[module_path(base)] = ModuleLoRA(a=a, b=b, scale=scale)
    try:
        mx.eval([(m.a, m.b) for m in modules.values()])
    except Exception as e:
        raise InvalidAdapter(f"{path} could not be read: {e}") from None
    return LoRAWeights(source=where, format="gguf", modules=modules)


def _natural(name: str):
    return [int(p) if p.isdigit() else p for p in name.split(".")]
