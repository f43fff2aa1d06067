"""Sampling under speculation follows the target's distribution
(mola/engine/verify.py): over many seeds, the first tokens a speculating
engine samples match the distribution computed from plain mlx-lm's logits,
as they do without speculation, within a bound that a wrong acceptance rule
fails."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm import load

import mola.engine.verify as verify
from mola.engine.config import SpeculativeConfig

from helpers.engines import EngineRunner as Runner
from helpers.engines import runner_stats

NUM_SEEDS = 400
TEMPERATURE = 1.0
TEXT = "the cat sat on the mat and the dog sat on the rug, then the cat sat"


@pytest.fixture(scope="module")
def setting(tiny_model):
    """A prompt whose end ("the cat sat") occurred before, so that prompt
    lookup drafts from the first step on (" on the mat ..."); a logit bias
    gives the first draft a probability near one half, so acceptance and
    rejection are both frequent. Returns the prompt, the bias and the exact
    distribution of the first token."""
    model, tok = load(str(tiny_model))
    prompt = tok.encode(TEXT)
    end = next(i for i in range(len(prompt) - 3, 0, -1) if prompt[i - 3:i] == prompt[-3:])
    draft = prompt[end]
    logits = np.array(model(mx.array([prompt]))[0, -1].astype(mx.float32), dtype=np.float64)
    others = np.delete(logits, draft)
    bias = float(np.log(np.exp(others - others.max()).sum()) + others.max() - logits[draft])  # p(draft) = 1/2
    biased = logits.copy()
    biased[draft] += bias
    p = np.exp(biased / TEMPERATURE - (biased / TEMPERATURE).max())
    return prompt, draft, bias, p / p.sum()


def first_tokens(runner, prompt, draft, bias) -> list[list[int]]:
    seqs = [runner.submit(prompt, None, max_tokens=3, temperature=TEMPERATURE, seed=seed,
                          logit_bias=((draft, bias),)) for seed in range(NUM_SEEDS)]
    return runner.wait(seqs, timeout=300)


def fits(freq_tokens: list[int], p: np.ndarray) -> bool:
    """Pearson's chi-square of the observed first tokens against ``p``, over
    the five likeliest tokens and the rest lumped, below its 0.1% critical
    value (5 degrees of freedom: 20.5)."""
    top = list(np.argsort(-p)[:5])
    observed = [sum(t == k for t in freq_tokens) for k in top]
    observed.append(len(freq_tokens) - sum(observed))
    expected = [p[k] * len(freq_tokens) for k in top] + [(1 - p[top].sum()) * len(freq_tokens)]
    chi2 = sum((o - e) ** 2 / e for o, e in zip(observed, expected))
    return chi2 < 20.5


def lenient_rule(real):
    """A deliberately wrong rule: a rejected first draft is accepted anyway
    half of the time (too generous an acceptance probability)."""
    rng = np.random.default_rng(0)

    def accepted_lengths(tokens, drafts, num_draft):
        right = real(tokens, drafts, num_draft)
        coin = mx.array(rng.random(drafts.shape[0]) < 0.5)
        wrong = (mx.array(num_draft) > 0) & (right == 0) & coin
        return mx.where(wrong, 1, right)

    return accepted_lengths


def test_first_tokens_follow_the_target_distribution(tiny_model, setting, monkeypatch):
    prompt, draft, bias, p = setting
    assert 0.45 < p[draft] < 0.55
    plain = Runner(tiny_model, max_tokens=3, max_num_seqs=64)
    always = SpeculativeConfig(max_batch=64, cost_aware=False)  # every row drafts: all verify
    spec = Runner(tiny_model, max_tokens=3, max_num_seqs=64, speculative=always)
    try:
        without = first_tokens(plain, prompt, draft, bias)
        drafted_before = runner_stats(spec.engine).draft_tokens
        with_spec = first_tokens(spec, prompt, draft, bias)
        st = runner_stats(spec.engine)
        assert st.draft_tokens - drafted_before >= NUM_SEEDS  # every row drafted at its first step
        # The draws are those plain decoding makes: the same tokens, seed by seed.
        assert with_spec == without
        firsts = [t[0] for t in with_spec]
        assert fits([t[0] for t in without], p) and fits(firsts, p)
        assert 0.4 < firsts.count(draft) / NUM_SEEDS < 0.6  # accepted about half of the time
        # The same bound catches a wrong rule.
        monkeypatch.setattr(verify, "accepted_lengths", lenient_rule(verify.accepted_lengths))
        wrong = first_tokens(spec, prompt, draft, bias)
        assert not fits([t[0] for t in wrong], p)
    finally:
        plain.stop()
        spec.stop()
