"""The runner's forward pass on a real tiny mlx-lm model: mixed batches of
adapters and the base, chunked prefill, staggered arrivals and a quantized
base, against plain mlx-lm on merged weights (mola/engine/runner.py)."""

from __future__ import annotations

import pytest
from mlx_lm import load
from mlx_lm.tuner.utils import load_adapters

from helpers.engines import EngineRunner as Runner
from helpers.engines import ENGINE_QUESTIONS as QUESTIONS
from helpers.engines import ENGINE_MAX_TOKENS as MAX_TOKENS
from helpers.references import greedy_tokens, merged_model


@pytest.fixture(scope="module")
def references(tiny_model, adapters, runner):
    """Greedy tokens of plain mlx-lm with each adapter merged into the weights."""
    refs = {}
    for name in (None, *adapters):
        model, _ = merged_model(tiny_model, [adapters[name]] if name else [])
        for q in QUESTIONS:
            refs[name, q] = greedy_tokens(model, runner.prompt(q), MAX_TOKENS)
    return refs


def test_mixed_batch_matches_merged_weight_reference(runner, references, adapters):
    jobs = [(name, q) for q in QUESTIONS for name in (None, *adapters)]
    seqs = [runner.submit(runner.prompt(q), name) for name, q in jobs]
    outputs = runner.wait(seqs)
    for (name, q), out in zip(jobs, outputs):
        assert out == references[name, q], (name, q)
    # The adapters really change the output.
    assert len({tuple(references[n, QUESTIONS[1]]) for n in (None, *adapters)}) == 4


def test_output_does_not_depend_on_the_batch(runner, adapters):
    prompt = runner.prompt(QUESTIONS[3])
    alone = runner.run(prompt, "b")
    # Staggered arrivals: the request joins a batch that is already decoding,
    # beside rows of every adapter and the base with other prompt lengths.
    crowd = [runner.submit(runner.prompt(q), n, max_tokens=30) for q in QUESTIONS for n in (None, "a", "c")]
    runner.wait_decoding(crowd)
    mine = runner.submit(prompt, "b")
    more = [runner.submit(runner.prompt(q), "a") for q in QUESTIONS[:2]]
    runner.wait([*crowd, mine, *more])
    assert mine.output == alone


def test_chunked_prefill_matches_reference(tiny_model, adapters, references):
    r = Runner(tiny_model, adapters=[("c", adapters["c"])], max_tokens=MAX_TOKENS, prefill_step_size=5)
    try:
        for name in (None, "c"):
            q = QUESTIONS[3]
            assert r.run(r.prompt(q), name) == references[name, q]
    finally:
        r.stop()


def test_quantized_base_matches_mlx_lm_lora(quantized_model, tmp_path):
    """A 4-bit base: mola's slots against mlx-lm's own LoRALinear on the
    same QuantizedLinear layers."""
    from mola.testing.adapter import make_random_adapter

    adapter = make_random_adapter(tmp_path / "qa", quantized_model, rank=8,
                                  keys=("self_attn.q_proj", "mlp.up_proj"), seed=5)
    r = Runner(quantized_model, adapters=[("qa", adapter)], max_tokens=MAX_TOKENS)
    try:
        model, _ = load(str(quantized_model))
        base_ref = {q: greedy_tokens(model, r.prompt(q), MAX_TOKENS) for q in QUESTIONS}
        load_adapters(model, str(adapter))
        lora_ref = {q: greedy_tokens(model, r.prompt(q), MAX_TOKENS) for q in QUESTIONS}
        seqs = [(q, n, r.submit(r.prompt(q), n)) for q in QUESTIONS for n in (None, "qa")]
        r.wait([s for *_, s in seqs])
        for q, n, s in seqs:
            assert s.output == (lora_ref if n else base_ref)[q], (q, n)
        assert lora_ref != base_ref
    finally:
        r.stop()
