"""DoRA references computed another way: mlx-lm's own model fed token by
token, the formula merged into the weights with numpy, and the PEFT DoRA
adapter those tests write (tests/test_dora.py, tests/test_dora_refusals.py)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import make_prompt_cache

TOL = 2e-3  # log-probabilities, float32 models


def reference_logprobs(base, adapted, tokens: list[int], start: int, num_prompt: int) -> list[mx.array]:
    """Log-softmax after each of ``tokens`` from the last prompt token on,
    fed one at a time into one cache: position p through ``adapted`` if
    p >= start, else through ``base`` (an activated LoRA's reference; start 0:
    ``adapted`` throughout)."""
    cache = make_prompt_cache(base)
    out = []
    for p, token in enumerate(tokens[:-1]):
        logits = (adapted if p >= start else base)(mx.array([[token]]), cache=cache)[0, -1]
        if p >= num_prompt - 1:
            out.append(logits - mx.logsumexp(logits))
    return out


def check_row(output: list[int], logprobs, reference: list[mx.array], max_tokens: int) -> None:
    """mola's tokens are the reference's best within TOL (a margin, not an
    argmax), and its log-probabilities the reference's within TOL."""
    assert len(output) == len(reference) == max_tokens
    for token, (lp, _), ref in zip(output, logprobs, reference):
        assert float(ref.max()) - float(ref[token]) <= TOL, (token, int(ref.argmax()))
        assert abs(lp - float(ref[token])) <= TOL, (lp, float(ref[token]))


def numpy_merged(base_dir, weights):
    """mlx-lm's base with each DoRA module merged by numpy (float64):
    W' = m / ||W + s (A B)^T|| (row-wise) * (W + s (A B)^T); biases unchanged."""
    from mlx_lm import load

    model = load(str(base_dir))[0]
    modules = dict(model.named_modules())
    for path, mod in weights.modules.items():
        lin = modules[path]
        w = np.array(lin.weight, dtype=np.float64) + mod.scale * (np.array(mod.a, np.float64) @ np.array(mod.b)).T
        g = np.array(weights.magnitudes[path], np.float64) / np.linalg.norm(w, axis=1)
        lin.weight = mx.array((g[:, None] * w).astype(np.float32))
    mx.eval(model.parameters())
    return model


def write_peft_dora(path: Path, model_dir) -> tuple[Path, object]:
    """A PEFT use_dora adapter written by the project's PEFT writer on the last
    block of ``model_dir``: random factors (alpha / r = 1.5) and magnitudes;
    (its directory, the LoRAWeights it was written from)."""
    from mola.testing.adapter import random_lora
    from mola.testing.peft import save_peft_adapter

    weights = random_lora(model_dir, rank=4, scale=1.5, seed=11, num_layers=1)
    rng = np.random.default_rng(12)
    magnitudes = {p: mx.array(rng.uniform(2.0, 9.0, m.b.shape[1]).astype(np.float32))
                  for p, m in weights.modules.items()}
    weights = dataclasses.replace(weights, magnitudes=magnitudes)
    assert weights.kind == "dora"
    return save_peft_adapter(path, weights), weights
