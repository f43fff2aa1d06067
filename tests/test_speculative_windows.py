"""Speculative decoding on a model with sliding-window layers (mola/engine/verify.py's
rewind_window, on mlx-lm's BatchRotatingKVCache): a batch cache cut back after each
verification as rows accept different numbers of drafts computes what the model
computes on each row's accepted tokens from scratch; and the engine's output equals
plain decoding, with prompt lookup and with drafts that are right up to a point that
varies by row, on a gemma3 GGUF twin (window 8)."""

from __future__ import annotations

import random

import mlx.core as mx
import numpy as np
import pytest

from helpers.engines import EngineRunner, runner_stats, together
from mola.engine import verify
from mola.engine.caches import merge_caches
from mola.engine.config import SpeculativeConfig
from mola.engine.speculative import Proposal
from mola.models.loader import load_base_model
from mola.testing.gguf_model import save_gguf_model
from mola.testing.model import TinyModelSpec, make_tiny_model

PROMPTS = [[1] + [(i * 37) % 480 + 20 for i in range(21)], [1, 5, 6, 7, 5, 6, 7, 5, 6, 7, 8, 9], [1, 300, 301]]


@pytest.fixture(scope="module")
def twin(tmp_path_factory):
    root = tmp_path_factory.mktemp("spec-windows")
    model_dir = make_tiny_model(root / "gemma3", TinyModelSpec(model_type="gemma3_text", norm_noise=0.3))
    return save_gguf_model(root / "gemma3.gguf", model_dir)


@pytest.mark.parametrize("seed", range(3))
def test_a_window_cut_back_after_each_verification_computes_as_from_scratch(twin, seed):
    """Rows of several lengths (merged from their prefilled caches) take steps of 1 to 5
    positions; each row keeps a random number of them (the rest are cut back) and its
    logits there are the model's on its kept tokens, computed with no cache. The short
    row's window is never full: a pass after one-token steps must still see all of it."""
    rng = random.Random(seed)
    model = load_base_model(str(twin), dtype="float32").model
    rows = [p[:-1] for p in PROMPTS]  # each row's tokens in its cache
    per_row = []
    for p in rows:
        cache = model.make_cache()
        model(mx.array([p]), cache=cache)
        per_row.append(cache)
    cache = merge_caches(per_row)
    assert any(type(c).__name__ == "BatchRotatingKVCache" for c in cache)
    inputs = [p[-1] for p in PROMPTS]
    for step in range(12):
        width = rng.choice([1, 1, 2, 3, 5])
        x = [[inputs[i]] + [rng.randrange(20, 500) for _ in range(width - 1)] for i in range(len(rows))]
        if width > 1:  # as the runner does before a verification
            verify.order_windows(cache)
        logits = np.array(model(mx.array(x), cache=cache))  # [B, P, V]
        kept = [rng.randrange(width) + 1 for _ in rows]  # the input and the accepted drafts
        for i, row in enumerate(rows):
            row.extend(x[i][:kept[i]])
            want = np.array(model(mx.array([row]))[0, -kept[i]:])
            np.testing.assert_allclose(logits[i, :kept[i]], want, rtol=0, atol=1e-4, err_msg=f"step {step} row {i}")
            inputs[i] = rng.randrange(20, 500)  # the token sampled after them, fed next
        verify.rewind(cache, [width - k for k in kept])
        mx.eval([c.state for c in cache])


def test_prompt_lookup_answers_as_plain_decoding(twin):
    """Alone, in a batch, sampled, and a second turn served from the prompt cache:
    the same tokens as plain decoding with the prompt cache off."""
    outs, stats, cached = {}, {}, {}
    for spec in (True, False):
        extra = {"speculative": SpeculativeConfig(max_batch=32, num_draft_tokens=4, cost_aware=False)} if spec \
            else {"prompt_cache_bytes": 0}
        r = EngineRunner(twin, max_tokens=40, prefill_step_size=8, **extra)
        try:
            alone = [r.run(p) for p in PROMPTS]
            batch = r.wait(together(r, lambda: [r.submit(p) for p in PROMPTS]))
            sampled = r.run(PROMPTS[1], temperature=0.8, seed=7)
            second = r.submit(PROMPTS[0] + alone[0] + [9, 30, 10])
            r.wait([second])
            outs[spec] = alone, batch, sampled, second.output
            stats[spec], cached[spec] = runner_stats(r.engine), second.num_cached_tokens
        finally:
            r.stop()
    assert outs[True] == outs[False]
    assert outs[False][0] == outs[False][1]
    assert stats[True].spec_steps > 0 and stats[True].draft_tokens > 0
    assert cached[True] == len(PROMPTS[0]) + 40 and cached[False] == 0


def oracle(answers: dict, k: int = 4):
    """A speculator's propose() that drafts each row's true next tokens (its plain
    answer), wrong from a position that varies with the row and the step: rows then
    accept different numbers of drafts, and the window is cut back per row."""
    def propose(rows, in_flight):
        counts, tokens = [], []
        for s in rows:
            start = s.num_output_tokens + int(s.seq_id in in_flight)  # after the token in flight
            known = answers.get(tuple(s.prompt), [])  # none for prompts it was not given
            draft = list(known[start:start + max(0, min(k, s.params.max_tokens - start - 1))])
            wrong = (start + s.seq_id) % (k + 1)
            if wrong < len(draft):
                draft[wrong] = (draft[wrong] + 1) % 500
            counts.append(len(draft))
            tokens.append(draft)
        return Proposal(counts, tokens) if any(counts) else None
    return propose


def test_accepted_drafts_cut_back_per_row_answer_as_plain_decoding(twin):
    plain = EngineRunner(twin, max_tokens=40, prefill_step_size=8, prompt_cache_bytes=0)
    try:
        answers = {tuple(p): plain.run(p) for p in PROMPTS}
    finally:
        plain.stop()
    spec = EngineRunner(twin, max_tokens=40, prefill_step_size=8,
                        speculative=SpeculativeConfig(max_batch=32, num_draft_tokens=4, cost_aware=False))
    try:
        engine = spec.engine
        engine.call(lambda: setattr(engine.scheduler.speculator, "propose", oracle(answers))).result(timeout=30)
        assert [spec.run(p) for p in PROMPTS] == list(answers.values())
        batch = spec.wait(together(spec, lambda: [spec.submit(p) for p in PROMPTS]))
        assert batch == list(answers.values())
        stats = runner_stats(engine)
        assert 0 < stats.accepted_tokens < stats.draft_tokens
        # a stop token among accepted drafts ends the row there; its next turn comes from the cache
        long = answers[tuple(PROMPTS[0])]
        stop = long[12]
        stopped = spec.run(PROMPTS[0], stop_token_ids=frozenset([stop]))
        assert stopped == long[:long.index(stop) + 1]
        turn = spec.submit(PROMPTS[0] + stopped + [9, 30, 10])
        spec.wait([turn])
        assert turn.num_cached_tokens == len(PROMPTS[0]) + len(stopped)
    finally:
        spec.stop()
    plain = EngineRunner(twin, max_tokens=40, prefill_step_size=8, prompt_cache_bytes=0)
    try:
        assert plain.run(PROMPTS[0] + stopped + [9, 30, 10]) == turn.output
    finally:
        plain.stop()
