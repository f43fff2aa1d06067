"""`mola convert` (mola/models/convert.py): plain mlx-lm loads what it writes and
computes what mola computes on the GGUF file, kept quantized or dequantized; on the
real model mlx-lm's own generate() gives mola's greedy answer."""

from __future__ import annotations

import json

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten

from mola.cli import main
from mola.errors import ModelLoadError
from mola.models.convert import convert
from mola.models.loader import load_base_model
from mola.testing.gguf_model import save_gguf_model
from mola.testing.model import TinyModelSpec, make_tiny_model

TOKENS = mx.array([[1, 17, 300, 45, 2, 99, 7, 256, 12]])


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    root = tmp_path_factory.mktemp("convert")
    model_dir = make_tiny_model(root / "tiny", TinyModelSpec(norm_noise=0.3))
    return save_gguf_model(root / "tiny-Q4_0.gguf", model_dir, "Q4_0", codecs={"token_embd.weight": "Q8_0"})


@pytest.mark.parametrize("dtype", ["keep", "float32"])
def test_mlx_lm_loads_the_conversion_and_computes_what_mola_computes(dtype, tiny_gguf, tmp_path):
    from mlx_lm import load

    out = tmp_path / "out"
    assert main(["convert", str(tiny_gguf), str(out), "--dtype", dtype]) == 0
    model, tokenizer = load(str(out))
    mola = load_base_model(str(tiny_gguf), dtype=dtype)
    np.testing.assert_array_equal(np.array(model(TOKENS)), np.array(mola.model(TOKENS)))
    quantized = isinstance(model.model.layers[0].self_attn.q_proj, nn.QuantizedLinear)
    assert quantized == (dtype == "keep")
    assert isinstance(model.model.embed_tokens, nn.QuantizedEmbedding) == (dtype == "keep")
    config = json.loads((out / "config.json").read_text())
    assert ("quantization" in config) == (dtype == "keep") and config["rms_norm_eps"] == 1e-5
    text = "hello world 12"
    assert tokenizer.encode(text) == mola.tokenizer.encode(text)
    assert tokenizer.eos_token_ids == mola.tokenizer.eos_token_ids


def test_convert_refuses_what_it_cannot_write(tiny_gguf, tmp_path):
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("keep me")
    with pytest.raises(ModelLoadError, match="--force"):
        convert(tiny_gguf, tmp_path / "full")
    assert (tmp_path / "full" / "x").read_text() == "keep me"
    with pytest.raises(ModelLoadError, match="not a GGUF model"):
        convert(tmp_path / "full" / "x", tmp_path / "out")
    assert main(["convert", str(tmp_path / "absent.gguf"), str(tmp_path / "out")]) == 1
    assert not (tmp_path / "out").exists()
    convert(tiny_gguf, tmp_path / "full", dtype="float16", force=True)
    assert not (tmp_path / "full" / "x").exists() and (tmp_path / "full" / "model.safetensors").is_file()


@pytest.mark.slow
def test_mlx_lm_generate_on_the_converted_real_model(smollm, smollm_gguf, tmp_path):
    from mlx_lm import generate, load
    from mlx_lm.sample_utils import make_sampler

    out = convert(smollm_gguf, tmp_path / "smollm", dtype="float32")
    model, tokenizer = load(str(out))
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                           add_generation_prompt=True)
    assert prompt == smollm.tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], add_generation_prompt=True)
    text = generate(model, tokenizer, prompt, max_tokens=12, sampler=make_sampler(0.0))
    assert text == "The capital of France is Paris."
    ours = dict(tree_flatten(smollm.model.parameters()))
    theirs = dict(tree_flatten(model.parameters()))
    assert set(ours) == set(theirs)
    for name in ("model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight", "model.norm.weight"):
        np.testing.assert_array_equal(np.array(theirs[name]), np.array(ours[name]))
