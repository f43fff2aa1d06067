"""Every dense GGUF architecture mola serves (models/gguf_arch/), one test each: the
GGUF twin of a tiny random mlx-lm model, written by gguf-py in llama.cpp's layout
(mola/testing/gguf_model.py, the converter's own steps per family in
mola/testing/gguf_twins/), computes exactly what mlx-lm computes on the directory;
and with two GGUF LoRAs (llama.cpp's names and row order for the architecture) in one
mixed batch with base rows, every row answers what it answers alone, and that is the
greedy answer of plain mlx-lm on the directory with the same LoRA merged into its
weights (checked wherever the reference's top two logits are apart). The checks are
tests/twin_checks.py's."""

from __future__ import annotations

import pytest

from twin_checks import assert_exact, assert_loras_answer_as_merged
from mola.adapters.formats.gguf_names import architecture_for
from mola.testing.gguf_model import save_gguf_model
from mola.testing.gguf_twins import TWINS
from mola.testing.model import TinyModelSpec, make_tiny_model

# llama, qwen2 and qwen3, then every family with a twin writer
MODEL_TYPES = tuple(dict.fromkeys(("llama", "qwen2", "qwen3", *TWINS)))


@pytest.fixture(scope="module", params=MODEL_TYPES)
def family(request, tmp_path_factory):
    """(model_type, mlx-lm directory, its GGUF twin)."""
    model_type = request.param
    root = tmp_path_factory.mktemp(model_type)
    model_dir = make_tiny_model(root / "model", TinyModelSpec(model_type=model_type, norm_noise=0.3))
    return model_type, model_dir, save_gguf_model(root / "twin.gguf", model_dir)


def test_the_twin_computes_exactly_what_mlx_lm_computes(family):
    model_type, model_dir, twin = family
    assert assert_exact(model_dir, twin).config["model_type"] == model_type


def test_gguf_loras_in_a_mixed_batch_answer_as_merged_mlx_lm(family, tmp_path):
    model_type, model_dir, twin = family
    assert_loras_answer_as_merged(model_dir, twin, tmp_path, architecture_for(model_type).name)
