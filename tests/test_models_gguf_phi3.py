"""phi3 GGUF bases (models/gguf_arch/phi3.py) beyond tests/test_models_gguf_families.py:
the config keys read as llama.cpp's Phi3MiniModel writes them (partial rope, LongRoPE
factors and attention factor, the original context), a plain-rope tied model (Phi-4
style: sliding_window 0, no factors) computing exactly what mlx-lm computes, and the
refusals of what mlx-lm's phi3 cannot follow, each by name."""

from __future__ import annotations

import json
import math

import mlx.core as mx
import numpy as np
import pytest
from gguf import GGUFValueType

from twin_checks import assert_exact
from mola.errors import ModelLoadError
from mola.models.loader import load_base_model
from mola.testing.gguf_model import save_gguf_model
from mola.testing.model import TinyModelSpec, make_tiny_model

F32, U32, STR = GGUFValueType.FLOAT32, GGUFValueType.UINT32, GGUFValueType.STRING


@pytest.fixture(scope="module")
def longrope(tmp_path_factory):
    """(mlx-lm directory, its GGUF twin): partial rope and LongRoPE (the twin's tiny config)."""
    root = tmp_path_factory.mktemp("phi3-longrope")
    model_dir = make_tiny_model(root / "model", TinyModelSpec(model_type="phi3", norm_noise=0.3))
    return model_dir, save_gguf_model(root / "twin.gguf", model_dir)


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    """(mlx-lm directory, its GGUF twin): full plain rope, tied embeddings, sliding_window None."""
    root = tmp_path_factory.mktemp("phi3-plain")
    model_dir = make_tiny_model(root / "model", TinyModelSpec(model_type="phi3", norm_noise=0.3, seed=5))
    config = json.loads((model_dir / "config.json").read_text())
    for key in ("rope_scaling", "partial_rotary_factor", "sliding_window"):
        config.pop(key)
    config.update(tie_word_embeddings=True, original_max_position_embeddings=config["max_position_embeddings"])
    (model_dir / "config.json").write_text(json.dumps(config))
    weights = mx.load(str(model_dir / "model.safetensors"))
    weights.pop("lm_head.weight")
    mx.save_safetensors(str(model_dir / "model.safetensors"), weights)
    return model_dir, save_gguf_model(root / "twin.gguf", model_dir)




def test_longrope_and_partial_rope_are_read_as_the_converter_writes_them(longrope):
    model_dir, twin = longrope
    source = json.loads((model_dir / "config.json").read_text())
    config = load_base_model(str(twin), dtype="float32").config
    assert config["partial_rotary_factor"] == 0.75  # rope.dimension_count 12 of 16
    assert config["original_max_position_embeddings"] == 512  # rope.scaling.original_context_length
    assert config["max_position_embeddings"] == 2048
    for key in ("long_factor", "short_factor"):  # the factor tensors, as their decimals
        assert config["rope_scaling"][key] == source["rope_scaling"][key]
    assert config["rope_scaling"]["type"] == "longrope"
    assert "sliding_window" not in config  # llama.cpp and mlx-lm both ignore it


def test_a_plain_tied_phi3_computes_exactly_what_mlx_lm_computes(plain):
    config = assert_exact(*plain).config
    assert config["tie_word_embeddings"] is True
    assert "rope_scaling" not in config and "partial_rotary_factor" not in config


def test_longrope_type_without_a_factor_is_plain_llama_cpp_rope(plain, tmp_path):
    """An older converter's rope.scaling.type = longrope, no factor and no factor tensors:
    llama.cpp ropes plainly (freq_scale 1, attn_factor 1), as mlx-lm does."""
    twin = save_gguf_model(tmp_path / "t.gguf", plain[0], metadata={"phi3.rope.scaling.type": "longrope"})
    assert_exact(plain[0], twin)


def refused(model_dir, path, match: str, **kwargs) -> None:
    twin = save_gguf_model(path, model_dir, **kwargs)
    with pytest.raises(ModelLoadError, match=match):
        load_base_model(str(twin), dtype="float32")


def test_an_attention_factor_other_than_mlx_lms_is_refused(longrope, tmp_path):
    refused(longrope[0], tmp_path / "t.gguf", r"phi3\.rope\.scaling\.attn_factor is 1\.5",
            metadata={"phi3.rope.scaling.attn_factor": (1.5, F32)})
    # the converter's yarn factor (0.1 ln s + 1), which mlx-lm's phi3 does not compute
    yarn = 0.1 * math.log(2048 / 512) + 1.0
    refused(longrope[0], tmp_path / "y.gguf", "attn_factor",
            metadata={"phi3.rope.scaling.attn_factor": (yarn, F32)})


def test_an_attention_factor_without_rope_factors_is_refused(plain, tmp_path):
    refused(plain[0], tmp_path / "t.gguf", r"attn_factor is 1\.2 without rope factors",
            metadata={"phi3.rope.scaling.attn_factor": (1.2, F32)})


def test_one_factor_tensor_without_the_other_is_refused(plain, tmp_path):
    refused(plain[0], tmp_path / "t.gguf", "rope_factors_short.weight without the other",
            extra_tensors={"rope_factors_short.weight": np.ones(8, np.float32)})


def test_factors_of_the_wrong_length_are_refused(plain, tmp_path):
    refused(plain[0], tmp_path / "t.gguf", r"rope_factors_long\.weight is F32 \[3\]",
            extra_tensors={"rope_factors_long.weight": np.ones(3, np.float32),
                           "rope_factors_short.weight": np.ones(3, np.float32)})


@pytest.mark.parametrize("kind, factor, match", [
    ("linear", 2.0, "rope scaling 'linear'"),
    ("longrope", 4.0, "rope scaling 'longrope' with phi3.rope.scaling.factor 4"),
    ("yarn", 4.0, "rope scaling 'yarn'"),
])
def test_rope_scaling_mlx_lms_phi3_cannot_apply_is_refused(plain, tmp_path, kind, factor, match):
    refused(plain[0], tmp_path / "t.gguf", match,
            metadata={"phi3.rope.scaling.type": kind, "phi3.rope.scaling.factor": (factor, F32)})


@pytest.mark.parametrize("n_rot", [7, 20])
def test_a_rope_width_mlx_lm_cannot_express_is_refused(plain, tmp_path, n_rot):
    refused(plain[0], tmp_path / "t.gguf", f"phi3.rope.dimension_count is {n_rot} of 16",
            metadata={"phi3.rope.dimension_count": (n_rot, U32)})


def test_a_head_size_other_than_hidden_over_heads_is_refused(plain, tmp_path):
    refused(plain[0], tmp_path / "t.gguf", r"phi3\.attention\.key_length is 8",
            metadata={"phi3.attention.key_length": (8, U32), "phi3.attention.value_length": (8, U32)})
