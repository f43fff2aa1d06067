"""smollm3 GGUF bases (models/gguf_arch/smollm3.py) beyond
tests/test_models_gguf_families.py, whose 2-layer model has no NoPE layer: with 8
layers (NoPE at 3 and 7, llama.cpp's fixed step of 4), the twin computes exactly what
mlx-lm computes and GGUF LoRAs answer as the LoRA merged in plain mlx-lm; a config
whose no_rope_layers differ from every-4th is served as llama.cpp serves its file (the
converter drops them); rope_freqs, which llama.cpp's smollm3 never reads, is refused."""

from __future__ import annotations

import json
from shutil import copytree

import mlx.core as mx
import numpy as np
import pytest

from twin_checks import TOKENS, assert_loras_answer_as_merged
from mola.errors import ModelLoadError
from mola.models.loader import load_base_model
from mola.testing.gguf_model import save_gguf_model
from mola.testing.model import TinyModelSpec, make_tiny_model

EVERY_4TH = [1, 1, 1, 0, 1, 1, 1, 0]


def edit_config(model_dir, **changes) -> None:
    config = json.loads((model_dir / "config.json").read_text())
    config.update(changes)
    (model_dir / "config.json").write_text(json.dumps(config))


@pytest.fixture(scope="module")
def smollm3(tmp_path_factory):
    """(mlx-lm directory of 8 layers, its GGUF twin)."""
    root = tmp_path_factory.mktemp("smollm3")
    spec = TinyModelSpec(model_type="smollm3", num_hidden_layers=8, norm_noise=0.3)
    model_dir = make_tiny_model(root / "model", spec)
    return model_dir, save_gguf_model(root / "twin.gguf", model_dir)


def logits(model) -> np.ndarray:
    return np.array(model(mx.array([TOKENS])))


def test_nope_layers_compute_exactly_what_mlx_lm_computes(smollm3, tmp_path):
    from mlx_lm import load
    from mlx_lm.models.smollm3 import NoPE

    model_dir, twin = smollm3
    got = load_base_model(str(twin), dtype="float32")
    assert got.config["no_rope_layers"] == EVERY_4TH
    assert [isinstance(layer.self_attn.rope, NoPE) for layer in got.model.layers] == [not r for r in EVERY_4TH]
    ref = logits(load(str(model_dir))[0])
    np.testing.assert_array_equal(logits(got.model), ref)
    roped = copytree(model_dir, tmp_path / "roped")  # the NoPE layers show in the logits
    edit_config(roped, no_rope_layers=[1] * 8)
    assert not np.array_equal(logits(load(str(roped))[0]), ref)


def test_other_no_rope_layers_are_served_as_llama_cpp_serves_the_file(smollm3, tmp_path):
    """SmolLM3Model writes no NoPE key and llama.cpp ropes all but every 4th layer: so
    does mola, which is mlx-lm on the directory with every-4th NoPE layers."""
    from mlx_lm import load

    model_dir = copytree(smollm3[0], tmp_path / "model")
    edit_config(model_dir, no_rope_layers=[1, 0, 1, 1, 1, 1, 0, 1])
    got = load_base_model(str(save_gguf_model(tmp_path / "twin.gguf", model_dir)), dtype="float32")
    assert got.config["no_rope_layers"] == EVERY_4TH
    np.testing.assert_array_equal(logits(got.model), logits(load(str(smollm3[0]))[0]))


def test_rope_freqs_is_refused(smollm3, tmp_path):
    bad = save_gguf_model(tmp_path / "bad.gguf", smollm3[0], extra_tensors={"rope_freqs.weight": np.ones(8)})
    with pytest.raises(ModelLoadError, match=r"rope_freqs\.weight"):
        load_base_model(str(bad), dtype="float32")


def test_gguf_loras_in_a_mixed_batch_answer_as_merged_mlx_lm(smollm3, tmp_path):
    assert_loras_answer_as_merged(*smollm3, tmp_path, "smollm3")
