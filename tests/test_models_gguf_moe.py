"""GGUF mixture-of-experts base models (mola/models/gguf.py, moe_config.py): the GGUF
twin of a tiny random mlx-lm MoE (written by gguf-py in llama.cpp's layout, its names
from gguf-py's own TensorNameMap) computes exactly what mlx-lm computes on the
directory, for qwen3moe, llama with experts (Mixtral), qwen2moe and gpt-oss; quantized
experts hold gguf-py's dequantization; what cannot be mapped is refused by name."""

from __future__ import annotations

import json
import shutil

import mlx.core as mx
import numpy as np
import pytest
from gguf import GGUFReader, GGUFValueType, quants

from mola.blas import blas_in_use
from mola.errors import ModelLoadError
from mola.models.loader import load_base_model
from mola.testing.gguf_model import save_gguf_model
from mola.testing.model import TinyModelSpec, make_tiny_model

TOKENS = mx.array([[1, 17, 300, 45, 2, 99, 7, 256, 12, 5, 64]])
MOE_TYPES = ("qwen3_moe", "mixtral", "qwen2_moe", "gpt_oss")
U32, F32 = GGUFValueType.UINT32, GGUFValueType.FLOAT32
# gpt-oss as released: yarn rope (its own factors) and sliding-window layers; a window
# shorter than TOKENS so that the sliding layers' masks differ from the full ones
GPT_OSS_CONFIG = {"sliding_window": 4, "rope_scaling": {
    "rope_type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096,
    "beta_fast": 32.0, "beta_slow": 1.0}}


def edit_config(model_dir, **changes):
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, **changes}))
    return model_dir


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """model_type -> its tiny mlx-lm directory."""
    root = tmp_path_factory.mktemp("moe")
    out = {t: make_tiny_model(root / t, TinyModelSpec(model_type=t, norm_noise=0.3)) for t in MOE_TYPES}
    edit_config(out["gpt_oss"], **GPT_OSS_CONFIG)
    return out


@pytest.mark.parametrize("model_type", MOE_TYPES)
def test_the_gguf_twin_computes_exactly_what_mlx_lm_computes(model_type, models, tmp_path):
    from mlx_lm import load

    gguf = save_gguf_model(tmp_path / "twin.gguf", models[model_type])
    ref, _ = load(str(models[model_type]))
    got = load_base_model(str(gguf), dtype="float32")
    assert got.config["model_type"] == model_type
    np.testing.assert_array_equal(np.array(got.model(TOKENS)), np.array(ref(TOKENS)))
    for key in ("num_experts", "num_local_experts", "num_experts_per_tok", "moe_intermediate_size",
                "shared_expert_intermediate_size", "intermediate_size", "sliding_window", "layer_types"):
        if key in ref.args.__dict__:
            assert got.config[key] == ref.args.__dict__[key], key


def dequantized(path, name) -> np.ndarray:
    tensor = next(t for t in GGUFReader(str(path)).tensors if t.name == name)
    return quants.dequantize(tensor.data, tensor.tensor_type)


def test_quantized_experts_kept_and_dequantized(models, tmp_path):
    """Q8_0 experts stay quantized (QuantizedSwitchLinear) under --dtype keep and compute
    what the float32 load computes (bit for bit on the reference BLAS, to the last bits on
    OpenBLAS), whose experts are gguf-py's dequantization."""
    path = save_gguf_model(tmp_path / "q8.gguf", models["qwen3_moe"], "Q8_0")
    kept, full = (load_base_model(str(path), dtype=d) for d in ("keep", "float32"))
    experts = kept.model.model.layers[1].mlp.switch_mlp
    assert type(experts.gate_proj).__name__ == "QuantizedSwitchLinear" and experts.gate_proj.bits == 8
    assert kept.config["quantization"]["model.layers.1.mlp.switch_mlp.down_proj"] == {"group_size": 32, "bits": 8}
    if blas_in_use() == "reference":  # the float experts' products round as the quantized kernel's do
        np.testing.assert_array_equal(np.array(kept.model(TOKENS)), np.array(full.model(TOKENS)))
    else:  # OpenBLAS picks its kernels by shape: the last bits may differ
        np.testing.assert_allclose(np.array(kept.model(TOKENS)), np.array(full.model(TOKENS)), rtol=0, atol=1e-4)
    got = np.array(full.model.model.layers[1].mlp.switch_mlp.down_proj.weight)  # [E, out, in]
    np.testing.assert_array_equal(got, dequantized(path, "blk.1.ffn_down_exps.weight"))


def test_mxfp4_experts_as_gpt_oss_ships_them(models, tmp_path):
    """gpt-oss's experts in MXFP4 are gguf-py's dequantization, and the model computes
    what mlx-lm's gpt_oss computes with those expert weights."""
    from mlx_lm import load

    path = save_gguf_model(tmp_path / "mxfp4.gguf", models["gpt_oss"], "F32",
                           codecs={f"blk.{i}.ffn_{p}_exps.weight": "MXFP4" for i in range(2)
                                   for p in ("gate", "up", "down")})
    got = load_base_model(str(path), dtype="float32")
    ref, _ = load(str(models["gpt_oss"]))
    swapped = []
    for i in range(2):
        for p in ("gate", "up", "down"):
            w = dequantized(path, f"blk.{i}.ffn_{p}_exps.weight")  # [E, out, in]
            np.testing.assert_array_equal(np.array(getattr(got.model.model.layers[i].mlp.experts, f"{p}_proj").weight), w)
            swapped.append((f"model.layers.{i}.mlp.experts.{p}_proj.weight", mx.array(w)))
    ref.load_weights(swapped, strict=False)
    np.testing.assert_array_equal(np.array(got.model(TOKENS)), np.array(ref(TOKENS)))


def test_an_unknown_moe_architecture_is_refused_by_name(models, tmp_path):
    path = save_gguf_model(tmp_path / "ds.gguf", models["qwen3_moe"], architecture="deepseek2")
    with pytest.raises(ModelLoadError, match=r"architecture 'deepseek2'.*supported: .*qwen3moe.*gpt-oss"):
        load_base_model(str(path))
    path = save_gguf_model(tmp_path / "dense.gguf", models["qwen3_moe"], architecture="qwen3")
    with pytest.raises(ModelLoadError, match=r"mixture-of-experts .*qwen3 is a dense architecture"):
        load_base_model(str(path))


def copy_with(models, tmp_path, model_type, **config):
    return edit_config(shutil.copytree(models[model_type], tmp_path / f"{model_type}-edited"), **config)


@pytest.mark.parametrize("model_type, config, kwargs, match", [
    ("qwen3_moe", dict(num_experts=4), {}, r"qwen3moe\.expert_count is 4, but blk\.0\.ffn_down_exps\.weight holds 8"),
    ("mixtral", dict(num_local_experts=16), {}, r"llama\.expert_count is 16, but .* holds 8 experts"),
    ("qwen2_moe", dict(num_experts_per_tok=9), {}, r"expert_used_count is 9; .*between 1 and 8"),
    ("mixtral", {}, dict(extra_tensors={"blk.0.ffn_gate.0.weight": np.ones((128, 64))}),
     r"one tensor each \(blk\.0\.ffn_gate\.0\.weight"),
    ("gpt_oss", {}, dict(extra_tensors={"blk.0.ffn_gate_up_exps.weight": np.ones((8, 256, 64))}),
     r"'blk\.0\.ffn_gate_up_exps\.weight', which has no place in mlx-lm's gpt_oss"),
    ("qwen3_moe", {}, dict(metadata={"qwen3moe.rope.scaling.type": "linear",
                                     "qwen3moe.rope.scaling.factor": (2.0, F32)}),
     r"rope scaling 'linear' .*qwen3_moe model does not apply"),
    ("gpt_oss", {}, dict(metadata={"gpt-oss.rope.scaling.yarn_attn_factor": (0.5, F32)}),
     r"yarn_attn_factor is 0\.5"),
    ("gpt_oss", {}, dict(metadata={"gpt-oss.rope.freq_base_swa": (500.0, F32)}), r"freq_base_swa \(500"),
    ("mixtral", {}, dict(metadata={"llama.expert_weights_scale": (2.5, F32)}), r"expert_weights_scale is 2\.5"),
], ids=["count-vs-tensors", "mixtral-count", "used-count", "per-expert-tensors", "fused-gate-up",
        "rope-scaling", "yarn-attn-factor", "swa-rope-base", "weights-scale"])
def test_what_cannot_be_mapped_exactly_is_refused_by_name(models, tmp_path, model_type, config, kwargs, match):
    model_dir = copy_with(models, tmp_path, model_type, **config) if config else models[model_type]
    path = save_gguf_model(tmp_path / "bad.gguf", model_dir, **kwargs)
    with pytest.raises(ModelLoadError, match=match):
        load_base_model(str(path), dtype="float32")


def test_an_expert_count_without_expert_tensors_is_refused(tmp_path):
    dense = make_tiny_model(tmp_path / "llama", TinyModelSpec())
    path = save_gguf_model(tmp_path / "bad.gguf", dense, metadata={"llama.expert_count": (8, U32)})
    with pytest.raises(ModelLoadError, match=r"mixture-of-experts .*expert_count = 8.*no expert tensors"):
        load_base_model(str(path))
