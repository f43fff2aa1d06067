"""The mixture-of-experts part of a GGUF model's mlx-lm config (metadata.py):
expert counts checked against the tensors, and each architecture's keys as
llama.cpp reads them (src/models/<arch>.cpp, load_arch_hparams / load_arch_tensors):

    qwen3moe  -> qwen3_moe  expert_feed_forward_length (default feed_forward_length /
                            expert_used_count); routing weights renormalized over the
                            chosen experts (qwen3moe.cpp: build_moe_ffn(..., norm_w = true))
    qwen2moe  -> qwen2_moe  the same, not renormalized (qwen2moe.cpp: norm_w = false), and
                            a shared expert of expert_shared_feed_forward_length (default
                            feed_forward_length) behind a sigmoid gate
    llama     -> mixtral    experts of feed_forward_length (llama: ffn_*_exps
                            {n_embd, n_ff, n_expert}), softmax over the chosen experts
    gpt-oss   -> gpt_oss    experts of expert_feed_forward_length; sliding-window
                            attention on layers il % period < period - 1
                            (hparams.set_swa_pattern, attention.sliding_window_pattern,
                            default 2), one rope base for both kinds of layer

mlx-lm's classes compute the same routing (softmax, top-k, the same renormalization).
Keys llama.cpp reads for these architectures that mlx-lm cannot follow are refused.
"""

from __future__ import annotations

import re

from ..errors import ModelLoadError
from ..adapters.formats.gguf_names import EXPERT_TENSORS
from .gguf_file import GGUFFile, float32_decimal

_EXPERT_NAME = re.compile(r"blk\.\d+\.(ffn_gate_inp|ffn_(?:gate_up|gate|up|down)_exps)\.(weight|bias)")
_PER_EXPERT_NAME = re.compile(r"blk\.\d+\.ffn_(?:gate|up|down)\.\d+\.weight")


def _counted(f: GGUFFile) -> dict[str, tuple[int, list[int]]]:
    """{tensor: (the expert count it holds, its ne)} for the routers and experts."""
    out = {}
    for t in f.reader.tensors:
        m = _EXPERT_NAME.fullmatch(t.name)
        if m:
            ne = [int(n) for n in t.shape]
            # router weight ne [n_embd, E], its bias [E]; experts [in, out, E], biases [out, E]
            out[t.name] = (ne[1] if m.group(1) == "ffn_gate_inp" and m.group(2) == "weight" else ne[-1], ne)
    return out


def expert_counts(f: GGUFFile) -> tuple[int, int]:
    """(experts per layer, experts each token is routed to), checked against the tensors."""
    arch = f.arch.name
    legacy = [t.name for t in f.reader.tensors if _PER_EXPERT_NAME.fullmatch(t.name)]
    if legacy:
        raise ModelLoadError(
            f"{f.path} stores its experts one tensor each ({legacy[0]}, ...), the layout of GGUF "
            "files converted before llama.cpp stacked them (ffn_*_exps); mola reads the stacked "
            "layout only: convert the model again with a current convert_hf_to_gguf.py.")
    counted = _counted(f)
    n_expert = f.get_int(".expert_count", 0)
    if not any(name.split(".")[2] in EXPERT_TENSORS + ("ffn_gate_up_exps",) for name in counted):
        raise ModelLoadError(
            f"{f.path} is a mixture-of-experts model ({arch}.expert_count = {n_expert}) but holds "
            "no expert tensors (blk.N.ffn_{gate,up,down}_exps), which mola needs to map it.")
    if n_expert <= 0:
        raise ModelLoadError(f"{f.path} holds expert tensors but no {arch}.expert_count, which a "
                             f"{arch} mixture of experts needs.")
    for name, (count, ne) in sorted(counted.items()):
        if count != n_expert:
            raise ModelLoadError(
                f"{f.path}: {arch}.expert_count is {n_expert}, but {name} holds {count} experts "
                f"(ne {ne}).")
    n_used = f.get_int(".expert_used_count", 0)
    if not 0 < n_used <= n_expert:
        raise ModelLoadError(f"{f.path}: {arch}.expert_used_count is {n_used}; a token must be "
                             f"routed to between 1 and {n_expert} experts.")
    return n_expert, n_used


def moe_config(f: GGUFFile, config: dict) -> dict:
    """The config keys of ``f``'s mixture of experts, for mlx-lm's f.arch.model_type;
    ``config`` is the dense part (its intermediate_size is feed_forward_length)."""
    n_expert, n_used = expert_counts(f)
    scale = f.get(".expert_weights_scale")
    if scale not in (None, 0.0, 1.0):
        raise ModelLoadError(f"{f.path}: {f.arch.name}.expert_weights_scale is {scale}; mlx-lm's "
                             f"{f.arch.model_type} model does not scale its routing weights.")
    n_ff = config["intermediate_size"]
    model_type = f.arch.model_type
    if model_type in ("qwen3_moe", "qwen2_moe"):
        out = {"num_experts": n_expert, "num_experts_per_tok": n_used,
               "moe_intermediate_size": f.get_int(".expert_feed_forward_length", n_ff // n_used)}
        if model_type == "qwen3_moe":  # every layer a mixture, renormalized (qwen3moe.cpp)
            return {**out, "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True}
        return {**out, "shared_expert_intermediate_size": f.get_int(".expert_shared_feed_forward_length", n_ff)}
    if model_type == "mixtral":
        return {"num_local_experts": n_expert, "num_experts_per_tok": n_used}
    assert model_type == "gpt_oss", model_type
    base, base_swa = f.get(".rope.freq_base"), f.get(".rope.freq_base_swa")
    if base_swa is not None and base_swa != base:
        raise ModelLoadError(f"{f.path}: gpt-oss.rope.freq_base_swa ({base_swa}) differs from "
                             f"rope.freq_base ({base}); mlx-lm's gpt_oss model has one rope base.")
    period = f.get_int(".attention.sliding_window_pattern", 2)
    layers = config["num_hidden_layers"]
    return {"num_local_experts": n_expert, "num_experts_per_tok": n_used,
            "intermediate_size": f.get_int(".expert_feed_forward_length"),
            "sliding_window": f.get_int(".attention.sliding_window"),
            "layer_types": ["sliding_attention" if i % period < period - 1 else "full_attention"
                            for i in range(layers)]}


def yarn_scaling(f: GGUFFile, factor: float) -> dict:
    """mlx-lm's YarnRoPE config for llama.cpp's yarn keys (gguf-py Keys.Rope.SCALING_*).
    Both floor/ceil the correction range and scale q and k by 0.1 * ln(factor) + 1
    (ggml rope_yarn; mlx-lm rope_utils.YarnRoPE with mscale 1, mscale_all_dim 0), so
    a non-default ext_factor, attn_factor or log multiplier is refused."""
    for key, default in ((".rope.scaling.yarn_ext_factor", (-1.0, 1.0)),
                         (".rope.scaling.yarn_attn_factor", (1.0,)),
                         (".rope.scaling.yarn_log_multiplier", (0.0,)),
                         (".rope.scaling.attn_factor", (1.0,))):
        value = f.get(key)
        if value is not None and float32_decimal(value) not in default:
            raise ModelLoadError(f"{f.path}: {f.arch.name}{key} is {float32_decimal(value):g}, which mlx-lm's "
                                 f"{f.arch.model_type} yarn rope does not apply.")
    return {"rope_type": "yarn", "factor": factor,
            "original_max_position_embeddings": f.get_int(".rope.scaling.original_context_length"),
            "beta_fast": f.get_float(".rope.scaling.yarn_beta_fast", 32.0),  # llama.cpp's defaults
            "beta_slow": f.get_float(".rope.scaling.yarn_beta_slow", 1.0)}
