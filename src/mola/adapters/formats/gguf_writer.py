"""Write LoRA adapters as llama.cpp GGUF LoRA files (`mola train --out FILE.gguf`,
devtools/convert_mlx_lm_to_gguf.py, tests).

The file is what llama.cpp's convert_lora_to_gguf.py writes for a Hugging Face
PEFT adapter of the same weights: general.architecture, general.type = "adapter",
adapter.type = "lora", adapter.lora.alpha (float32), general.quantization_version;
tensors ``blk.N.<tensor>.weight.lora_a`` (numpy [r, in], ggml ne [in, r]) and
``.lora_b`` (numpy [out, r]); for llama, attn_q / attn_k lora_b rows in llama.cpp's
rope order (``LlamaModel.permute`` with num_attention_heads for q and
num_key_value_heads for k). The experts of a mixture of experts (ModuleLoRA a
[E, in, r], b [E, r, out]) are stacked per expert as the converter stacks them:
``blk.N.ffn_up_exps.weight.lora_a`` numpy [E, r, in] (ne [in, r, E]) and ``.lora_b``
numpy [E, out, r]; their routers and shared experts are plain linears (names in
gguf_names.py). The one deviation: a rank-1 factor stays a matrix (the converter
squeezes it to a vector, which llama.cpp then refuses to load).
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np

from ..weights import LoRAWeights
from .gguf import KEY_ADAPTER_TYPE, KEY_ALORA_TOKENS, KEY_LORA_ALPHA
from .gguf_names import ARCHITECTURES, Architecture, llama_cpp_row_order, tensor_base_name

OUTTYPES = ("f32", "f16", "bf16", "q8_0")


def _alpha_and_factors(weights: LoRAWeights, alpha: float | None) -> tuple[float, dict[str, float]]:
    """adapter.lora.alpha, and for each module the factor its lora_b is multiplied
    by so that llama.cpp's scale (alpha / r, or 1 when alpha is 0) times the
    stored B equals the module's scale times its B."""
    if alpha is None:
        wanted = {path: m.scale * m.rank for path, m in weights.modules.items()}
        values = sorted(set(wanted.values()))
        if len(values) > 1 and not np.allclose(values, values[0], rtol=1e-6, atol=0):
            raise ValueError(
                "the modules' scale * rank differ, so no single adapter.lora.alpha gives each "
                "its scale; pass alpha= to fold the differences into lora_b"
            )
        alpha = values[0] if values else 0.0
        if alpha == 0:
            raise ValueError("scale 0 cannot be stored: llama.cpp reads adapter.lora.alpha 0 as scale 1")
    factors = {}
    for path, m in weights.modules.items():
        stored_scale = alpha / m.rank if alpha else 1.0
        factors[path] = m.scale / stored_scale
    return float(alpha), factors


def _encode(data: np.ndarray, outtype: str):
    """(array, GGMLQuantizationType) as the converter stores it; q8_0 falls back
    to f16 for rows that are not a multiple of its block, as the converter does."""
    from gguf import GGMLQuantizationType, QuantError, quants

    qtype = {
        "f32": GGMLQuantizationType.F32,
        "f16": GGMLQuantizationType.F16,
        "bf16": GGMLQuantizationType.BF16,
        "q8_0": GGMLQuantizationType.Q8_0,
    }[outtype]
    try:
        return quants.quantize(data, qtype), qtype
    except QuantError:
        return quants.quantize(data, GGMLQuantizationType.F16), GGMLQuantizationType.F16


def save_gguf_adapter(
    path: str | Path,
    weights: LoRAWeights,
    *,
    architecture: str = "llama",
    alpha: float | None = None,
    n_head: int | None = None,
    n_kv_head: int | None = None,
    dtype: str = "f32",
    name: str | None = None,
    base_model: str | None = None,
) -> Path:
    """Write ``weights`` as a llama.cpp GGUF LoRA file at ``path``.

    ``alpha`` defaults to scale * rank (mola's scale is alpha / rank in llama.cpp);
    ``n_head`` / ``n_kv_head`` (the base's num_attention_heads / num_key_value_heads)
    are needed for a llama adapter on q_proj / k_proj; ``dtype`` is the converter's
    --outtype: f32, f16, bf16 or q8_0; ``base_model`` (a name or hub id) is
    written as general.base_model.0.name, as the converter writes the base's.
    """
    path = Path(path)
    if weights.magnitudes:
        raise ValueError(f"{weights.source} is a DoRA adapter; llama.cpp's GGUF LoRA has no DoRA, and writing "
                         "its LoRA alone would drop its magnitudes")
    arch = ARCHITECTURES.get(architecture)
    if arch is None:
        raise ValueError(f"unsupported architecture {architecture!r}; known: {sorted(ARCHITECTURES)}")
    if dtype not in OUTTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}; known: {OUTTYPES}")
    alpha, factors = _alpha_and_factors(weights, alpha)
    heads = {"attn_q": n_head, "attn_k": n_kv_head if n_kv_head is not None else n_head}
    tensors = _tensors(weights, factors, arch, heads)
    path.parent.mkdir(parents=True, exist_ok=True)
    _write(path, arch.name, tensors, alpha, dtype, name or path.stem, base_model, weights.invocation_tokens)
    return path


def _tensors(weights: LoRAWeights, factors: dict[str, float], arch: Architecture,
             heads: dict[str, int | None]) -> list[tuple[str, np.ndarray]]:
    """(llama.cpp tensor name, float32 array as stored) of every factor: lora_a
    [r, in] and lora_b [out, r] (experts [E, r, in] and [E, out, r]), lora_b
    times its module's factor and, for llama's q / k, in llama.cpp's row order."""
    tensors = []
    for module in sorted(weights.modules, key=lambda p: [int(s) if s.isdigit() else s for s in p.split(".")]):
        base = tensor_base_name(module, moe=True)
        if base is None:
            raise ValueError(f"{module} has no llama.cpp tensor name")
        m = weights.modules[module]
        a = np.array(m.a.astype(mx.float32)).swapaxes(-1, -2)  # [r, in] or [E, r, in]
        b = np.array(m.b.astype(mx.float32)).swapaxes(-1, -2)  # [out, r] or [E, out, r]
        if factors[module] != 1.0:
            b = b * np.float32(factors[module])
        kind = base.split(".")[2]
        if arch.permutes_qk and kind in ("attn_q", "attn_k"):
            if heads[kind] is None:
                raise ValueError(f"a {arch.name} adapter on {module} needs n_head / n_kv_head")
            b = llama_cpp_row_order(b, heads[kind])
        tensors.append((f"{base}.lora_a", np.ascontiguousarray(a, dtype=np.float32)))
        tensors.append((f"{base}.lora_b", np.ascontiguousarray(b, dtype=np.float32)))
    return tensors


def _write(path: Path, arch_name: str, tensors: list[tuple[str, np.ndarray]], alpha: float, dtype: str,
           name: str, base_model: str | None, invocation: tuple[int, ...] | None = None) -> None:
    """The GGUF file: its tensors (encoded as ``dtype``) and its adapter metadata
    (an activated LoRA's ``invocation`` as llama.cpp's convert_lora_to_gguf.py writes it)."""
    from gguf import GGML_QUANT_VERSION, GGUFWriter

    writer = GGUFWriter(str(path), arch_name)  # writes general.architecture
    for tensor_name, data in tensors:
        encoded, qtype = _encode(data, dtype)
        writer.add_tensor(tensor_name, encoded, raw_dtype=qtype)
    writer.add_type("adapter")
    writer.add_string(KEY_ADAPTER_TYPE, "lora")
    writer.add_name(name)
    if base_model:
        writer.add_base_model_count(1)
        writer.add_base_model_name(0, base_model)
    writer.add_float32(KEY_LORA_ALPHA, alpha)
    if invocation is not None:
        writer.add_array(KEY_ALORA_TOKENS, list(invocation))
    writer.add_quantization_version(GGML_QUANT_VERSION)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
