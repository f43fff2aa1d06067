"""granite GGUF bases (models/gguf_arch/granite.py) beyond
tests/test_models_gguf_families.py: llama.cpp's four scales read into mlx-lm's
multipliers, with llama.cpp's defaults where the converter wrote none; q/k/v/o and MLP
biases (the q/k ones in llama.cpp's rope order) computing exactly what mlx-lm computes;
and what mlx-lm's granite cannot follow refused by name."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest
from gguf import GGUFValueType

from twin_checks import assert_exact
from mola.errors import ModelLoadError
from mola.models.loader import load_base_model
from mola.models.metadata import gguf_config
from mola.testing.gguf_model import save_gguf_model
from mola.testing.model import TinyModelSpec, make_tiny_model

SCALES = ("embedding_multiplier", "residual_multiplier", "attention_multiplier", "logits_scaling")


def edit_config(model_dir, drop=(), **changes) -> None:
    config = json.loads((model_dir / "config.json").read_text())
    config.update(changes)
    for key in drop:
        config.pop(key)
    (model_dir / "config.json").write_text(json.dumps(config))


@pytest.fixture(scope="module")
def granite(tmp_path_factory):
    """(mlx-lm directory, its GGUF twin): the twin's tiny granite config."""
    root = tmp_path_factory.mktemp("granite")
    model_dir = make_tiny_model(root / "model", TinyModelSpec(model_type="granite", norm_noise=0.3))
    return model_dir, save_gguf_model(root / "twin.gguf", model_dir)




def test_the_scales_are_read_as_mlx_lm_multipliers(granite):
    config = gguf_config(granite[1])
    assert {k: config[k] for k in SCALES} == {"embedding_multiplier": 12.0, "residual_multiplier": 0.22,
                                              "attention_multiplier": 0.0625, "logits_scaling": 8.0}
    assert config["head_dim"] == 16 and not config["attention_bias"] and not config["mlp_bias"]


def test_scales_the_converter_leaves_out_are_llama_cpps_defaults(granite, tmp_path):
    """Without embedding, residual and attention scales (falsy multipliers are not
    written) llama.cpp scales by 1, 1 and 1 / sqrtf(head size): mlx-lm's granite with
    those multipliers computes what mola's does."""
    from shutil import copytree

    model_dir = copytree(granite[0], tmp_path / "model")
    edit_config(model_dir, embedding_multiplier=0, residual_multiplier=0, attention_multiplier=0)
    twin = save_gguf_model(tmp_path / "twin.gguf", model_dir)
    edit_config(model_dir, embedding_multiplier=1.0, residual_multiplier=1.0, attention_multiplier=0.25)
    config = assert_exact(model_dir, twin).config
    assert {k: config[k] for k in SCALES[:3]} == {"embedding_multiplier": 1.0, "residual_multiplier": 1.0,
                                                  "attention_multiplier": 0.25}
    edit_config(model_dir, logits_scaling=0)  # no logit_scale: llama.cpp refuses the file
    bad = save_gguf_model(tmp_path / "bad.gguf", model_dir)
    with pytest.raises(ModelLoadError, match=r"granite\.logit_scale"):
        load_base_model(str(bad), dtype="float32")


def test_biases_in_llama_cpps_row_order_compute_exactly(granite, tmp_path):
    from shutil import copytree

    model_dir = copytree(granite[0], tmp_path / "model")
    edit_config(model_dir, attention_bias=True, mlp_bias=True)
    weights = mx.load(str(model_dir / "model.safetensors"))
    rng = np.random.default_rng(0)
    for name, w in list(weights.items()):
        if name.endswith("_proj.weight"):
            bias = 0.5 * rng.standard_normal(w.shape[0]).astype(np.float32)
            weights[name.replace(".weight", ".bias")] = mx.array(bias)
    mx.save_safetensors(str(model_dir / "model.safetensors"), weights)
    config = assert_exact(model_dir, save_gguf_model(tmp_path / "twin.gguf", model_dir)).config
    assert config["attention_bias"] and config["mlp_bias"]


@pytest.mark.parametrize("metadata, match", [
    ({"granite.rope.scaling.finetuned": (False, GGUFValueType.BOOL)}, r"rope\.scaling\.finetuned is false"),
    ({"granite.deepstack_mapping": ([-1, 1], GGUFValueType.ARRAY)}, r"granite\.deepstack_mapping"),
    ({"granite.expert_count": (4, GGUFValueType.UINT32)}, r"mixture-of-experts.*granite\.expert_count"),
])
def test_what_mlx_lms_granite_cannot_follow_is_refused(granite, tmp_path, metadata, match):
    bad = save_gguf_model(tmp_path / "bad.gguf", granite[0], metadata=metadata)
    with pytest.raises(ModelLoadError, match=match):
        load_base_model(str(bad), dtype="float32")


def test_a_head_size_other_than_hidden_over_heads_is_refused(granite, tmp_path):
    from shutil import copytree

    model_dir = copytree(granite[0], tmp_path / "model")
    edit_config(model_dir, head_dim=32)
    bad = save_gguf_model(tmp_path / "bad.gguf", model_dir)
    with pytest.raises(ModelLoadError, match=r"granite\.attention\.key_length is 32"):
        load_base_model(str(bad), dtype="float32")
    ok = save_gguf_model(tmp_path / "ok.gguf", granite[0], metadata={
        "granite.rope.scaling.finetuned": (True, GGUFValueType.BOOL),
        "granite.deepstack_mapping": ([-1, -1], GGUFValueType.ARRAY)})
    assert_exact(granite[0], ok)
