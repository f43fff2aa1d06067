"""Prompts checked against the context length without tokenizing much more
than it holds, on two tokenizer lanes (mola/server/prompts.py): against the
tokenizer run on the whole text, and through the app in process over a
scripted engine (the tokenizer lanes are real; no model runs)."""

from __future__ import annotations

import asyncio
import contextlib
import random
import threading
import time

import pytest
from mlx_lm import load

from mola.errors import ContextLengthExceeded
from mola.server.metrics import rss_bytes
from mola.frontend.prompts import (LONG_PROMPT_CHARS, PROBE_CHARS_PER_TOKEN, PromptLanes, encode_within,
                                   max_token_chars)
from mola.demo.tokenizer import CORPUS

from helpers.scripted import InProcessServer, tokenizer_model


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    return load(str(tiny_model))[1]


def counted(tokenizer):
    """tokenizer.encode, recording the length of every text it is given."""
    calls = []

    def encode(text):
        calls.append(len(text))
        return tokenizer.encode(text)
    return encode, calls


def test_max_token_chars_is_the_longest_token(tokenizer):
    vocab = tokenizer.get_vocab()
    longest = max(vocab, key=len)
    assert max_token_chars(tokenizer) == len(longest) and vocab[longest] in tokenizer.encode(longest)
    assert all(len(tokenizer.decode([i])) <= max_token_chars(tokenizer) for i in vocab.values())


def test_the_character_bound_refuses_without_tokenizing(tokenizer):
    encode, calls = counted(tokenizer)
    m = max_token_chars(tokenizer)
    with pytest.raises(ContextLengthExceeded, match=f"maximum context length is 100 tokens.*at least {m * 100 // m + 1}"):
        encode_within(encode, "x" * (100 * m + 1), 100, m, "prompt")
    assert calls == []
    text = "x" * (100 * m) + " " * 50_000  # whitespace does not count towards the bound
    with pytest.raises(ContextLengthExceeded):
        encode_within(encode, text, 100, m, "prompt")
    assert calls and max(calls) <= (100 + 32) * PROBE_CHARS_PER_TOKEN  # the probe did it, on a prefix


def test_a_long_text_is_refused_on_a_bounded_prefix(tokenizer):
    """With a vocabulary of long tokens (max_chars 1000, as real ones have)
    the bound lets a 1 MB text through; only a prefix of it is tokenized."""
    text = (CORPUS.read_text() + "\n") * (1_000_000 // len(CORPUS.read_text()) + 1)
    encode, calls = counted(tokenizer)
    with pytest.raises(ContextLengthExceeded, match="in its first"):
        encode_within(encode, text, 2048, 1000, "prompt")
    # The work done, not the time it took: under 2% of the text was tokenized.
    assert sum(calls) <= (2048 + 64) * PROBE_CHARS_PER_TOKEN < len(text) / 50


def random_text(rng, words, size):
    parts = []
    while sum(map(len, parts)) < size:
        word = rng.choice(words) * (rng.randrange(20, 200) if rng.random() < 0.02 else 1)  # a few long ones
        parts.append(word + " " * rng.choice([1, 1, 1, 2, 5]) + ("\n" if rng.random() < 0.1 else ""))
    return "".join(parts)


@pytest.mark.parametrize("text", ["a " + "b" * 100_000, "b" * 100_000, " " * 50_000 + "b" * 50_000,
                                  ("word " * 10 + "x" * 3000 + " ") * 30])
def test_prefixes_grow_over_long_words(tokenizer, text):
    """Texts with whitespace in odd places: the prefixes still grow (each at
    least twice the last), and the answer is the tokenizer's own."""
    encode, calls = counted(tokenizer)
    reference = tokenizer.encode(text)
    try:
        assert encode_within(encode, text, 64, 1000, "prompt", probe_chars=1) == reference
    except ContextLengthExceeded:
        assert len(reference) > 64
    assert len(calls) <= 20 and all(b > a for a, b in zip(calls, calls[1:]))


def test_never_refuses_what_fits_and_returns_the_tokenizers_own_tokens(tokenizer):
    """Texts with limits around their token counts, probed from a prefix of
    one character per token of the limit: a refusal only when the whole text
    holds more than the limit, otherwise exactly the tokenizer's own tokens
    for the whole text."""
    rng = random.Random(0)
    words = CORPUS.read_text().split()
    on_a_prefix = returned_after_probing = 0
    for _ in range(300):
        text = random_text(rng, words, rng.randrange(200, 2400))
        reference = tokenizer.encode(text)
        near = len(reference) + rng.randint(-60, 40)
        limit = max(1, near if rng.random() < 0.5 else int(len(reference) * rng.uniform(0.2, 0.9)))
        encode, calls = counted(tokenizer)
        try:
            tokens = encode_within(encode, text, limit, 1000, "prompt", probe_chars=1)
        except ContextLengthExceeded:
            assert len(reference) > limit, (limit, len(reference), text)
            on_a_prefix += max(calls) < len(text)
        else:
            assert tokens == reference
            returned_after_probing += len(calls) > 1
    assert on_a_prefix > 30 and returned_after_probing > 30, (on_a_prefix, returned_after_probing)


def test_lane_choice_by_size(server_with_lanes):
    prompts = server_with_lanes.state.prompts
    from mola.frontend.spec import PromptSpec

    small = PromptSpec(messages=[{"role": "user", "content": "Hi"}])
    big = PromptSpec(texts=["x" * LONG_PROMPT_CHARS, "y"])
    assert asyncio.run(prompts.lane(small.chars())) is prompts.short
    assert asyncio.run(prompts.lane(big.chars())) is prompts.long
    assert prompts.long[0] is not prompts.short[0]  # its own copy of the tokenizer, down to the Rust one
    assert prompts.long[0]._tokenizer._tokenizer is not prompts.short[0]._tokenizer._tokenizer
    assert prompts.long[0].encode("hello world") == prompts.short[0].encode("hello world")


class Copied:
    """A tokenizer stand-in that records which thread deep-copied it (or fails to be copied)."""

    def __init__(self, fails=False):
        self.fails, self.copied_on = fails, []

    def get_vocab(self):
        return {"ab": 0}

    def __deepcopy__(self, memo):
        self.copied_on.append(threading.current_thread().name)
        if self.fails:
            raise TypeError("not copyable")
        return Copied()


def test_the_long_lanes_copy_is_made_for_the_first_long_prompt_on_the_short_lanes_thread():
    tok = Copied()
    lanes = PromptLanes(tok, 10, None)
    try:
        assert asyncio.run(lanes.lane(LONG_PROMPT_CHARS)) is lanes.short and tok.copied_on == []  # not at start
        tokenizer, thread = asyncio.run(lanes.lane(LONG_PROMPT_CHARS + 1))
        assert tok.copied_on[0].startswith("mola-tokenizer_") and isinstance(tokenizer, Copied)
        assert tokenizer is not tok and thread is not lanes.short[1]
        assert asyncio.run(lanes.lane(LONG_PROMPT_CHARS + 1)) == (tokenizer, thread) and len(tok.copied_on) == 1
    finally:
        lanes.close()


def test_a_tokenizer_that_cannot_be_copied_leaves_one_lane_for_all():
    lanes = PromptLanes(Copied(fails=True), 10, None)
    try:
        assert asyncio.run(lanes.lane(LONG_PROMPT_CHARS + 1)) is lanes.short and lanes.long is lanes.short
    finally:
        lanes.close()


@pytest.fixture(scope="module")
def server_with_lanes(tiny_model):
    # A context of 200k tokens, so that a prompt of a million characters is tokenized whole
    # (then refused for its length) rather than refused on a prefix.
    handle = InProcessServer(tokenizer_model(tiny_model), served_model_name="tiny", max_model_len=200_000,
                             max_request_bytes=16 << 20)
    yield handle
    handle.stop()


def small_chat(c):
    t0 = time.perf_counter()
    r = c.post("/v1/chat/completions", json={"model": "tiny", "max_tokens": 2,
                                              "messages": [{"role": "user", "content": "Hi"}]})
    assert r.status_code == 200
    return time.perf_counter() - t0


def test_a_blocked_long_lane_does_not_hold_up_short_prompts(server_with_lanes):
    state = server_with_lanes.state
    release = threading.Event()
    state.prompts.long[1].submit(release.wait, 30)  # the long lane is busy until released
    result = {}
    big = threading.Thread(target=lambda: result.setdefault("r", server_with_lanes.client(timeout=60).post(
        "/v1/completions", json={"model": "tiny", "prompt": "hello " * LONG_PROMPT_CHARS, "max_tokens": 1_000_000})))
    big.start()
    try:
        with server_with_lanes.client(timeout=20) as c:
            for _ in range(3):
                small_chat(c)
        assert big.is_alive()  # still waiting for the long lane
    finally:
        release.set()
        big.join(60)
    assert result["r"].status_code == 400 and "1000000 in the completion" in result["r"].text  # tokenized, then refused


@contextlib.contextmanager
def tokenizing(prompts):
    """An event set when the long lane's tokenizer is first used (a large
    prompt is being tokenized), for the time of the block."""
    started = threading.Event()
    lane = prompts.long

    class Signalling:
        def __getattr__(self, name):
            started.set()
            return getattr(lane[0], name)

    prompts.long = (Signalling(), lane[1])
    try:
        yield started
    finally:
        prompts.long = lane


@pytest.mark.slow
def test_small_requests_while_large_prompts_are_tokenized(server_with_lanes):
    """Two prompts of a million characters each keep the long lane busy for
    a second or more; small requests meanwhile take about what they take alone."""
    big_prompt = "".join(random.Random(1).choices("abcdefghijklmnopqrstuvwxyz0123456789", k=1_000_000))
    with server_with_lanes.client(timeout=60) as c:
        alone = sorted(small_chat(c) for _ in range(5))[2]
        done = []

        def big():
            with server_with_lanes.client(timeout=120) as own:
                r = own.post("/v1/completions", json={"model": "tiny", "prompt": big_prompt})
            assert r.status_code == 400 and "maximum context length" in r.text  # tokenized whole, then refused
            done.append(time.perf_counter())

        bigs = [threading.Thread(target=big) for _ in range(2)]
        with tokenizing(server_with_lanes.state.prompts) as started:
            for t in bigs:
                t.start()
            assert started.wait(60), "no large prompt reached the long lane"
        loaded = [small_chat(c) for _ in range(5)]
        small_done = time.perf_counter()
        for t in bigs:
            t.join(120)
    print(f"small request alone {alone * 1e3:.0f} ms, while large prompts are tokenized "
          f"{min(loaded) * 1e3:.0f}-{max(loaded) * 1e3:.0f} ms; large ones done "
          f"{max(done) - small_done:.2f} s after the small ones")
    assert len(done) == 2 and small_done < max(done), "the large prompts were not still being tokenized"
    assert max(loaded) < 5 * alone + 1.0, (alone, loaded)


def test_a_huge_prompt_is_refused_fast_without_growing_memory(tiny_model):
    handle = InProcessServer(tokenizer_model(tiny_model), served_model_name="tiny", max_request_bytes=16 << 20)
    rng = random.Random(2)
    texts = {"letters": "".join(rng.choice("abcdefghij klmnopqrstuvwxyz") for _ in range(6_000_000)),
             "whitespace": " \n" * 3_000_000}
    peak = {"rss": 0}
    stop = threading.Event()

    def sample():  # the peak RSS while a request is refused, sampled every 5 ms
        while not stop.is_set():
            peak["rss"] = max(peak["rss"], rss_bytes())
            stop.wait(0.005)

    try:
        with handle.client(timeout=120) as c:
            small_chat(c)
            for kind, text in texts.items():
                body = {"model": "tiny", "messages": [{"role": "user", "content": text}]}
                before = peak["rss"] = rss_bytes()
                sampler = threading.Thread(target=sample)
                sampler.start()
                t0 = time.perf_counter()
                r = c.post("/v1/chat/completions", json=body)
                seconds = time.perf_counter() - t0
                stop.set()
                sampler.join()
                stop.clear()
                assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text
                message = r.json()["error"]["message"]
                assert "maximum context length is 2048 tokens" in message
                print(f"{kind}: refused in {seconds:.2f} s, peak RSS +{(peak['rss'] - before) / 2**20:.0f} MiB")
                # Refused on what the work shows, not on a clock: by the character bound, or on a
                # prefix (the whole text was never tokenized).
                assert "no token is longer" in message or "in its first" in message, (kind, message)
                assert peak["rss"] - before < 200 * 2**20, kind  # the request itself holds ~30 MB of copies
    finally:
        handle.stop()
