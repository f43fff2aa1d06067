"""command-r (mlx-lm cohere) and cohere2 GGUF bases (models/gguf_arch/cohere.py)
beyond tests/test_models_gguf_families.py: Command R+'s per-head q/k norms computing
exactly what mlx-lm computes, the keys read as llama.cpp reads them (logit scale,
layer norm epsilon, cohere2's layer pattern with its default of 4 that the converter
leaves implied), and the refusals of what mlx-lm's models cannot follow, by name."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest
from gguf import GGUFValueType

from twin_checks import assert_exact
from mola.errors import ModelLoadError
from mola.models.loader import load_base_model
from mola.testing.gguf_model import save_gguf_model
from mola.testing.model import TinyModelSpec, make_tiny_model

F32, U32, ARRAY = GGUFValueType.FLOAT32, GGUFValueType.UINT32, GGUFValueType.ARRAY


def edit_config(model_dir, **changes) -> None:
    config = json.loads((model_dir / "config.json").read_text())
    config.update(changes)
    (model_dir / "config.json").write_text(json.dumps(config))


@pytest.fixture(scope="module")
def command_r(tmp_path_factory):
    """(mlx-lm directory, its GGUF twin): the twin's tiny cohere config."""
    root = tmp_path_factory.mktemp("cohere")
    model_dir = make_tiny_model(root / "model", TinyModelSpec(model_type="cohere", norm_noise=0.3))
    return model_dir, save_gguf_model(root / "twin.gguf", model_dir)


@pytest.fixture(scope="module")
def command_r_plus(tmp_path_factory):
    """(mlx-lm directory, its GGUF twin) with use_qk_norm and random per-head q/k norms
    (make_tiny_model leaves LayerNorm2D's weights at zero)."""
    root = tmp_path_factory.mktemp("cohere-qk")
    spec = TinyModelSpec(model_type="cohere", norm_noise=0.3, seed=3)
    model_dir = make_tiny_model(root / "model", spec)
    edit_config(model_dir, use_qk_norm=True)
    weights = mx.load(str(model_dir / "model.safetensors"))
    head_dim = spec.hidden_size // spec.num_attention_heads
    rng = np.random.default_rng(0)
    for layer in range(spec.num_hidden_layers):
        for name, heads in (("q_norm", spec.num_attention_heads), ("k_norm", spec.num_key_value_heads)):
            value = 1 + 0.5 * rng.standard_normal((heads, head_dim))
            weights[f"model.layers.{layer}.self_attn.{name}.weight"] = mx.array(value.astype(np.float32))
    mx.save_safetensors(str(model_dir / "model.safetensors"), weights)
    return model_dir, save_gguf_model(root / "twin.gguf", model_dir)


@pytest.fixture(scope="module")
def cohere2(tmp_path_factory):
    """(mlx-lm directory, its GGUF twin): 4 layers at Command R7B's period 4, which
    Cohere2Model writes no key for."""
    root = tmp_path_factory.mktemp("cohere2")
    model_dir = make_tiny_model(root / "model", TinyModelSpec(model_type="cohere2", num_hidden_layers=4,
                                                               norm_noise=0.3))
    edit_config(model_dir, sliding_window_pattern=4)
    return model_dir, save_gguf_model(root / "twin.gguf", model_dir)




def refused(model_dir, path, match: str, **kwargs) -> None:
    twin = save_gguf_model(path, model_dir, **kwargs)
    with pytest.raises(ModelLoadError, match=match):
        load_base_model(str(twin), dtype="float32")


def test_command_r_keys_are_read_as_llama_cpp_reads_them(command_r, tmp_path):
    config = load_base_model(str(command_r[1]), dtype="float32").config
    assert (config["logit_scale"], config["layer_norm_eps"], config["use_qk_norm"]) == (0.375, 2e-5, False)
    # llama.cpp scales the logits only by a non-zero command-r.logit_scale
    twin = save_gguf_model(tmp_path / "t.gguf", command_r[0], metadata={"command-r.logit_scale": (0.0, F32)})
    assert load_base_model(str(twin), dtype="float32").config["logit_scale"] == 1.0


def test_command_r_plus_q_k_norms_compute_exactly_what_mlx_lm_computes(command_r_plus):
    assert assert_exact(*command_r_plus).config["use_qk_norm"] is True


def test_cohere2_default_period_computes_exactly_what_mlx_lm_computes(cohere2):
    config = assert_exact(*cohere2).config
    assert (config["sliding_window"], config["sliding_window_pattern"]) == (5, 4)
    assert (config["logit_scale"], config["layer_norm_eps"], config["head_dim"]) == (0.3125, 2e-5, 16)


@pytest.mark.parametrize("pattern, period", [
    ((2, U32), 2), (([True, False, True, False], ARRAY), 2), (([True, True, True, False], ARRAY), 4),
    ((1, U32), 1), (([False] * 4, ARRAY), 1), (([True, True, False, True], ARRAY), 3),
])
def test_cohere2_layer_patterns_become_mlx_lms_period(cohere2, tmp_path, pattern, period):
    twin = save_gguf_model(tmp_path / "t.gguf", cohere2[0],
                           metadata={"cohere2.attention.sliding_window_pattern": pattern})
    assert load_base_model(str(twin), dtype="float32").config["sliding_window_pattern"] == period


@pytest.mark.parametrize("pattern", [(0, U32), (8, U32), ([True, False, False, True], ARRAY)])
def test_cohere2_patterns_no_period_can_say_are_refused(cohere2, tmp_path, pattern):
    refused(cohere2[0], tmp_path / "t.gguf", "cohere2.attention.sliding_window_pattern",
            metadata={"cohere2.attention.sliding_window_pattern": pattern})


def test_cohere2_ropes_with_freq_base_as_llama_cpp_does(cohere2, tmp_path):
    """cohere2.cpp ropes the sliding layers with rope.freq_base; freq_base_swa goes unused."""
    twin = save_gguf_model(tmp_path / "t.gguf", cohere2[0], metadata={"cohere2.rope.freq_base_swa": (500.0, F32)})
    assert load_base_model(str(twin), dtype="float32").config["rope_theta"] == 10000.0


@pytest.mark.parametrize("fixture", ["command_r", "cohere2"])
def test_an_untied_output_is_refused(request, tmp_path, fixture):
    model_dir = request.getfixturevalue(fixture)[0]
    refused(model_dir, tmp_path / "t.gguf", "holds output.weight",
            extra_tensors={"output.weight": np.zeros((512, 64), np.float32)})


@pytest.mark.parametrize("fixture", ["command_r", "cohere2"])
def test_rope_scaling_is_refused(request, tmp_path, fixture):
    model_dir = request.getfixturevalue(fixture)[0]
    arch = "command-r" if fixture == "command_r" else "cohere2"
    refused(model_dir, tmp_path / "t.gguf", "rope scaling",
            metadata={f"{arch}.rope.scaling.type": "linear", f"{arch}.rope.scaling.factor": (2.0, F32)})


def test_a_head_size_other_than_hidden_over_heads_is_refused(command_r, tmp_path):
    refused(command_r[0], tmp_path / "t.gguf", r"command-r\.attention\.key_length is 8",
            metadata={f"command-r.{key}": (8, U32) for key in (
                "attention.key_length", "attention.value_length", "rope.dimension_count")})


def test_q_norms_without_k_norms_are_refused(command_r, tmp_path):
    refused(command_r[0], tmp_path / "t.gguf", "q norms without k norms",
            extra_tensors={f"blk.{i}.attn_q_norm.weight": np.ones((4, 16), np.float32) for i in range(2)})


def test_q_k_norms_in_cohere2_are_refused(cohere2, tmp_path):
    refused(cohere2[0], tmp_path / "t.gguf", "blk.0.attn_q_norm.weight",
            extra_tensors={"blk.0.attn_q_norm.weight": np.ones((4, 16), np.float32)})


def test_a_missing_layer_norm_epsilon_is_refused(tmp_path):
    model_dir = make_tiny_model(tmp_path / "model", TinyModelSpec(model_type="cohere"))
    config = json.loads((model_dir / "config.json").read_text())
    del config["layer_norm_eps"]
    (model_dir / "config.json").write_text(json.dumps(config))
    refused(model_dir, tmp_path / "t.gguf", "command-r.attention.layer_norm_epsilon")
