"""The KV budget (mola/engine/kv_budget.py; admission and preemption in the
scheduler): what a batch may hold, against a step-by-step count; and a real
engine on the tiny model at a small budget, whose requests (mixed adapters,
greedy, seeded sampling, penalties) all finish with the outputs of an
unbounded engine, preempted or not, while the batches' KV arrays, measured
after every step, never pass the budget."""

from __future__ import annotations

import random

import pytest

from helpers.engines import EngineRunner, together

from mola.engine.kv_budget import STEP, KVBudget, peak
from mola.engine.scheduler import ADMISSION_HEADROOM

MAX_TOKENS = 48
PROMPT_TOKENS = 64


def naive_peak(rows: list[tuple[int, int]]) -> int:
    """Step by step: at step k the rows with k steps or more left hold k more
    tokens each, every row as wide as the longest, plus the allocation step."""
    most = 0
    for k in range(max((s for _, s in rows), default=0) + 1):
        alive = [length + k for length, steps in rows if steps >= k]
        if alive:
            most = max(most, len(alive) * (max(alive) + STEP))
    return most


@pytest.mark.parametrize("seed", range(6))
def test_peak_is_the_most_any_step_holds(seed):
    rng = random.Random(seed)
    rows = [(rng.randrange(1, 300), rng.randrange(0, 200)) for _ in range(rng.randrange(1, 12))]
    assert peak(rows) == naive_peak(rows)
    assert peak([]) == 0


def test_a_request_the_whole_budget_cannot_hold_is_refused_by_name():
    budget = KVBudget.of_bytes(1000 * 64, 64)  # 1000 positions
    fits = budget.max_tokens_for(100)
    assert budget.refusal(100, fits) is None
    why = budget.refusal(100, fits + 1)
    assert "--kv-cache-bytes" in why and "64,000 bytes" in why
    with pytest.raises(ValueError, match="KV admission"):
        KVBudget(10, 1, "lazy")


def test_the_auto_budget_is_half_the_free_memory_within_its_bounds():
    from mola.engine.config import EngineConfig
    from mola.engine.kv_budget import make_kv_budget

    config = EngineConfig(max_num_seqs=4, prompt_cache_bytes=1000 * 100)
    free = (1000 + 2 * 3000) * 100  # the prompt cache, then twice 3000 positions of 100 bytes
    assert make_kv_budget(config, 100, 2048, free).capacity == 3000
    # capped at every row at the full context
    assert make_kv_budget(config, 100, 300, free).capacity == 4 * (301 + STEP)
    # never less than one request at the full context, however little is free
    assert make_kv_budget(config, 100, 2048, 0).capacity == 2049 + STEP
    assert make_kv_budget(EngineConfig(kv_cache_bytes=12_345), 100, 2048, free).capacity == 123
    assert make_kv_budget(EngineConfig(kv_cache_bytes=0), 100, 2048, free) is None


# ---- a real engine at a small budget --------------------------------------------

def requests(adapters, sampled: bool) -> list[dict]:
    """Eight requests over every adapter and the base, prompts of
    PROMPT_TOKENS random tokens: seeded sampling (half of them with
    penalties too), so that a preempted row must come back with its PRNG key
    and its token counts; or greedy."""
    rng = random.Random(7)
    names = [None, *adapters]
    out = []
    for i in range(8):
        params = {"temperature": 0.9, "seed": 100 + i} if sampled else {}
        if sampled and i % 2:
            params.update(frequency_penalty=0.7, presence_penalty=0.3)
        out.append({"prompt": [rng.randrange(3, 200) for _ in range(PROMPT_TOKENS)],
                    "adapter": names[i % len(names)], **params})
    return out


def run_all(runner: EngineRunner, reqs: list[dict]) -> list[list[int]]:
    seqs = together(runner, lambda: [
        runner.submit(r["prompt"], r["adapter"], **{k: v for k, v in r.items() if k not in ("prompt", "adapter")})
        for r in reqs])
    return runner.wait(seqs, timeout=300)


@pytest.fixture(scope="module")
def unbounded(tiny_model, adapters):
    """The outputs with no budget (sampled, greedy), and a KV position's bytes."""
    r = EngineRunner(tiny_model, adapters=list(adapters.items()), max_tokens=MAX_TOKENS, kv_cache_bytes=0)
    try:
        yield ({sampled: run_all(r, requests(adapters, sampled)) for sampled in (True, False)},
               r.engine.call(lambda: r.engine.runner.kv_position_bytes).result(timeout=30))
    finally:
        r.stop()


def three_rows_then_short(bytes_per_token: int) -> int:
    """A budget that admits three rows at their prompt and cannot hold
    three at their longest: rows are preempted as they grow."""
    start = peak([(PROMPT_TOKENS, 2 + ADMISSION_HEADROOM)] * 3)
    end = peak([(PROMPT_TOKENS + MAX_TOKENS, 1)] * 3)
    assert start < end
    return (start + end) // 2 * bytes_per_token


@pytest.mark.parametrize("mode", ["optimistic", "reserve"])
def test_a_small_budget_changes_no_output_and_is_never_passed(tiny_model, adapters, unbounded, mode):
    reference, bytes_per_token = unbounded
    budget = three_rows_then_short(bytes_per_token)
    r = EngineRunner(tiny_model, adapters=list(adapters.items()), max_tokens=MAX_TOKENS, kv_cache_bytes=budget,
                     kv_admission=mode)
    try:
        assert run_all(r, requests(adapters, sampled=True)) == reference[True]
        r.engine.call(lambda: None).result(timeout=30)  # the last step's snapshot is published by now
        kv, stats = r.engine.snapshot.kv, r.engine.snapshot.stats
    finally:
        r.stop()
    assert kv.budget_bytes == budget and kv.mode == mode
    # measured: the batches' KV arrays after every step
    assert 0 < stats.peak_kv_bytes <= kv.budget_bytes
    assert stats.max_batch <= 3 and kv.waits >= 1  # at most three of the eight ran at once
    if mode == "optimistic":
        assert kv.preemptions >= 1  # three were admitted, and could not all grow to the end
    else:
        assert kv.preemptions == 0
    assert kv.used_bytes == kv.reserved_bytes == 0  # everything finished: nothing held


def test_the_budget_is_published_before_the_first_request(tiny_model):
    r = EngineRunner(tiny_model, kv_cache_bytes=(STEP + 100) * 512, kv_admission="reserve")
    try:
        kv = r.engine.snapshot.kv  # start() returned: nothing was asked of the engine yet
        assert kv.budget_bytes == r.engine.kv_budget.nbytes > 0 and kv.mode == "reserve"
    finally:
        r.stop()


def test_preemption_without_a_prompt_cache_recomputes_to_the_same_output(tiny_model, adapters, unbounded):
    """With no prompt cache to keep a preempted row's KV, its prefix is
    prefilled again from its prompt and output: the greedy rows' outputs are
    the same tokens (prefill and decode compute the same values here)."""
    reference, bytes_per_token = unbounded
    r = EngineRunner(tiny_model, adapters=list(adapters.items()), max_tokens=MAX_TOKENS,
                     kv_cache_bytes=three_rows_then_short(bytes_per_token), prompt_cache_bytes=0)
    try:
        outputs = run_all(r, requests(adapters, sampled=False))
        assert r.engine.snapshot.kv.preemptions >= 1
    finally:
        r.stop()
    assert outputs == reference[False]


# ---- the server: refusals, clamping, /health and /metrics ----------------------------

def test_the_server_refuses_what_the_budget_cannot_hold_and_shows_it(tiny_model):
    import re

    import httpx

    from helpers.servers import start_server

    handle = start_server(model=str(tiny_model), kv_cache_bytes=(STEP + 100) * 512, kv_admission="reserve")
    try:
        budget = handle.state.kv_budget
        assert budget.bytes_per_token == 512 and budget.capacity == STEP + 100 and budget.mode == "reserve"
        # shown from the start, before any request
        kv = next(iter(httpx.get(handle.url + "/health").json()["kv_cache"].values()))
        assert kv["budget"] == budget.nbytes and kv["admission"] == "reserve" and kv["used"] == 0
        assert re.search(rf"^mola_kv_budget_bytes {float(budget.nbytes)}$", httpx.get(handle.url + "/metrics").text,
                         re.M)
        chat = {"model": "tiny", "messages": [{"role": "user", "content": "Hello there"}], "ignore_eos": True}
        refused = httpx.post(handle.url + "/v1/chat/completions", json={**chat, "max_tokens": 100}, timeout=60)
        error = refused.json()["error"]
        assert refused.status_code == 400 and error["param"] == "max_tokens", refused.text
        assert "--kv-cache-bytes" in error["message"] and f"{budget.nbytes:,} bytes" in error["message"]
        # without max_tokens it gets what the budget can hold alone, and ends by length there
        answer = httpx.post(handle.url + "/v1/chat/completions", json=chat, timeout=60).json()
        prompt = answer["usage"]["prompt_tokens"]
        assert answer["usage"]["completion_tokens"] == budget.max_tokens_for(prompt) < 100
        assert answer["choices"][0]["finish_reason"] == "length"
        kv = next(iter(httpx.get(handle.url + "/health").json()["kv_cache"].values()))
        assert kv["budget"] == budget.nbytes and kv["admission"] == "reserve" and kv["used"] == 0
        metrics = httpx.get(handle.url + "/metrics").text
        assert re.search(rf"^mola_kv_budget_bytes {float(budget.nbytes)}$", metrics, re.M)
        assert re.search(r'^mola_base_kv_budget_bytes\{base="[^"]+"\} ', metrics, re.M)
    finally:
        handle.stop()


def test_constrained_rows_keep_their_grammar_across_preemption(tiny_model, adapters, unbounded):
    """A preempted row under a grammar takes its in-flight token into its
    matcher and comes back masked where it left off: every row's output is
    the unbounded engine's, and none left its grammar."""
    from mola.structured import Grammar, StructuredOutputs

    _, bytes_per_token = unbounded

    def run(**config):
        r = EngineRunner(tiny_model, adapters=list(adapters.items()), max_tokens=MAX_TOKENS, **config)
        try:
            s = StructuredOutputs(r.loaded.tokenizer, r.loaded.vocab_size)
            grammar = s.compile(Grammar('start: "[" /(a|b|c, ){3000}/ "]"\n', "abc", "test"))
            # The third of every three constrained: it is the youngest when three run, and when it is
            # preempted the batch left holds free rows only (sampled unmasked).
            seqs = together(r, lambda: [
                r.submit(q["prompt"], q["adapter"], constraint=grammar.new_constraint() if i % 3 == 2 else None,
                         temperature=0.9, seed=i) for i, q in enumerate(requests(adapters, sampled=False))])
            outputs = r.wait(seqs, timeout=300)
            assert all(s.finish_reason == "length" and s.constraint.error is None for s in seqs[2::3])
            return outputs, sum(s.num_preemptions for s in seqs[2::3])
        finally:
            r.stop()

    free, _ = run(kv_cache_bytes=0)
    bounded, constrained_preemptions = run(kv_cache_bytes=three_rows_then_short(bytes_per_token))
    assert constrained_preemptions >= 1
    assert bounded == free
