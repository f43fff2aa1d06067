"""Base-model loading: local paths and hub ids through huggingface-hub's
cache, offline, and GGUF files (mola/models/loader.py)."""

from __future__ import annotations

import shutil

import pytest

from mola.models.loader import ModelLoadError, load_base_model, resolve_model_path


def test_local_directory(tiny_model):
    assert resolve_model_path(str(tiny_model)) == tiny_model
    loaded = load_base_model(str(tiny_model))
    assert loaded.max_model_len == 2048 and loaded.tokenizer.has_chat_template


def test_hub_id_resolves_through_the_local_hub_cache(tiny_model, tmp_path, monkeypatch):
    """A hub id is looked up with huggingface-hub; here its offline cache holds
    a snapshot laid out exactly as a download leaves it."""
    cache = tmp_path / "hub"
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = cache / "models--mola-test--tiny"
    shutil.copytree(tiny_model, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants as hc

    monkeypatch.setattr(hc, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(hc, "HF_HUB_OFFLINE", True)
    path = resolve_model_path("mola-test/tiny")
    assert path == repo / "snapshots" / commit
    assert load_base_model("mola-test/tiny").path == path


def test_unknown_hub_id_offline_is_a_clear_error(tmp_path, monkeypatch):
    import huggingface_hub.constants as hc

    monkeypatch.setattr(hc, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setattr(hc, "HF_HUB_OFFLINE", True)
    with pytest.raises(ModelLoadError, match="mola-test/absent"):
        resolve_model_path("mola-test/absent")


def test_bad_local_paths(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        resolve_model_path(str(tmp_path / "a" / "b" / "c"))
    with pytest.raises(ModelLoadError, match="no config.json"):
        resolve_model_path(str(tmp_path))


def test_dtype_dequantizes_an_mlx_lm_directory(quantized_model):
    import mlx.core as mx
    import mlx.nn as nn
    import numpy as np

    tokens = mx.array([[1, 5, 9, 40, 7]])
    kept = load_base_model(str(quantized_model), dtype="keep")
    full = load_base_model(str(quantized_model), dtype="float32")
    assert isinstance(kept.model.model.layers[0].self_attn.q_proj, nn.QuantizedLinear)
    q = full.model.model.layers[0].self_attn.q_proj
    assert type(q) is nn.Linear and q.weight.dtype == mx.float32 and "quantization" not in full.config
    np.testing.assert_allclose(np.array(full.model(tokens)), np.array(kept.model(tokens)), atol=1e-4)
    half = load_base_model(str(quantized_model), dtype="bfloat16")
    assert half.model.model.layers[0].self_attn.q_proj.weight.dtype == mx.bfloat16
    assert load_base_model(str(quantized_model)).config.get("quantization")  # auto: as it is


def test_auto_dtype(monkeypatch):
    import mlx.core as mx

    from mola.models.loader import resolve_dtype

    on_cpu = mx.default_device() == mx.cpu
    assert resolve_dtype("auto", is_gguf=True) == ("float32" if on_cpu else "keep")
    assert resolve_dtype("auto", is_gguf=False) == "keep"
    assert resolve_dtype("float16", is_gguf=True) == "float16"
    with pytest.raises(ModelLoadError, match="'half'"):
        resolve_dtype("half", is_gguf=True)
