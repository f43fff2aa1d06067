"""The prompt cache's bookkeeping, plain Python (mola/engine/prompt_cache.py),
against a naive model of it: a list of (key, tokens) entries in LRU order,
searched by brute force."""

from __future__ import annotations

import random

import pytest

from mola.engine.prompt_cache import KVCost, PrefixHit, PromptCache

BASE = (("", 0), 1.0)
A1 = (("a", 1), 1.0)


def common(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


class Naive:
    """Entries in LRU order (oldest first); the longest common prefix with any
    entry of the key is the hit (PromptTrie's 'shorter' ignores entries of one
    token, so they are never stored here)."""

    def __init__(self, max_bytes, per_token):
        self.max_bytes, self.per_token = max_bytes, per_token
        self.entries: list[tuple[tuple, list[int]]] = []

    def longest(self, key, tokens) -> int:
        return max((common(t, tokens) for k, t in self.entries if k == key), default=0)

    def use(self, key, tokens) -> None:
        """The entry (key, tokens) moves to the end of the LRU order."""
        self.entries.remove((key, tokens))
        self.entries.append((key, tokens))

    def store(self, key, tokens, covering: list[int] | None) -> bool:
        """``covering``: the entry the cache uses when several cover ``tokens``."""
        if self.longest(key, tokens) == len(tokens):  # covered: the covering entry is used
            assert covering is not None and covering[: len(tokens)] == tokens
            self.use(key, covering)
            return False
        if len(tokens) * self.per_token > self.max_bytes:
            return False
        self.entries = [(k, t) for k, t in self.entries
                        if not (k == key and len(t) < len(tokens) and tokens[:len(t)] == t)]
        self.entries.append((key, list(tokens)))
        while sum(len(t) for _, t in self.entries) * self.per_token > self.max_bytes:
            self.entries.pop(0)
        return True


def test_longest_prefix_including_inside_a_longer_entry():
    cache = PromptCache(max_bytes=10_000, cost=10)
    first, _ = cache.store(BASE, [1, 2, 3, 4, 5, 6])
    assert cache.peek(BASE, [1, 2, 3, 4, 5, 6]).num_tokens == 6  # exact
    assert cache.peek(BASE, [1, 2, 3, 4, 5, 6, 7, 8]).num_tokens == 6  # the entry is a prefix
    hit = cache.peek(BASE, [1, 2, 3, 9, 9])  # diverges inside the entry: cut at 3
    assert (hit.entry, hit.num_tokens) == (first, 3)
    assert cache.peek(BASE, [1, 2, 3]).num_tokens == 3  # a prefix of the entry
    assert cache.peek(BASE, [7, 1, 2]) is None
    assert cache.peek(A1, [1, 2, 3, 4, 5, 6]) is None  # another identity shares nothing
    assert cache.peek((("", 0), 0.5), [1, 2, 3]) is None  # nor another scale


def test_prefixes_are_replaced_and_covered_tokens_not_stored_again():
    cache = PromptCache(max_bytes=10_000, cost=10)
    short, _ = cache.store(BASE, [1, 2, 3])
    long, dropped = cache.store(BASE, [1, 2, 3, 4, 5])
    assert dropped == [short] and cache.num_entries == 1 and cache.nbytes == 50
    assert cache.store(BASE, [1, 2, 3, 4]) == (None, [])  # the long entry covers it
    branch, dropped = cache.store(BASE, [1, 2, 7])
    assert dropped == [] and cache.num_entries == 2 and cache.nbytes == 80
    assert cache.peek(BASE, [1, 2, 7, 8]).entry == branch
    assert cache.peek(BASE, [1, 2, 3, 4, 9]).entry == long


def test_lru_eviction_keeps_the_budget_and_counts():
    cache = PromptCache(max_bytes=100, cost=10)
    a, _ = cache.store(BASE, [1] * 4)
    b, _ = cache.store(BASE, [2] * 4)
    cache.use(cache.peek(BASE, [1, 1, 1, 1, 5]))  # a is used: b is now the oldest
    c, dropped = cache.store(BASE, [3] * 4)
    assert dropped == [b] and cache.nbytes == 80
    assert cache.store(BASE, [4] * 11) == (None, [])  # larger than the whole budget
    cache.use(None)
    s = cache.stats()
    assert (s.entries, s.bytes, s.hits, s.misses, s.cached_tokens, s.evictions) == (2, 80, 1, 1, 4, 1)


def test_retired_adapters_are_dropped_and_never_stored_again():
    cache = PromptCache(max_bytes=10_000, cost=1)
    kept, _ = cache.store(BASE, [1, 2, 3])
    gone = {cache.store(A1, [1, 2, 3])[0], cache.store((("a", 1), 0.5), [1, 2, 3])[0]}
    assert set(cache.retire({("a", 1)})) == gone
    assert cache.peek(A1, [1, 2, 3]) is None and cache.peek(BASE, [1, 2, 3]).entry == kept
    assert cache.store(A1, [1, 2, 3, 4]) == (None, [])  # a request still running on it
    assert cache.store((("a", 2), 1.0), [1, 2, 3])[0] is not None  # the next version is new
    assert len(cache.clear()) == 2 and cache.nbytes == 0 and cache.num_entries == 0


@pytest.mark.parametrize("seed", range(4))
def test_random_traffic_matches_the_naive_model(seed):
    rng = random.Random(seed)
    per_token, budget = 4, 4 * 60
    cache, naive = PromptCache(budget, per_token), Naive(budget, per_token)
    keys = [BASE, A1, (("a", 1), 0.5)]
    stems = [[rng.randrange(5) for _ in range(rng.randrange(2, 12))] for _ in range(5)]
    for _ in range(300):
        key = rng.choice(keys)
        tokens = rng.choice(stems)[: rng.randrange(2, 13)] + [rng.randrange(5) for _ in range(rng.randrange(6))]
        if len(tokens) < 2:
            continue
        hit = cache.peek(key, tokens)
        assert (hit.num_tokens if hit else 0) == naive.longest(key, tokens), tokens
        if hit is not None and rng.random() < 0.5:
            cache.use(hit)
            naive.use(key, _tokens_of(cache, hit.entry))
        if rng.random() < 0.6:
            covering = _tokens_of(cache, hit.entry) if hit is not None else None
            entry, _ = cache.store(key, tokens)
            assert (entry is not None) == naive.store(key, tokens, covering)
        assert cache.nbytes == sum(len(t) for _, t in naive.entries) * per_token <= budget
        assert cache.num_entries == len(naive.entries)


def _tokens_of(cache: PromptCache, entry: int) -> list[int]:
    return cache._lru[entry].tokens


# ---- caches that cannot be cut (sliding windows) ----------------------------

WINDOWED = KVCost(per_token=10, windows=((4, 3),))  # 10 bytes a token, and 3 for each of a window's last 4


def test_what_a_windowed_entry_takes():
    assert [WINDOWED.nbytes(n) for n in (0, 1, 4, 9)] == [0, 13, 52, 102]
    assert not WINDOWED.can_cut and KVCost(10).can_cut


def test_uncuttable_entries_serve_only_prompts_they_are_a_whole_prefix_of():
    cache = PromptCache(max_bytes=10_000, cost=WINDOWED)
    prompt, _ = cache.store(BASE, [1, 2, 3, 4], held=4)
    answer, dropped = cache.store(BASE, [1, 2, 3, 4, 5, 6], held=6)
    assert dropped == [] and cache.num_entries == 2  # the prompt's entry stays: the answer's cannot serve it
    assert cache.nbytes == WINDOWED.nbytes(4) + WINDOWED.nbytes(6)
    assert cache.peek(BASE, [1, 2, 3, 4, 5, 6, 7]) == PrefixHit(answer, 6)
    assert cache.peek(BASE, [1, 2, 3, 4, 9]) == PrefixHit(prompt, 4)  # diverges inside the answer's
    assert cache.peek(BASE, [1, 2, 3]) is None  # inside the prompt's: it cannot be cut
    assert cache.peek(BASE, [1, 2, 3, 4, 5, 6]) == PrefixHit(answer, 6)  # exact
    assert cache.store(BASE, [1, 2], held=5) == (None, [])  # fewer tokens than the row holds
    assert cache.store(BASE, [1, 2, 3, 4, 5, 6], held=6) == (None, [])  # already there


class NaiveWhole(Naive):
    """Caches that cannot be cut: the hit is the longest entry the tokens start
    with; an entry is stored unless the same tokens are; none is dropped for another."""

    def longest(self, key, tokens) -> int:
        return max((len(t) for k, t in self.entries if k == key and tokens[:len(t)] == t), default=0)

    def store(self, key, tokens, covering) -> bool:
        if (key, tokens) in self.entries:
            self.use(key, tokens)
            return False
        if WINDOWED.nbytes(len(tokens)) > self.max_bytes:
            return False
        self.entries.append((key, list(tokens)))
        while sum(WINDOWED.nbytes(len(t)) for _, t in self.entries) > self.max_bytes:
            self.entries.pop(0)
        return True


@pytest.mark.parametrize("seed", range(4))
def test_uncuttable_random_traffic_matches_the_naive_model(seed):
    rng = random.Random(seed)
    budget = WINDOWED.nbytes(60)
    cache, naive = PromptCache(budget, WINDOWED), NaiveWhole(budget, 0)
    stems = [[rng.randrange(5) for _ in range(rng.randrange(2, 12))] for _ in range(5)]
    for _ in range(300):
        key = rng.choice([BASE, A1])
        tokens = rng.choice(stems)[: rng.randrange(2, 13)] + [rng.randrange(5) for _ in range(rng.randrange(6))]
        if len(tokens) < 2:
            continue
        hit = cache.peek(key, tokens)
        assert (hit.num_tokens if hit else 0) == naive.longest(key, tokens), tokens
        if hit is not None:
            assert _tokens_of(cache, hit.entry) == tokens[:hit.num_tokens]  # served whole
            if rng.random() < 0.5:
                cache.use(hit)
                naive.use(key, _tokens_of(cache, hit.entry))
        if rng.random() < 0.6:
            entry, _ = cache.store(key, tokens, held=len(tokens))
            assert (entry is not None) == naive.store(key, tokens, None)
        assert cache.nbytes == sum(WINDOWED.nbytes(len(t)) for _, t in naive.entries) <= budget
        assert cache.num_entries == len(naive.entries)


def test_a_model_whose_state_cannot_be_snapshotted_starts_without_a_cache(caplog):
    from mola.engine.prompt_cache import make_prompt_cache

    with caplog.at_level("WARNING", logger="mola.engine"):
        assert make_prompt_cache(1 << 20, None, "m") is None
    assert "prompt cache off" in caplog.text
    assert make_prompt_cache(0, KVCost(10), "m") is None  # turned off
    assert make_prompt_cache(1 << 20, WINDOWED, "m").cost == WINDOWED
