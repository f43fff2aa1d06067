"""The prompt cache in the engine (mola/engine/kv_store.py, with the scheduler
and runner that follow its orders), on a real tiny mlx-lm model: output served
from cached KV state equals plain mlx-lm's greedy output on merged weights,
and no prefix is ever shared across identities."""

from __future__ import annotations

import pytest

from mola.adapters.formats import read_adapter

from helpers.engines import EngineRunner
from helpers.references import greedy_tokens, merged_model

SYSTEM = ("You are a careful assistant for a shipping company. Answer in short sentences, name the "
          "port and the vessel, and never guess a date you were not given. ")
QUESTIONS = ["Where is the Aurora now?", "When does the Boreas leave Lisbon?", "hi",
             "List every vessel that called at Rotterdam last week, with its cargo."]
MAX_TOKENS = 8


def chat(tokenizer, question: str) -> list[int]:
    return tokenizer.apply_chat_template(
        [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
        add_generation_prompt=True)


@pytest.fixture(scope="module")
def runner(tiny_model, adapters):
    # Small prefill steps: suffixes after a cached prefix are chunked too.
    r = EngineRunner(tiny_model, adapters=list(adapters.items()), max_tokens=MAX_TOKENS, prefill_step_size=48)
    yield r
    r.stop()


@pytest.fixture(scope="module")
def models(tiny_model, adapters):
    """Plain mlx-lm models with each adapter merged into the weights."""
    return {name: merged_model(tiny_model, [adapters[name]] if name else [])[0] for name in (None, *adapters)}


def shared(prompts: list[list[int]]) -> int:
    """Tokens at the start of every prompt."""
    n = 0
    while all(len(p) > n and p[n] == prompts[0][n] for p in prompts):
        n += 1
    return n


def reference(models, name, prompt, max_tokens=MAX_TOKENS):
    return greedy_tokens(models[name], prompt, max_tokens)


def cache_state(runner):
    """(bookkeeping, arrays) entry counts, read on the engine thread."""
    engine = runner.engine
    return engine.call(lambda: (engine.scheduler.prompt_cache.num_entries, len(engine.runner.kv))).result()


def test_mixed_batch_of_adapters_from_the_cache(runner, models):
    tok = runner.loaded.tokenizer
    prompts = [chat(tok, q) for q in QUESTIONS]
    head = shared(prompts)  # the system prompt every question shares (and then some)
    assert head > 30
    for name in models:  # one turn per identity: its prompt and output are stored
        runner.run(prompts[0], name)
    before = runner.engine.snapshot
    # A long request decodes while the batch prefills beside it.
    busy = runner.submit(prompts[3], "b", max_tokens=40)
    runner.wait_decoding([busy])
    jobs = [(name, i) for i in range(len(prompts)) for name in models]
    seqs = [runner.submit(prompts[i], name) for name, i in jobs]
    runner.wait([busy, *seqs])
    for (name, i), seq in zip(jobs, seqs):
        assert seq.output == reference(models, name, prompts[i]), (name, QUESTIONS[i])
        # question 0 is cached whole, the others diverge inside the cached turn
        want = len(prompts[0]) - 1 if i == 0 else head
        assert seq.num_cached_tokens >= want, (name, i, seq.num_cached_tokens)
    after = runner.engine.snapshot
    assert after.prompt_cache.hits - before.prompt_cache.hits >= len(jobs)
    computed = after.stats.prefill_tokens - before.stats.prefill_tokens
    assert computed < sum(len(prompts[i]) - 1 - head for _, i in jobs) + len(prompts[3])
    assert after.stats.mixed_steps > before.stats.mixed_steps
    assert cache_state(runner)[0] == cache_state(runner)[1] > 0


@pytest.mark.parametrize("name", [None, "c"])
def test_multi_turn_conversation_reuses_every_earlier_turn(runner, models, name):
    tok = runner.loaded.tokenizer
    prompt = chat(tok, "Tell me about the Aurora, please.")
    previous = 0  # tokens of the turns before this one
    for turn in range(3):
        seq = runner.submit(prompt, name)
        runner.wait([seq])
        assert seq.output == reference(models, name, prompt), turn
        if turn:  # the previous prompt and everything generated for it
            assert seq.num_cached_tokens == previous
        previous = len(prompt) + len(seq.output)
        user = f"<|im_end|>\n<|im_start|>user\nAnd after that, turn {turn}?<|im_end|>\n<|im_start|>assistant\n"
        prompt = prompt + seq.output + tok.encode(user)


def test_prompt_diverging_inside_a_cached_segment_reuses_the_common_part(runner, models):
    tok = runner.loaded.tokenizer
    long = chat(tok, QUESTIONS[3] + " And their crews.")
    runner.run(long, "a")
    cut = len(long) // 2
    other = [t for t in tok.encode(" zebra quartz") if t != long[cut]]
    diverged = long[:cut] + other + long[cut:]
    seq = runner.submit(diverged, "a")
    runner.wait([seq])
    assert seq.num_cached_tokens == cut
    assert seq.output == reference(models, "a", diverged)


def test_other_lora_scale_and_base_never_share_an_adapters_prefix(runner, models, tiny_model, adapters):
    tok = runner.loaded.tokenizer
    prompt = tok.encode("A question nobody asked before: which vessel is the oldest? " * 3)
    assert runner.run(prompt, "c") == reference(models, "c", prompt)
    half = runner.submit(prompt, "c", lora_scale=0.5)
    base = runner.submit(prompt)
    runner.wait([half, base])
    assert half.num_cached_tokens == 0 and base.num_cached_tokens == 0
    half_model, _ = merged_model(tiny_model, [adapters["c"]], [0.5])
    assert half.output == greedy_tokens(half_model, prompt, MAX_TOKENS)
    assert base.output == reference(models, None, prompt)
    again = runner.submit(prompt, "c", lora_scale=0.5)  # its own entry now
    runner.wait([again])
    assert again.num_cached_tokens == len(prompt) - 1 and again.output == half.output


def test_a_reloaded_adapter_never_sees_its_old_versions_entries(runner, models, adapters, tiny_model):
    tok = runner.loaded.tokenizer
    prompt = tok.encode("Is the harbour open tonight? " * 4)
    runner.add("swap", read_adapter(adapters["a"]))
    assert runner.run(prompt, "swap") == reference(models, "a", prompt)
    seq = runner.submit(prompt, "swap")
    runner.wait([seq])
    assert seq.num_cached_tokens == len(prompt) - 1  # version 1 hits its own entry
    runner.add("swap", read_adapter(adapters["b"]))  # the same name and slot, version 2
    seq = runner.submit(prompt, "swap")
    runner.wait([seq])
    assert seq.num_cached_tokens == 0
    assert seq.output == reference(models, "b", prompt)


def test_the_byte_budget_evicts_and_frees_the_arrays(tiny_model, models):
    small = EngineRunner(tiny_model, max_tokens=MAX_TOKENS, prompt_cache_bytes=1)
    per_token = small.engine.call(lambda: small.engine.runner.kv_cost.per_token).result(timeout=30)
    small.stop()
    budget = 150 * per_token  # room for about two of these prompts with their outputs
    r = EngineRunner(tiny_model, max_tokens=MAX_TOKENS, prompt_cache_bytes=budget)
    try:
        tok = r.loaded.tokenizer
        prompts = [tok.encode(f"{i} " + SYSTEM) for i in range(4)]  # no common prefix
        for p in prompts:
            assert r.run(p) == reference(models, None, p)
        stats = r.engine.snapshot.prompt_cache
        assert stats.bytes <= budget and stats.evictions >= 2
        assert cache_state(r) == (stats.entries, stats.entries)
        first = r.submit(prompts[0])  # evicted, so computed again, and still exact
        last = r.submit(prompts[-1])  # still held
        r.wait([first, last])
        assert first.num_cached_tokens == 0 and last.num_cached_tokens == len(prompts[-1]) - 1
        assert first.output == reference(models, None, prompts[0])
    finally:
        r.stop()


def test_zero_bytes_turns_the_cache_off(tiny_model, models):
    r = EngineRunner(tiny_model, max_tokens=MAX_TOKENS, prompt_cache_bytes=0)
    try:
        prompt = chat(r.loaded.tokenizer, QUESTIONS[0])
        outs = [r.submit(prompt) for _ in range(2)]
        r.wait(outs)
        assert all(s.num_cached_tokens == 0 and s.output == reference(models, None, prompt) for s in outs)
        assert r.engine.call(lambda: r.engine.scheduler.prompt_cache).result(timeout=30) is None
        assert not r.engine.snapshot.prompt_cache.enabled
    finally:
        r.stop()


def test_what_a_snapshot_takes_is_measured_per_kind_of_cache(tiny_model):
    """Full layers' bytes per token and each sliding window's, measured on the model;
    None for a cache that is not keys and values (recurrent state)."""
    import mlx.core as mx
    import mlx.nn as nn
    from mlx_lm.models.cache import ArraysCache, KVCache, RotatingKVCache

    from mola.engine.kv_store import kv_cost, measured_caches

    class Routing:
        def set(self, *args):
            pass

    class Layered(nn.Module):  # two full layers and one of a 4-token window, 2 heads of 3
        def make_cache(self):
            return [KVCache(), RotatingKVCache(max_size=4), KVCache()]

        def __call__(self, x, cache):
            kv = mx.zeros((1, 2, x.shape[1], 3))
            for c in cache:
                c.update_and_fetch(kv, kv)
            return kv

    class Recurrent(Layered):
        def make_cache(self):
            return [KVCache(), ArraysCache(2)]

    class Sinks(Layered):  # a window that keeps its first tokens too
        def make_cache(self):
            return [KVCache(), RotatingKVCache(max_size=4, keep=2)]

    cost = kv_cost(measured_caches(Layered(), Routing()))
    assert (cost.per_token, cost.windows) == (2 * 2 * 2 * 3 * 4, ((4, 2 * 2 * 3 * 4),))
    # refused by their kinds, before any pass reads them
    assert kv_cost(Recurrent().make_cache()) is None and kv_cost(Sinks().make_cache()) is None
