"""A GGUF model file's metadata -> an mlx-lm config dict (what config.json would
say), with what cannot be mapped exactly refused by name: other architectures,
per-layer head counts, partial rope, rope scaling mlx-lm's model does not apply,
llama 3's ``rope_freqs`` factors, expert counts the tensors do not hold.

Mixtures of experts (moe_config.py): qwen3moe -> qwen3_moe, qwen2moe -> qwen2_moe,
gpt-oss -> gpt_oss, and llama with expert tensors (Mixtral) -> mixtral.

read_model_config reads either kind of base's config: a GGUF file's, or an mlx-lm
directory's config.json."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import ModelLoadError
from ..adapters.formats.gguf import is_gguf_file
from ..adapters.formats.gguf_names import MOE_MODEL_TYPES


@dataclass(frozen=True)
class BaseArchitecture:
    name: str  # general.architecture
    model_type: str  # the mlx-lm model module
    hf_class: str  # config.json "architectures", for `mola convert`
    default_rope_theta: float  # llama.cpp's default when the file has none


BASE_ARCHITECTURES = {
    "llama": BaseArchitecture("llama", "llama", "LlamaForCausalLM", 10000.0),
    "qwen2": BaseArchitecture("qwen2", "qwen2", "Qwen2ForCausalLM", 10000.0),
    "qwen3": BaseArchitecture("qwen3", "qwen3", "Qwen3ForCausalLM", 10000.0),
    "qwen2moe": BaseArchitecture("qwen2moe", "qwen2_moe", "Qwen2MoeForCausalLM", 10000.0),
    "qwen3moe": BaseArchitecture("qwen3moe", "qwen3_moe", "Qwen3MoeForCausalLM", 10000.0),
    "gpt-oss": BaseArchitecture("gpt-oss", "gpt_oss", "GptOssForCausalLM", 10000.0),
}
# llama.cpp converts MixtralForCausalLM as "llama" with expert tensors (conversion/llama.py).
MIXTRAL = BaseArchitecture("llama", "mixtral", "MixtralForCausalLM", 10000.0)

def find_gguf(path: Path) -> Path | None:
    """The GGUF model file ``path`` names: the file itself, or the one ``.gguf`` of
    a directory that is not an mlx-lm model directory; None when it is neither."""
    if path.is_file():
        return path if is_gguf_file(path) else None
    if not path.is_dir() or (path / "config.json").is_file():
        return None
    files = sorted(path.glob("*.gguf"))
    if len(files) > 1:
        raise ModelLoadError(
            f"{path} holds {len(files)} .gguf files ({', '.join(f.name for f in files[:4])}); "
            "name the one to serve.")
    return files[0] if files else None


@dataclass
class GGUFFile:
    path: Path
    reader: object  # gguf.GGUFReader
    metadata: dict  # key -> value (strings, numbers, lists)
    arch: BaseArchitecture

    def get(self, key: str, default=None):
        """``{arch}.key`` when it starts with '.', else ``key``."""
        return self.metadata.get(self.arch.name + key if key.startswith(".") else key, default)


def open_gguf(path: Path) -> GGUFFile:
    from gguf import GGUFReader

    try:
        reader = GGUFReader(str(path))
    except Exception as e:  # truncated, corrupt, unknown tensor types
        raise ModelLoadError(f"{path} is not a readable GGUF file: {type(e).__name__}: {e}") from None
    if getattr(reader, "byte_order", "I") != "I":
        raise ModelLoadError(f"{path} is a big-endian GGUF file; mola reads little-endian ones.")
    metadata = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    kind = metadata.get("general.type", "model")
    if kind != "model":
        raise ModelLoadError(
            f"{path} has general.type '{kind}', not 'model'"
            + (" (a LoRA adapter: serve it with --adapter NAME=PATH)" if kind == "adapter" else ""))
    name = metadata.get("general.architecture")
    if name not in BASE_ARCHITECTURES:
        raise ModelLoadError(
            f"{path} is a GGUF model of architecture '{name}', which mola cannot map onto an "
            f"mlx-lm model (supported: {', '.join(BASE_ARCHITECTURES)}; llama with experts as "
            "Mixtral).")
    arch = BASE_ARCHITECTURES[name]
    if name == "llama" and (metadata.get("llama.expert_count") or has_expert_tensors(reader)):
        arch = MIXTRAL
    return GGUFFile(path, reader, metadata, arch)


def has_expert_tensors(reader) -> bool:
    """Whether the file holds a router or expert tensors (blk.N.ffn_gate_inp / ffn_*_exps)."""
    return any(".ffn_gate_inp." in t.name or "_exps." in t.name for t in reader.tensors)


def _int(f: GGUFFile, key: str, default=None) -> int:
    value = f.get(key, default)
    if isinstance(value, list):
        raise ModelLoadError(
            f"{f.path}: {f.arch.name}{key} differs per layer ({value[:4]}...), which mlx-lm's "
            f"{f.arch.model_type} model does not support.")
    if value is None:
        raise ModelLoadError(f"{f.path} has no {f.arch.name}{key}, which a {f.arch.name} model needs.")
    return int(value)


def _float(value) -> float:
    """A float32 metadata value as the decimal it was written from (1e-05, not
    9.999999747378752e-06)."""
    return float(str(np.float32(value)))


def model_config(f: GGUFFile, tensor_names: set[str], vocab_size: int) -> dict:
    """The mlx-lm config dict (config.json) the file's metadata describes."""
    from .moe_config import moe_config

    arch = f.arch
    is_moe = arch.model_type in MOE_MODEL_TYPES
    if not is_moe:
        _refuse_experts(f)
    hidden, n_head, head_dim = _attention_shape(f)
    config = {
        "model_type": arch.model_type,
        "architectures": [arch.hf_class],
        "hidden_size": hidden,
        "num_hidden_layers": _int(f, ".block_count"),
        # a mixture of experts without it: its experts' width (llama.cpp's default the other way)
        "intermediate_size": _int(f, ".feed_forward_length", f.get(".expert_feed_forward_length")),
        "num_attention_heads": n_head,
        "num_key_value_heads": _int(f, ".attention.head_count_kv", n_head),
        "head_dim": head_dim,
        "rms_norm_eps": _float(f.get(".attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": _float(f.get(".rope.freq_base", arch.default_rope_theta)),
        "max_position_embeddings": _int(f, ".context_length", 4096),
        "vocab_size": vocab_size,
        "tie_word_embeddings": "output.weight" not in tensor_names,
    }
    if arch.model_type == "llama":
        config["attention_bias"] = "blk.0.attn_q.bias" in tensor_names
        config["mlp_bias"] = "blk.0.ffn_up.bias" in tensor_names
    rope_scaling = _rope_scaling(f, tensor_names)
    if rope_scaling:
        config["rope_scaling"] = rope_scaling
    if is_moe:
        config.update(moe_config(f, config))
    for key in ("bos_token_id", "eos_token_id"):
        value = f.get(f"tokenizer.ggml.{key}")
        if value is not None:
            config[key] = int(value)
    return config


def _refuse_experts(f: GGUFFile) -> None:
    """A dense architecture's file that holds experts cannot be mapped."""
    if f.get(".expert_count", 0) or has_expert_tensors(f.reader):
        what = (f"{f.arch.name}.expert_count = {f.get('.expert_count')}" if f.get(".expert_count")
                else "it holds expert tensors (blk.N.ffn_gate_inp / ffn_*_exps)")
        raise ModelLoadError(
            f"{f.path} is a mixture-of-experts model ({what}), but llama.cpp's {f.arch.name} is a "
            "dense architecture; mola maps llama.cpp's mixtures of experts for llama (Mixtral), "
            "qwen2moe, qwen3moe and gpt-oss.")


def _attention_shape(f: GGUFFile) -> tuple[int, int, int]:
    """(hidden size, heads, head size), refused where mlx-lm's model cannot hold them."""
    model_type = f.arch.model_type
    hidden, n_head = _int(f, ".embedding_length"), _int(f, ".attention.head_count")
    head_dim = _int(f, ".attention.key_length", hidden // n_head)
    if _int(f, ".attention.value_length", head_dim) != head_dim:
        raise ModelLoadError(f"{f.path}: attention key and value lengths differ; mlx-lm's "
                             f"{model_type} model needs them equal.")
    if _int(f, ".rope.dimension_count", head_dim) != head_dim:
        raise ModelLoadError(
            f"{f.path}: rope covers {f.get('.rope.dimension_count')} of {head_dim} head "
            f"dimensions; mlx-lm's {model_type} model ropes the whole head.")
    if model_type in ("qwen2", "qwen2_moe", "mixtral") and head_dim != hidden // n_head:
        raise ModelLoadError(f"{f.path}: head size {head_dim} is not hidden / heads; mlx-lm's "
                             f"{model_type} model cannot hold it.")
    return hidden, n_head, head_dim


def _rope_scaling(f: GGUFFile, tensor_names: set[str]) -> dict | None:
    if "rope_freqs.weight" in tensor_names:
        raise ModelLoadError(
            f"{f.path} carries rope_freqs.weight (llama 3 style rope frequency factors), which "
            "mola does not apply; serve the model's mlx-lm conversion instead.")
    kind = f.get(".rope.scaling.type", "none")
    factor = _float(f.get(".rope.scaling.factor", 1.0) or 1.0)
    model_type = f.arch.model_type
    if kind == "none" or (kind == "linear" and factor == 1.0):
        return None
    if model_type in ("mixtral", "qwen2_moe", "qwen3_moe"):  # their nn.RoPE takes no scale
        raise ModelLoadError(f"{f.path} uses rope scaling '{kind}' (factor {factor:g}), which "
                             f"mlx-lm's {model_type} model does not apply.")
    if kind == "linear":
        return {"type": "linear", "factor": factor}
    if kind == "yarn" and model_type == "gpt_oss":
        from .moe_config import yarn_scaling

        return yarn_scaling(f, factor)
    raise ModelLoadError(f"{f.path} uses rope scaling '{kind}' (factor {factor:g}), which mola "
                         "does not map onto mlx-lm; only linear scaling (and yarn for gpt-oss) "
                         "is applied.")


def gguf_config(path: Path) -> dict:
    """The mlx-lm config of a GGUF model file, without reading its weights."""
    f = open_gguf(Path(path))
    tensors = {t.name: t for t in f.reader.tensors}
    embed = tensors.get("token_embd.weight")
    if embed is None:
        raise ModelLoadError(f"{path} has no token_embd.weight.")
    return model_config(f, set(tensors), int(embed.shape[-1]))


def read_model_config(path: Path) -> dict:
    """config.json of an mlx-lm model directory, or the config a GGUF model file describes."""
    path = Path(path)
    if path.is_file():
        return gguf_config(path)
    return json.loads((path / "config.json").read_text())
