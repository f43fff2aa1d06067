"""The prompt cache on models with sliding-window layers (mola/engine/prompt_cache.py,
kv_store.py: mlx-lm's RotatingKVCache, which cannot be cut at a token), on the GGUF
twins of gemma3, gemma2, gpt-oss and cohere2: turn 2 of a conversation reuses turn 1's
prompt and answer, and answers exactly as the same engine with the prompt cache
off computes it from scratch, alone and in a mixed batch of adapters."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest

from helpers.engines import EngineRunner, together
from mola.testing.adapter import make_random_adapter
from mola.testing.gguf_model import save_gguf_model
from mola.testing.model import TinyModelSpec, make_tiny_model

# gemma3's tiny window is 8 tokens, cohere2's 5; gpt-oss's is set to 6 below (gemma2's
# layers keep every token in mlx-lm, its window caps the context at 64)
TYPES = ("gemma3_text", "gemma2", "gpt_oss", "cohere2")
LAYERS = {"cohere2": 4}  # mlx-lm's cohere2 runs no fewer layers than its period
FIRST = [1] + [(i * 37) % 480 + 20 for i in range(21)]  # a first prompt past the windows
USER = [[9, 30, 31, 32, 10], [9, 40, 41, 10]]  # the user's next turns
MAX_TOKENS = 6
ATOL = 1e-4  # float32 logprobs of the same tokens, summed in another order


@pytest.fixture(scope="module")
def twins(tmp_path_factory):
    """model_type -> (its GGUF twin, adapters {name: path})."""
    root = tmp_path_factory.mktemp("windows")
    out = {}
    for model_type in TYPES:
        model_dir = make_tiny_model(root / model_type, TinyModelSpec(
            model_type=model_type, norm_noise=0.3, num_hidden_layers=LAYERS.get(model_type, 2)))
        if model_type == "gpt_oss":
            config = json.loads((model_dir / "config.json").read_text())
            (model_dir / "config.json").write_text(json.dumps({**config, "sliding_window": 6}))
        adapters = {name: make_random_adapter(root / f"{model_type}-{name}", model_dir, rank=4, seed=seed)
                    for name, seed in (("a", 1), ("b", 2))}
        out[model_type] = save_gguf_model(root / f"{model_type}.gguf", model_dir), adapters
    return out


def start(twin, adapters, cache: bool, prefill_step_size: int = 8) -> EngineRunner:
    # small prefill steps: the prompts and their suffixes are chunked too
    return EngineRunner(twin, adapters=list(adapters.items()), max_tokens=MAX_TOKENS,
                        prefill_step_size=prefill_step_size, **({} if cache else {"prompt_cache_bytes": 0}))


def turns(runner: EngineRunner, adapter=None, num_turns: int = 3) -> list[tuple[list[int], list[float], int]]:
    """A conversation, each turn sent whole: per turn (output, logprobs, cached tokens)."""
    prompt, out = list(FIRST), []
    for turn in range(num_turns):
        seq = runner.submit(prompt, adapter, logprobs=0)
        runner.wait([seq])
        out.append((seq.output, [lp for lp, _ in runner.logprobs[seq.seq_id]], seq.num_cached_tokens))
        prompt = prompt + seq.output + USER[turn % len(USER)]
    return out


def assert_same(got, want) -> None:
    assert got[0] == want[0]
    np.testing.assert_allclose(got[1], want[1], rtol=0, atol=ATOL)


@pytest.mark.parametrize("model_type", TYPES)
def test_turn_two_from_the_cache_answers_as_with_the_cache_off(twins, model_type):
    twin, adapters = twins[model_type]
    off = start(twin, adapters, cache=False)
    try:
        want = {name: turns(off, name) for name in (None, "a")}
    finally:
        off.stop()
    on = start(twin, adapters, cache=True)
    try:
        cost = on.engine.call(lambda: on.engine.runner.kv_cost).result(timeout=30)
        assert bool(cost.windows) == (model_type != "gemma2")  # its snapshots cannot be cut
        for name in (None, "a"):
            got = turns(on, name)
            assert got[0][2] == 0
            for turn in (1, 2):  # the previous turn's prompt and answer, whole
                assert got[turn][2] == len(FIRST) + sum(len(o) + len(USER[t]) for t, (o, _, _) in
                                                        enumerate(got[:turn])) - len(USER[turn - 1])
                assert got[turn][2] > 0
            for g, w in zip(got, want[name]):
                assert_same(g, w)
        stats = on.engine.snapshot.prompt_cache
        assert stats.enabled and stats.hits >= 4 and stats.bytes <= stats.max_bytes
    finally:
        on.stop()


@pytest.mark.parametrize("model_type", ["gemma3_text", "gpt_oss", "cohere2"])
def test_mixed_batch_of_adapters_from_the_cache(twins, model_type):
    """Turn 2 of three identities' conversations, turn 1 again (its whole context
    cached: nothing to prefill) and a prompt the cache never saw, all in one prefill
    batch: cached states of several lengths merged with empty ones."""
    twin, adapters = twins[model_type]
    names = [None, "a", "b"]
    off = start(twin, adapters, cache=False)
    try:
        convs = {name: turns(off, name, num_turns=2) for name in names}
        fresh = [1] + [(i * 11) % 400 + 50 for i in range(13)]
        want_fresh = off.run(fresh, "b")
    finally:
        off.stop()
    on = start(twin, adapters, cache=True, prefill_step_size=128)  # every member in one prefill step
    try:
        firsts = {name: on.run(FIRST, name) for name in names}
        seconds = {name: FIRST + firsts[name] + USER[0] for name in names}
        seqs = together(on, lambda: [on.submit(seconds[n], n, logprobs=0) for n in names]
                        + [on.submit(FIRST, "a", logprobs=0), on.submit(fresh, "b")])
        on.wait(seqs)
        for name, seq in zip(names, seqs):
            assert seq.num_cached_tokens == len(FIRST) + len(firsts[name]), name
            assert_same((seq.output, [lp for lp, _ in on.logprobs[seq.seq_id]]), convs[name][1])
        again, new = seqs[-2:]
        assert again.num_cached_tokens == len(FIRST) - 1
        assert_same((again.output, [lp for lp, _ in on.logprobs[again.seq_id]]), convs["a"][0])
        assert new.num_cached_tokens == 0 and new.output == want_fresh
        assert on.engine.snapshot.stats.max_batch == 5
    finally:
        on.stop()


def test_a_prompt_diverging_inside_an_entry_is_computed_again(twins):
    """A sliding window cannot be cut back: an entry serves only prompts it is a
    whole prefix of; a prompt that leaves it earlier is a miss, and still exact."""
    twin, adapters = twins["gemma3_text"]
    on = start(twin, adapters, cache=True)
    try:
        first = on.run(FIRST)
        diverged = FIRST[:15] + [3, 4, 5]
        seq = on.submit(diverged)
        on.wait([seq])
        assert seq.num_cached_tokens == 0
        again = on.submit(FIRST + first + USER[0])
        on.wait([again])
        assert again.num_cached_tokens == len(FIRST) + len(first)
    finally:
        on.stop()
    off = start(twin, adapters, cache=False)
    try:
        assert off.run(diverged) == seq.output
        assert off.run(FIRST + first + USER[0]) == again.output
    finally:
        off.stop()


def test_the_server_reports_turn_two_cached_as_with_the_cache_off(twins):
    """/v1/completions on the gemma3 twin (prompts as token ids): turn 2 reports
    cached_tokens > 0 in its usage and answers as a server with the cache off."""
    import httpx

    from helpers.servers import start_server

    twin, _ = twins["gemma3_text"]
    answers = {}
    for cache in (True, False):
        server = start_server(model=str(twin), served_model_name="g3", **({} if cache else {"prompt_cache_bytes": 0}))
        try:
            with httpx.Client(base_url=server.url, timeout=120) as client:
                def complete(prompt):
                    r = client.post("/v1/completions", json={"model": "g3", "prompt": prompt, "temperature": 0,
                                                              "max_tokens": MAX_TOKENS, "ignore_eos": True})
                    assert r.status_code == 200, r.text
                    return r.json()
                first = complete(FIRST)
                second = complete(FIRST + USER[0] + FIRST[1:9])  # turn 2 starts with turn 1's prompt
                answers[cache] = first["choices"][0]["text"], second["choices"][0]["text"]
                cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
                assert cached == (len(FIRST) - 1 if cache else 0)
        finally:
            server.stop()
    assert answers[True] == answers[False]


def test_rows_preempted_by_the_kv_budget_come_back_from_the_cache(twins):
    """An optimistic KV budget that admits three rows and cannot hold them at their
    longest: preempted rows are stored, resumed from the cache (a whole prefix: the
    prompt and everything fed) and answer as with no budget and no cache."""
    from mola.engine.kv_budget import peak
    from mola.engine.scheduler import ADMISSION_HEADROOM

    twin, adapters = twins["gemma3_text"]
    rng = random.Random(3)
    prompt_tokens, max_tokens = 24, 24
    reqs = [([1] + [rng.randrange(20, 500) for _ in range(prompt_tokens - 1)], name,
             {"temperature": 0.9, "seed": i} if i % 2 else {}) for i, name in enumerate([None, "a", "b"] * 2)]

    def run_all(runner):
        seqs = together(runner, lambda: [runner.submit(p, name, max_tokens=max_tokens, **params)
                                         for p, name, params in reqs])
        return runner.wait(seqs, timeout=300)

    free = start(twin, adapters, cache=False)
    try:
        want = run_all(free)
        per_position = free.engine.call(lambda: free.engine.runner.kv_position_bytes).result(timeout=30)
    finally:
        free.stop()
    low = peak([(prompt_tokens, 2 + ADMISSION_HEADROOM)] * 3)
    high = peak([(prompt_tokens + max_tokens, 1)] * 3)
    r = EngineRunner(twin, adapters=list(adapters.items()), max_tokens=max_tokens, prefill_step_size=8,
                     kv_cache_bytes=(low + high) // 2 * per_position, kv_admission="optimistic")
    try:
        assert run_all(r) == want
        r.engine.call(lambda: None).result(timeout=30)  # the last step's snapshot is published by now
        snap = r.engine.snapshot
    finally:
        r.stop()
    assert snap.kv.preemptions >= 1
    assert snap.prompt_cache.hits >= snap.kv.preemptions  # each came back from its stored state
