"""DoRA in the engine's mixed batch (issue 45, part 1): an adapter written by
mlx-lm's own DoRALinear answers as mlx-lm itself, loaded with
``load(adapter_path=)``, answers: alone, and in one batch with plain LoRA,
activated LoRA and base rows; on a bias-free base, a base with biases (qwen2)
and a quantized base. Each row is checked token by token against its
reference fed the row's own tokens (teacher forcing): the token mola chose is
within a small margin of the reference's best, and mola's log-probability of
it is the reference's, within float tolerance."""

from __future__ import annotations

import random

import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache

from helpers.engines import EngineRunner, together
from mola.testing.adapter import make_mlx_lm_lora
from mola.testing.model import TinyModelSpec, make_tiny_model

MAX_TOKENS = 8
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


def check_row(output: list[int], logprobs, reference: list[mx.array]) -> None:
    """mola's tokens are the reference's best within TOL, and its log-probabilities the reference's."""
    assert len(output) == len(reference) == MAX_TOKENS
    for token, (lp, _), ref in zip(output, logprobs, reference):
        assert float(ref.max()) - float(ref[token]) <= TOL, (token, int(ref.argmax()))
        assert abs(lp - float(ref[token])) <= TOL, (lp, float(ref[token]))


def _model(tmp_path_factory, **spec):
    return make_tiny_model(tmp_path_factory.mktemp("models") / "dora", TinyModelSpec(**spec))


@pytest.fixture(scope="module", params=["llama", "qwen2", "llama-q4"])
def base_dir(request, tmp_path_factory):
    if request.param == "llama-q4":
        return _model(tmp_path_factory, quantize_bits=4, quantize_group_size=32)
    return _model(tmp_path_factory, model_type=request.param)


@pytest.fixture(scope="module")
def trio(base_dir, tmp_path_factory):
    """A DoRA and a plain LoRA adapter written by mlx-lm's tuner, and an activated LoRA (the LoRA invoked)."""
    root = tmp_path_factory.mktemp("dora-adapters")
    dora = make_mlx_lm_lora(root / "dora", base_dir, rank=8, scale=2.0, seed=1, fine_tune_type="dora")
    lora = make_mlx_lm_lora(root / "lora", base_dir, rank=4, scale=2.0, seed=2)
    return dora, lora


def test_dora_rows_match_mlx_lm_alone_and_beside_lora_alora_and_base_rows(base_dir, trio):
    from mlx_lm import load

    dora, lora = trio
    base = load(str(base_dir))[0]
    dora_model = load(str(base_dir), adapter_path=str(dora))[0]
    lora_model = load(str(base_dir), adapter_path=str(lora))[0]
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in (21, 9, 30, 14, 17)]
    r = EngineRunner(base_dir, adapters=[("d", dora), ("l", lora)], max_tokens=MAX_TOKENS)
    lp = {"logprobs": 1}
    try:
        alone = r.submit(prompts[0], "d", **lp)
        r.wait([alone])
        rows = [(0, "d", None), (1, "l", None), (2, "l", 11), (3, None, None), (4, "d", None)]
        seqs = together(r, lambda: [r.submit(prompts[i], a, adapter_start=s, **lp) for i, a, s in rows])
        r.wait(seqs)
    finally:
        r.stop()
    models = {"d": dora_model, "l": lora_model, None: base}
    check_row(alone.output, r.logprobs[alone.seq_id],
              reference_logprobs(base, dora_model, prompts[0] + alone.output, 0, len(prompts[0])))
    for seq, (i, a, start) in zip(seqs, rows):
        tokens = prompts[i] + seq.output
        check_row(seq.output, r.logprobs[seq.seq_id],
                  reference_logprobs(base, models[a], tokens, start or 0, len(prompts[i])))
    # the magnitudes matter: the DoRA model is neither the base nor its LoRA alone
    prompt = mx.array([prompts[0]])
    plain = load(str(base_dir), adapter_path=str(lora))[0]
    assert float(mx.abs(dora_model(prompt) - base(prompt)).max()) > 0.1
    assert float(mx.abs(dora_model(prompt) - plain(prompt)).max()) > 0.1
