"""Write small GGUF model files with gguf-py, for tests: the llama.cpp twin of an
mlx-lm model directory (what llama.cpp's convert_hf_to_gguf.py writes for it), or a
model whose matrices are random valid blocks of a codec gguf-py cannot quantize
(K-quants, IQ4_*), to check how mola reads every codec.

The twin has llama.cpp's tensor names, given by gguf-py's own TensorNameMap (not by
mola's tables, so the loader is checked against llama.cpp's naming) from the Hugging
Face name of each weight, q/k rows in llama.cpp's rope order for ``llama``
(``LlamaModel.permute``), vectors, biases and routers in F32 (as the converter forces
them), and the tokenizer of the directory (byte-level BPE: vocabulary, merges, token
types, special ids, chat template) in the ``tokenizer.ggml.*`` metadata. A mixture of
experts' stacked SwitchLinear weights [E, out, in] are what the converter writes after
stacking the Hugging Face experts (ffn_*_exps, numpy [E, out, in]), with its metadata
(expert counts and widths, gpt-oss's sliding window, yarn rope).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import mlx.core as mx
import numpy as np

from ..adapters.formats.gguf_names import ARCHITECTURES, llama_cpp_row_order
from .gguf_twins import TWINS, Twin

# Byte offsets of the float16 fields of a block (the scales), for random valid blocks.
SCALE_FIELDS = {
    "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,),
    "Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,),
    "IQ4_NL": (0,), "IQ4_XS": (0,), "IQ1_S": (0,), "IQ2_XXS": (0,), "IQ2_XS": (0,), "IQ2_S": (0,),
    "IQ3_XXS": (0,), "IQ3_S": (0,), "IQ1_M": (),  # IQ1_M's scale lives in its sub-block scales' high bits
}
# mlx-lm name -> the Hugging Face name convert_hf_to_gguf.py maps after stacking the
# experts (conversion/llama.py: Mixtral's stack is feed_forward.experts.w1/w2/w3;
# conversion/qwen.py: mlp.experts.{gate,up,down}_proj; gpt-oss's sinks get ".weight")
_HF_NAMES = {
    "mixtral": [(re.compile(r"model\.layers\.(\d+)\.block_sparse_moe\.switch_mlp\.(\w+)_proj\.weight"),
                 lambda m: f"layers.{m[1]}.feed_forward.experts.{dict(gate='w1', down='w2', up='w3')[m[2]]}.weight")],
    "qwen3_moe": [(re.compile(r"(.*)\.mlp\.switch_mlp\.(.*)"), lambda m: f"{m[1]}.mlp.experts.{m[2]}")],
    "qwen2_moe": [(re.compile(r"(.*)\.mlp\.switch_mlp\.(.*)"), lambda m: f"{m[1]}.mlp.experts.{m[2]}")],
    "gpt_oss": [(re.compile(r"(.*\.self_attn\.sinks)"), lambda m: f"{m[1]}.weight")],
}


def gguf_name(name: str, model_type: str = "llama", n_layers: int = 64) -> str:
    """``model.layers.3.self_attn.q_proj.weight`` -> ``blk.3.attn_q.weight``, by gguf-py's
    TensorNameMap for the architecture llama.cpp converts ``model_type`` as."""
    from gguf import MODEL_ARCH_NAMES, get_tensor_name_map

    twin = TWINS.get(model_type)
    if twin is not None and twin.hf_name is not None:
        name = twin.hf_name(name)
    for pattern, to_hf in _HF_NAMES.get(model_type, ()):
        m = pattern.fullmatch(name)
        if m:
            name = to_hf(m)
    arch = next(a for a in ARCHITECTURES.values() if model_type in a.model_types).name
    enum = next(k for k, v in MODEL_ARCH_NAMES.items() if v == arch)
    out = get_tensor_name_map(enum, n_layers).get_name(name, try_suffixes=(".weight", ".bias"))
    if out is None:
        raise ValueError(f"gguf-py has no {arch} tensor name for {name}")
    return out


def _f32(gname: str, data: np.ndarray) -> bool:
    """Whether the converter stores this tensor in F32 whatever the codec: vectors,
    biases, routers (convert_hf_to_gguf.py forces FFN_GATE_INP / _SHEXP to F32)."""
    return data.ndim == 1 or gname.endswith(".bias") or ".ffn_gate_inp" in gname


def random_blocks(codec: str, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Random bytes for a [rows, cols] tensor of ``codec`` whose float16 scale fields
    hold small finite values (uint8 [rows, bytes per row])."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[codec]]
    if cols % block:
        raise ValueError(f"{codec} needs rows of a multiple of {block} values, got {cols}")
    raw = rng.integers(0, 256, size=(rows * cols // block, size), dtype=np.uint8)
    for offset in SCALE_FIELDS[codec]:
        scale = rng.uniform(0.001, 0.02, size=raw.shape[0]).astype(np.float16)
        raw[:, offset:offset + 2] = scale.view(np.uint8).reshape(-1, 2)
    return raw.reshape(rows, -1)


def _encode(data: np.ndarray, codec: str, rng):
    """(bytes or floats, GGMLQuantizationType) of ``data`` [rows, cols] in ``codec``."""
    from gguf import GGMLQuantizationType, quants

    kind = GGMLQuantizationType[codec]
    try:
        return quants.quantize(data, kind), kind
    except NotImplementedError:
        return random_blocks(codec, *data.shape, rng), kind


def _tokenizer(writer, model_dir: Path) -> None:
    tok = json.loads((model_dir / "tokenizer.json").read_text())
    tok_config = json.loads((model_dir / "tokenizer_config.json").read_text())
    vocab = dict(tok["model"]["vocab"])
    specials = {t["content"]: t["id"] for t in tok.get("added_tokens", []) if t.get("special")}
    vocab.update(specials)
    tokens = [None] * (max(vocab.values()) + 1)
    for token, i in vocab.items():
        tokens[i] = token
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in specials else 1 for t in tokens])
    writer.add_token_merges(merges)
    for key, add in (("eos_token", writer.add_eos_token_id), ("pad_token", writer.add_pad_token_id),
                     ("bos_token", writer.add_bos_token_id)):
        if tok_config.get(key) in vocab:
            add(vocab[tok_config[key]])
    writer.add_add_bos_token(False)
    template = tok_config.get("chat_template") or (model_dir / "chat_template.jinja").read_text()
    writer.add_chat_template(template)


def save_gguf_model(path: str | Path, model_dir: str | Path, codec: str = "F32", *,
                    codecs: dict[str, str] | None = None, seed: int = 0,
                    metadata: dict | None = None, extra_tensors: dict[str, np.ndarray] | None = None,
                    architecture: str | None = None) -> Path:
    """Write the GGUF twin of the float mlx-lm model at ``model_dir``: its matrices in
    ``codec`` (``codecs`` overrides per GGUF tensor name, e.g. {"token_embd.weight":
    "Q8_0"}); a codec gguf-py cannot quantize gets random valid blocks instead of the
    model's values. ``metadata``: extra keys, a string or (value, GGUFValueType);
    ``extra_tensors``: more F32 tensors; ``architecture``: general.architecture to
    claim (default: the model's)."""
    from gguf import GGMLQuantizationType, GGUFWriter

    model_dir, path = Path(model_dir), Path(path)
    config = json.loads((model_dir / "config.json").read_text())
    arch = next(a for a in ARCHITECTURES.values() if config["model_type"] in a.model_types)
    n_head, n_kv = config["num_attention_heads"], config.get("num_key_value_heads") or config["num_attention_heads"]
    twin = TWINS.get(config["model_type"], Twin())
    rng = np.random.default_rng(seed)
    writer = GGUFWriter(str(path), architecture or arch.name)
    writer.add_type("model")
    writer.add_name(model_dir.name)
    _hyperparameters(writer, config)
    if twin.hparams is not None:
        twin.hparams(writer, config)
    for key, value in (metadata or {}).items():
        writer.add_key_value(key, value[0], value[1]) if isinstance(value, tuple) else writer.add_string(key, value)
    _tokenizer(writer, model_dir)
    weights = mx.load(str(model_dir / "model.safetensors"))
    for name in sorted(weights):
        data = np.array(weights[name].astype(mx.float32))
        gname = gguf_name(name, config["model_type"], config["num_hidden_layers"])
        if arch.permutes_qk and gname.split(".")[2:3] in (["attn_q"], ["attn_k"]):
            data = llama_cpp_row_order(data, n_head if ".attn_q." in gname else n_kv)
        if twin.tensor is not None:
            data = twin.tensor(gname, data, config)
        if ".ffn_gate_inp_shexp." in gname:
            data = data.reshape(-1)  # llama.cpp declares it {n_embd}
        if _f32(gname, data):
            encoded, kind = data, GGMLQuantizationType.F32
        else:
            encoded, kind = _encode(data, (codecs or {}).get(gname, codec), rng)
        writer.add_tensor(gname, encoded, raw_dtype=kind)
    more = twin.extra_tensors(config) if twin.extra_tensors is not None else {}
    for gname, data in {**more, **(extra_tensors or {})}.items():
        writer.add_tensor(gname, np.asarray(data, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _hyperparameters(writer, config: dict) -> None:
    n_head = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // n_head
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config.get("max_position_embeddings", 2048))
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(n_head)
    writer.add_head_count_kv(config.get("num_key_value_heads") or n_head)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_freq_base(config.get("rope_theta", 10000.0))
    writer.add_vocab_size(config["vocab_size"])
    _moe_hyperparameters(writer, config)


def _moe_hyperparameters(writer, config: dict) -> None:
    """What convert_hf_to_gguf.py's set_gguf_parameters writes for a mixture of experts
    (conversion/base.py TextModel: expert_count from num_local_experts / num_experts,
    expert_used_count from num_experts_per_tok, yarn rope_scaling; qwen.py: expert and
    shared-expert widths; gpt_oss.py: sliding_window, expert width = intermediate_size)."""
    from gguf import RopeScalingType

    n_expert = config.get("num_local_experts") or config.get("num_experts")
    if n_expert:
        writer.add_expert_count(n_expert)
        writer.add_expert_used_count(config["num_experts_per_tok"])
    if config.get("moe_intermediate_size"):
        writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
    if config.get("shared_expert_intermediate_size"):
        writer.add_expert_shared_feed_forward_length(config["shared_expert_intermediate_size"])
    if config["model_type"] == "gpt_oss":
        writer.add_sliding_window(config["sliding_window"])
        writer.add_expert_feed_forward_length(config["intermediate_size"])
    rope = config.get("rope_scaling") or {}
    if (rope.get("rope_type") or rope.get("type")) == "yarn":
        writer.add_rope_scaling_type(RopeScalingType.YARN)
        writer.add_rope_scaling_factor(rope["factor"])
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        for key, add in (("beta_fast", writer.add_rope_scaling_yarn_beta_fast),
                         ("beta_slow", writer.add_rope_scaling_yarn_beta_slow)):
            if key in rope:
                add(rope[key])
