"""The prompt cache's bookkeeping, in plain Python: which token prefixes have
KV state stored, under which identity, how many bytes they take, and what to
evict. The KV arrays themselves live with the runner (mola.engine.kv_store),
by entry id; this side never touches an array, so the scheduler can ask it
how much of a prompt is cached while it plans a step.

An entry is keyed by its identity -- (the base model, the adapter's name and
version or a stack's key of parts' versions and scales, the row's
lora_scale) -- and by its tokens, in mlx-lm's own token trie (PromptTrie, one
trie per identity). KV state of a longer entry serves any prefix of it, so a
prompt that diverges inside a cached segment reuses the common part, and an
entry that another one extends is dropped. Entries are evicted least recently
used first when their bytes pass the budget; an entry's bytes are what its
tokens take in this model's caches (KVCost).

A model with sliding-window layers (mlx-lm's RotatingKVCache: Gemma 2 and 3,
gpt-oss, Cohere 2) keeps only the window's last tokens in those layers, so
its state cannot be cut back at a token: an entry then serves only prompts it
is a whole prefix of (the rest is prefilled on top of it), an entry is stored
only when the row's cache holds exactly its tokens (the end of a prompt, the
end of an answer), and an entry that another one extends is kept, since the
longer one cannot serve it.
"""

from __future__ import annotations

import itertools
import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Hashable

from mlx_lm.models.cache import PromptTrie

log = logging.getLogger("mola.engine")

# (base model, adapter key, lora_scale): the model's key, then Sequence.cache_key
Identity = tuple[Hashable, ...]


@dataclass(frozen=True)
class KVCost:
    """What a model's KV state of n tokens takes: ``per_token`` bytes for the
    layers that keep every token, and per sliding window (its size, bytes per
    token) for the layers that keep at most that many."""

    per_token: int
    windows: tuple[tuple[int, int], ...] = ()

    def nbytes(self, num_tokens: int) -> int:
        return num_tokens * self.per_token + sum(min(num_tokens, w) * b for w, b in self.windows)

    @property
    def can_cut(self) -> bool:
        """The state of n tokens holds the state of each of its prefixes."""
        return not self.windows


@dataclass(frozen=True)
class PrefixHit:
    """The longest cached prefix of a prompt: ``num_tokens`` tokens of entry ``entry``."""

    entry: int
    num_tokens: int


@dataclass(frozen=True)
class PromptCacheStats:
    """What the cache holds and has done (a copy, published in the engine's snapshot)."""

    enabled: bool = False
    max_bytes: int = 0
    bytes: int = 0  # KV bytes of the entries held
    entries: int = 0
    hits: int = 0  # prompts that reused a cached prefix
    misses: int = 0  # prompts that found none (prompts of one token are not looked up)
    cached_tokens: int = 0  # prompt tokens not prefilled thanks to the cache
    stored: int = 0  # entries written
    evictions: int = 0  # entries dropped for the byte budget

    def describe(self) -> dict:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


@dataclass
class _Entry:
    id: int
    identity: Identity
    tokens: list[int]
    nbytes: int


@dataclass
class _Counts:
    hits: int = 0
    misses: int = 0
    cached_tokens: int = 0
    stored: int = 0
    evictions: int = 0


def make_prompt_cache(max_bytes: int, cost: KVCost | None, model_key: Hashable) -> PromptCache | None:
    """The engine's prompt cache: None with ``max_bytes`` 0, or (with a
    warning) for a model whose KV state cannot be snapshotted (recurrent
    state), whose ``cost`` the runner leaves None."""
    if max_bytes == 0:
        return None
    if cost is None:
        log.warning("prompt cache off: this model's KV caches cannot be snapshotted "
                    "(recurrent state or another cache than keys and values)")
        return None
    if not cost.can_cut:
        log.info("prompt cache: sliding windows (%s tokens) cannot be cut at a token, so entries serve "
                 "prompts they are a whole prefix of", ", ".join(str(w) for w, _ in cost.windows))
    return PromptCache(max_bytes, cost, model_key)


class PromptCache:
    """Token prefixes with KV state stored, by identity; LRU within a byte budget."""

    def __init__(self, max_bytes: int, cost: KVCost | int, model_key: Hashable = ""):
        """``cost``: what entries take (an int: bytes per token of caches that can be cut)."""
        cost = cost if isinstance(cost, KVCost) else KVCost(cost)
        if max_bytes < 1 or cost.nbytes(1) < 1:
            raise ValueError(f"a prompt cache needs max_bytes and bytes per token >= 1, got "
                             f"{max_bytes} and {cost.nbytes(1)}")
        self.max_bytes = max_bytes
        self.cost = cost
        self.model_key = model_key  # the base model: one more part of every identity
        self.nbytes = 0
        self._trie = PromptTrie()  # identity -> tokens -> entry id
        self._lru: OrderedDict[int, _Entry] = OrderedDict()  # least recently used first
        self._ids = itertools.count(1)
        self._retired: set = set()  # adapter keys unloaded: never stored again
        self._counts = _Counts()

    def _identity(self, key: tuple) -> Identity:
        """A sequence's cache_key, (adapter key, lora_scale), under this base model."""
        return (self.model_key, *key)

    @property
    def num_entries(self) -> int:
        return len(self._lru)

    # ---- lookups ---------------------------------------------------------------

    def peek(self, key: tuple, tokens: list[int]) -> PrefixHit | None:
        """The longest prefix of ``tokens`` with KV state stored under ``key``
        (a Sequence.cache_key), or None; changes nothing (see :meth:`use`).
        With caches that cannot be cut, only a whole entry is a hit."""
        if not tokens:
            return None
        identity = self._identity(key)
        found = self._trie.search(identity, tokens)
        best, length = None, 0
        if found.exact is not None:
            best, length = found.exact, len(tokens)
        else:
            # A longer entry shares `common_prefix` tokens (its KV is cut
            # there); a shorter one is a prefix of the prompt in full.
            if found.longer is not None and found.common_prefix > 0 and self.cost.can_cut:
                best, length = found.longer, found.common_prefix
            if found.shorter is not None and len(found.shorter) > length:
                best, length = found.shorter, len(found.shorter)
        if best is None:
            return None
        return PrefixHit(self._trie.get(identity, best), length)

    def use(self, hit: PrefixHit | None) -> None:
        """Count a lookup whose result a prompt goes on with."""
        c = self._counts
        if hit is None:
            c.misses += 1
            return
        c.hits += 1
        c.cached_tokens += hit.num_tokens
        self._lru.move_to_end(hit.entry)

    # ---- storing and evicting --------------------------------------------------

    def store(self, key: tuple, tokens: list[int], held: int | None = None) -> tuple[int | None, list[int]]:
        """Make an entry for ``tokens`` under ``key``: returns its id (None
        when nothing is to be stored) and the ids of the entries evicted to make
        room or made redundant by it. Stored KV must then be put under that id.
        ``held``: the tokens the row's cache holds (None: ``tokens``).

        Nothing is stored for an unloaded adapter, for tokens an entry already
        covers (that entry is used instead), past the budget in one entry, or,
        with caches that cannot be cut, for fewer tokens than the row holds."""
        if not tokens or key[0] in self._retired:
            return None, []
        if not self.cost.can_cut and held is not None and held != len(tokens):
            return None, []
        identity = self._identity(key)
        nbytes = self.cost.nbytes(len(tokens))
        covering = self.peek(key, tokens)
        if covering is not None and covering.num_tokens == len(tokens):
            self._lru.move_to_end(covering.entry)
            return None, []
        if nbytes > self.max_bytes:
            return None, []
        entry = _Entry(next(self._ids), identity, list(tokens), nbytes)
        self._trie.add(identity, entry.tokens, entry.id)
        self._lru[entry.id] = entry
        self.nbytes += nbytes
        self._counts.stored += 1
        # Entries that are prefixes of this one take space for nothing, when it
        # can be cut to serve them (pop_prefixes takes them out of the trie).
        dropped = [self._forget(self._lru[i]) for _, i in self._trie.pop_prefixes(identity, entry.tokens)] \
            if self.cost.can_cut else []
        while self.nbytes > self.max_bytes:
            oldest = next(iter(self._lru.values()))
            dropped.append(self._evict(oldest))
            self._counts.evictions += 1
        return entry.id, dropped

    def retire(self, adapter_keys: set) -> list[int]:
        """Drop every entry of these adapters (unloaded: their identities never
        come back) and store none for them again; returns the dropped ids."""
        self._retired |= set(adapter_keys)
        return self.drop(lambda identity: identity[1] in adapter_keys)

    def drop(self, which: Callable[[Identity], bool]) -> list[int]:
        return [self._evict(e) for e in list(self._lru.values()) if which(e.identity)]

    def clear(self) -> list[int]:
        """Drop everything (the runner lost its KV state); returns the ids."""
        return self.drop(lambda identity: True)

    def _evict(self, entry: _Entry) -> int:
        self._trie.pop(entry.identity, entry.tokens)
        return self._forget(entry)

    def _forget(self, entry: _Entry) -> int:
        del self._lru[entry.id]
        self.nbytes -= entry.nbytes
        return entry.id

    def stats(self) -> PromptCacheStats:
        c = self._counts
        return PromptCacheStats(
            enabled=True, max_bytes=self.max_bytes, bytes=self.nbytes, entries=len(self._lru),
            hits=c.hits, misses=c.misses, cached_tokens=c.cached_tokens, stored=c.stored,
            evictions=c.evictions,
        )
