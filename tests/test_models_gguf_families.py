"""Every dense GGUF architecture mola serves (models/gguf_arch/), one test each: the
GGUF twin of a tiny random mlx-lm model, written by gguf-py in llama.cpp's layout
(mola/testing/gguf_model.py, the converter's own steps per family in
mola/testing/gguf_twins/), computes exactly what mlx-lm computes on the directory;
and with two GGUF LoRAs (llama.cpp's names and row order for the architecture) in one
mixed batch with base rows, every row answers what it answers alone, and that is the
greedy answer of plain mlx-lm on the directory with the same LoRA merged into its
weights (checked wherever the reference's top two logits are apart)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from helpers import EngineRunner, merged_model
from mola.adapters.formats.gguf_names import architecture_for
from mola.adapters.formats.gguf_writer import save_gguf_adapter
from mola.models.loader import load_base_model
from mola.testing.adapter import linear_shapes, random_lora, save_mlx_lm_adapter
from mola.testing.gguf_model import save_gguf_model
from mola.testing.gguf_twins import TWINS
from mola.testing.model import TinyModelSpec, make_tiny_model

# llama, qwen2 and qwen3 as before, then every family with a twin writer
MODEL_TYPES = tuple(dict.fromkeys(("llama", "qwen2", "qwen3", *TWINS)))
# longer than the tiny models' sliding windows, so that windowed layers differ from full ones
TOKENS = [1, 17, 300, 45, 2, 99, 7, 256, 12, 5, 64, 33, 401, 8, 77, 150, 3, 42]
MAX_TOKENS = 8
MARGIN = 1e-3  # reference logits closer than this may pick either token


@pytest.fixture(scope="module", params=MODEL_TYPES)
def family(request, tmp_path_factory):
    """(model_type, mlx-lm directory, GGUF twin, {adapter: (GGUF LoRA, mlx-lm adapter dir)})."""
    model_type = request.param
    root = tmp_path_factory.mktemp(model_type)
    model_dir = make_tiny_model(root / "model", TinyModelSpec(model_type=model_type, norm_noise=0.3))
    twin = save_gguf_model(root / "twin.gguf", model_dir)
    config = load_base_model(str(twin)).config
    keys = tuple(linear_shapes(config))
    arch = architecture_for(model_type)
    loras = {}
    for name, seed in (("a", 1), ("b", 2)):
        weights = random_lora(model_dir, rank=4, keys=keys, seed=seed, std=0.3)
        loras[name] = (
            save_gguf_adapter(root / f"{name}.gguf", weights, architecture=arch.name,
                              n_head=config["num_attention_heads"], n_kv_head=config["num_key_value_heads"]),
            save_mlx_lm_adapter(root / f"{name}-mlx", weights, keys=keys,
                                num_layers=config["num_hidden_layers"]),
        )
    return model_type, model_dir, twin, loras


def test_the_twin_computes_exactly_what_mlx_lm_computes(family):
    from mlx_lm import load

    model_type, model_dir, twin, _ = family
    ref, _ = load(str(model_dir))
    got = load_base_model(str(twin), dtype="float32")
    assert got.config["model_type"] == model_type
    tokens = mx.array([TOKENS])
    np.testing.assert_array_equal(np.array(got.model(tokens)), np.array(ref(tokens)))


def assert_greedy(tokens: list[int], logits: np.ndarray) -> None:
    """Each of ``tokens`` is the reference's greedy pick where its top two are apart."""
    for i, (token, row) in enumerate(zip(tokens, logits)):
        top = np.sort(row)[-2:]
        if top[1] - top[0] > MARGIN:
            assert token == int(row.argmax()), f"token {i}: {token}, the reference picks {int(row.argmax())}"
        else:
            assert row[token] >= top[1] - MARGIN, f"token {i}: {token} is not among the reference's best"


def test_gguf_loras_in_a_mixed_batch_answer_as_merged_mlx_lm(family):
    model_type, model_dir, twin, loras = family
    runner = EngineRunner(twin, adapters=[(name, gguf) for name, (gguf, _) in loras.items()],
                          max_tokens=MAX_TOKENS, max_lora_rank=4)
    try:
        alone = {name: runner.run(TOKENS, name) for name in (None, "a", "b")}
        assert alone["a"] != alone[None] or alone["b"] != alone[None], "the adapters change nothing"
        names = [None, "a", "b", "a", None, "b"]
        mixed = runner.wait([runner.submit(TOKENS, name) for name in names])
        assert mixed == [alone[name] for name in names]
    finally:
        runner.stop()
    for name, adapters in ((None, ()), ("a", (loras["a"][1],)), ("b", (loras["b"][1],))):
        model, _ = merged_model(model_dir, adapters)
        tokens = alone[name]
        logits = np.array(model(mx.array([TOKENS + tokens]))[0, len(TOKENS) - 1:-1].astype(mx.float32))
        assert_greedy(tokens, logits)
