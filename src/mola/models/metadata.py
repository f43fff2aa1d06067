"""A GGUF model file's metadata -> an mlx-lm config dict (what config.json would
say), with what cannot be mapped exactly refused by name: other architectures,
mixture-of-experts, per-layer head counts, partial rope, rope scaling other than
linear, llama 3's ``rope_freqs`` factors."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import ModelLoadError
from ..lora.formats.gguf import is_gguf_file


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
}

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
            f"mlx-lm model (supported: {', '.join(BASE_ARCHITECTURES)}).")
    return GGUFFile(path, reader, metadata, BASE_ARCHITECTURES[name])


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
    arch = f.arch
    if f.get(".expert_count", 0):
        raise ModelLoadError(
            f"{f.path} is a mixture-of-experts model ({arch.name}.expert_count = "
            f"{f.get('.expert_count')}); mola serves dense {arch.name} GGUF models only.")
    hidden, n_head = _int(f, ".embedding_length"), _int(f, ".attention.head_count")
    head_dim = _int(f, ".attention.key_length", hidden // n_head)
    if _int(f, ".attention.value_length", head_dim) != head_dim:
        raise ModelLoadError(f"{f.path}: attention key and value lengths differ; mlx-lm's "
                             f"{arch.model_type} model needs them equal.")
    if _int(f, ".rope.dimension_count", head_dim) != head_dim:
        raise ModelLoadError(
            f"{f.path}: rope covers {f.get('.rope.dimension_count')} of {head_dim} head "
            f"dimensions; mlx-lm's {arch.model_type} model ropes the whole head.")
    if arch.model_type == "qwen2" and head_dim != hidden // n_head:
        raise ModelLoadError(f"{f.path}: head size {head_dim} is not hidden / heads; mlx-lm's "
                             "qwen2 model cannot hold it.")
    config = {
        "model_type": arch.model_type,
        "architectures": [arch.hf_class],
        "hidden_size": hidden,
        "num_hidden_layers": _int(f, ".block_count"),
        "intermediate_size": _int(f, ".feed_forward_length"),
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
    for key in ("bos_token_id", "eos_token_id"):
        value = f.get(f"tokenizer.ggml.{key}")
        if value is not None:
            config[key] = int(value)
    return config


def _rope_scaling(f: GGUFFile, tensor_names: set[str]) -> dict | None:
    if "rope_freqs.weight" in tensor_names:
        raise ModelLoadError(
            f"{f.path} carries rope_freqs.weight (llama 3 style rope frequency factors), which "
            "mola does not apply; serve the model's mlx-lm conversion instead.")
    kind = f.get(".rope.scaling.type", "none")
    factor = _float(f.get(".rope.scaling.factor", 1.0) or 1.0)
    if kind == "none" or (kind == "linear" and factor == 1.0):
        return None
    if kind == "linear":
        return {"type": "linear", "factor": factor}
    raise ModelLoadError(f"{f.path} uses rope scaling '{kind}' (factor {factor:g}), which mola "
                         "does not map onto mlx-lm; only linear scaling is applied.")


def gguf_config(path: Path) -> dict:
    """The mlx-lm config of a GGUF model file, without reading its weights."""
    f = open_gguf(Path(path))
    tensors = {t.name: t for t in f.reader.tensors}
    embed = tensors.get("token_embd.weight")
    if embed is None:
        raise ModelLoadError(f"{path} has no token_embd.weight.")
    return model_config(f, set(tensors), int(embed.shape[-1]))
