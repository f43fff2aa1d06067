"""The checks every GGUF architecture's tests make on its twin (a tiny random mlx-lm
model and the GGUF file llama.cpp's converter would write for it): exact logits
against mlx-lm on the directory, and two GGUF LoRAs with base rows in one mixed batch
answering as alone and as plain mlx-lm with the LoRA merged."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from helpers.engines import EngineRunner
from helpers.references import merged_model
from mola.adapters.formats.gguf_writer import save_gguf_adapter
from mola.models.loader import load_base_model
from mola.testing.adapter import linear_shapes, random_lora, save_mlx_lm_adapter

# longer than the tiny models' sliding windows, so that windowed layers differ from full ones
TOKENS = [1, 17, 300, 45, 2, 99, 7, 256, 12, 5, 64, 33, 401, 8, 77, 150, 3, 42]
MAX_TOKENS = 8
MARGIN = 1e-3  # reference logits closer than this may pick either token


def assert_exact(model_dir, twin):
    """The twin's logits on TOKENS are mlx-lm's on the directory, to the bit; the
    loaded twin (its .config, its .model)."""
    from mlx_lm import load

    ref, _ = load(str(model_dir))
    got = load_base_model(str(twin), dtype="float32")
    tokens = mx.array([TOKENS])
    np.testing.assert_array_equal(np.array(got.model(tokens)), np.array(ref(tokens)))
    return got


def assert_greedy(tokens: list[int], logits: np.ndarray) -> None:
    """Each of ``tokens`` is the reference's greedy pick where its top two are apart."""
    for i, (token, row) in enumerate(zip(tokens, logits)):
        top = np.sort(row)[-2:]
        if top[1] - top[0] > MARGIN:
            assert token == int(row.argmax()), f"token {i}: {token}, the reference picks {int(row.argmax())}"
        else:
            assert row[token] >= top[1] - MARGIN, f"token {i}: {token} is not among the reference's best"


def assert_loras_answer_as_merged(model_dir, twin, root, architecture: str) -> None:
    """Two GGUF LoRAs (llama.cpp's names and row order for ``architecture``) on every
    linear, and base rows, in one mixed batch on the twin: every row answers as alone,
    and as plain mlx-lm on the directory with the same LoRA merged into its weights."""
    config = load_base_model(str(twin)).config
    keys = tuple(linear_shapes(config))
    loras = {}
    for name, seed in (("a", 1), ("b", 2)):
        weights = random_lora(model_dir, rank=4, keys=keys, seed=seed, std=0.3)
        loras[name] = (
            save_gguf_adapter(root / f"{name}.gguf", weights, architecture=architecture,
                              n_head=config["num_attention_heads"], n_kv_head=config["num_key_value_heads"]),
            save_mlx_lm_adapter(root / f"{name}-mlx", weights, keys=keys, num_layers=config["num_hidden_layers"]))
    runner = EngineRunner(twin, adapters=[(name, gguf) for name, (gguf, _) in loras.items()],
                          max_tokens=MAX_TOKENS, max_lora_rank=4)
    try:
        alone = {name: runner.run(TOKENS, name) for name in (None, "a", "b")}
        assert alone["a"] != alone[None] or alone["b"] != alone[None], "the adapters change nothing"
        names = [None, "a", "b", "a", None, "b"]
        assert runner.wait([runner.submit(TOKENS, name) for name in names]) == [alone[n] for n in names]
    finally:
        runner.stop()
    for name, adapters in ((None, ()), ("a", (loras["a"][1],)), ("b", (loras["b"][1],))):
        model, _ = merged_model(model_dir, adapters)
        tokens = alone[name]
        logits = np.array(model(mx.array([TOKENS + tokens]))[0, len(TOKENS) - 1:-1].astype(mx.float32))
        assert_greedy(tokens, logits)
