"""A GGUF model file's metadata -> an mlx-lm config dict (what config.json would
say): the keys every architecture shares, then the architecture's own (its module
in gguf_arch/), with what cannot be mapped exactly refused by name: other
architectures, per-layer head counts, partial rope (but where the architecture
takes it), rope scaling mlx-lm's model does not apply, ``rope_freqs`` factors
(but llama 3's, which gguf_arch/llama.py reads), expert counts the tensors do not hold.

The file and its typed reads are gguf_file.py's. Mixtures of experts
(moe_config.py): qwen3moe -> qwen3_moe, qwen2moe -> qwen2_moe,
gpt-oss -> gpt_oss, and llama with expert tensors (Mixtral) -> mixtral.

read_model_config reads either kind of base's config: a GGUF file's, or an mlx-lm
directory's config.json."""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import ModelLoadError
from ..adapters.formats.gguf import is_gguf_file
from ..adapters.formats.gguf_names import MOE_MODEL_TYPES
from .gguf_file import GGUFFile, float32_decimal, has_expert_tensors, open_gguf
from .moe_config import moe_config, yarn_scaling


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


def model_config(f: GGUFFile, tensor_names: set[str], vocab_size: int) -> dict:
    """The mlx-lm config dict (config.json) the file's metadata describes."""
    arch = f.arch
    is_moe = arch.model_type in MOE_MODEL_TYPES
    if not is_moe:
        _refuse_experts(f)
    hidden, n_head, head_dim = _attention_shape(f)
    config = {
        "model_type": arch.model_type,
        "architectures": [arch.hf_class],
        "hidden_size": hidden,
        "num_hidden_layers": f.get_int(".block_count"),
        # a mixture of experts without it: its experts' width (llama.cpp's default the other way)
        "intermediate_size": f.get_int(".feed_forward_length", f.get(".expert_feed_forward_length")),
        "num_attention_heads": n_head,
        "num_key_value_heads": f.get_int(".attention.head_count_kv", n_head),
        "head_dim": head_dim,
        "rms_norm_eps": f.get_float(".attention.layer_norm_rms_epsilon", 1e-5),
        "rope_theta": f.get_float(".rope.freq_base", arch.default_rope_theta),
        "max_position_embeddings": f.get_int(".context_length", 4096),
        "vocab_size": vocab_size,
        "tie_word_embeddings": "output.weight" not in tensor_names,
    }
    rope_scaling = _rope_scaling(f, tensor_names)
    if rope_scaling:
        config["rope_scaling"] = rope_scaling
    if is_moe:
        config.update(moe_config(f, config))
    if arch.config is not None:  # the architecture's own keys (gguf_arch/)
        config.update(arch.config(f, config, tensor_names))
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
    hidden, n_head = f.get_int(".embedding_length"), f.get_int(".attention.head_count")
    head_dim = f.get_int(".attention.key_length", hidden // n_head)
    if f.get_int(".attention.value_length", head_dim) != head_dim:
        raise ModelLoadError(f"{f.path}: attention key and value lengths differ; mlx-lm's "
                             f"{model_type} model needs them equal.")
    if not f.arch.partial_rope and f.get_int(".rope.dimension_count", head_dim) != head_dim:
        raise ModelLoadError(
            f"{f.path}: rope covers {f.get('.rope.dimension_count')} of {head_dim} head "
            f"dimensions; mlx-lm's {model_type} model ropes the whole head.")
    if model_type in ("qwen2", "qwen2_moe", "mixtral") and head_dim != hidden // n_head:
        raise ModelLoadError(f"{f.path}: head size {head_dim} is not hidden / heads; mlx-lm's "
                             f"{model_type} model cannot hold it.")
    return hidden, n_head, head_dim


def _rope_scaling(f: GGUFFile, tensor_names: set[str]) -> dict | None:
    if "rope_freqs.weight" in tensor_names and "rope_freqs" not in f.arch.globals:
        raise ModelLoadError(
            f"{f.path} carries rope_freqs.weight (llama 3 style rope frequency factors), which "
            "mola does not apply; serve the model's mlx-lm conversion instead.")
    kind = f.get(".rope.scaling.type", "none")
    factor = float32_decimal(f.get(".rope.scaling.factor", 1.0) or 1.0)
    model_type = f.arch.model_type
    if kind == "none" or (kind == "linear" and factor == 1.0) or kind in f.arch.rope_scalings:
        return None
    if model_type in ("mixtral", "qwen2_moe", "qwen3_moe"):  # their nn.RoPE takes no scale
        raise ModelLoadError(f"{f.path} uses rope scaling '{kind}' (factor {factor:g}), which "
                             f"mlx-lm's {model_type} model does not apply.")
    if kind == "linear":
        return {"type": "linear", "factor": factor}
    if kind == "yarn" and model_type == "gpt_oss":
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
