"""olmo2 GGUF bases (models/gguf_arch/olmo2.py) beyond
tests/test_models_gguf_families.py: the twin's tensors are llama.cpp's (no input norms;
post-attention and post-feed-forward norms; q/k norms over the whole projection), tied
embeddings compute exactly what mlx-lm computes too, and OLMo 3's sliding windows and a
tensor with no place in mlx-lm's olmo2 are refused by name."""

from __future__ import annotations

import json
from shutil import copytree

import mlx.core as mx
import numpy as np
import pytest
from gguf import GGUFReader, GGUFValueType

from twin_checks import assert_exact
from mola.errors import ModelLoadError
from mola.models.loader import load_base_model
from mola.testing.gguf_model import save_gguf_model
from mola.testing.model import TinyModelSpec, make_tiny_model


@pytest.fixture(scope="module")
def olmo2(tmp_path_factory):
    """(mlx-lm directory, its GGUF twin)."""
    root = tmp_path_factory.mktemp("olmo2")
    model_dir = make_tiny_model(root / "model", TinyModelSpec(model_type="olmo2", norm_noise=0.3))
    return model_dir, save_gguf_model(root / "twin.gguf", model_dir)




def test_the_block_has_llama_cpps_olmo2_tensors(olmo2):
    shapes = {t.name: tuple(int(n) for n in t.shape) for t in GGUFReader(str(olmo2[1])).tensors
              if t.name.startswith("blk.0.")}
    # ggml's ne: q norm over 4 heads of 16, k norm over 2 kv heads of 16
    assert {k: v for k, v in shapes.items() if "norm" in k} == {
        "blk.0.attn_q_norm.weight": (64,), "blk.0.attn_k_norm.weight": (32,),
        "blk.0.post_attention_norm.weight": (64,), "blk.0.post_ffw_norm.weight": (64,)}


def test_tied_embeddings_compute_exactly_what_mlx_lm_computes(olmo2, tmp_path):
    model_dir = copytree(olmo2[0], tmp_path / "model")
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    weights = mx.load(str(model_dir / "model.safetensors"))
    del weights["lm_head.weight"]
    mx.save_safetensors(str(model_dir / "model.safetensors"), weights)
    twin = save_gguf_model(tmp_path / "twin.gguf", model_dir)
    assert "output.weight" not in {t.name for t in GGUFReader(str(twin)).tensors}
    assert assert_exact(model_dir, twin).config["tie_word_embeddings"]


def test_olmo3_windows_and_unplaced_tensors_are_refused(olmo2, tmp_path):
    windows = save_gguf_model(tmp_path / "olmo3.gguf", olmo2[0], metadata={
        "olmo2.attention.sliding_window": (4096, GGUFValueType.UINT32),
        "olmo2.attention.sliding_window_pattern": ([True, False], GGUFValueType.ARRAY)})
    with pytest.raises(ModelLoadError, match=r"olmo2\.attention\.sliding_window is 4096.*OLMo 3"):
        load_base_model(str(windows), dtype="float32")
    input_norm = save_gguf_model(tmp_path / "norm.gguf", olmo2[0],
                                 extra_tensors={"blk.0.attn_norm.weight": np.ones(64)})
    with pytest.raises(ModelLoadError, match=r"'blk\.0\.attn_norm\.weight'.*no place"):
        load_base_model(str(input_norm), dtype="float32")
    no_window = save_gguf_model(tmp_path / "zero.gguf", olmo2[0], metadata={
        "olmo2.attention.sliding_window": (0, GGUFValueType.UINT32)})  # n_swa 0: no windows
    assert_exact(olmo2[0], no_window)
