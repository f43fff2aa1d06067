"""The prompt cache's KV arrays, held by the runner on the engine thread, by
the entry ids that mola.engine.prompt_cache hands out.

An entry is one sequence's mlx-lm KVCache per layer (of the target model,
and of the draft model when there is one), cut out of a batch cache with
BatchKVCache.extract and trimmed to the tokens it is stored under. A hit is
served as a view of an entry's first tokens, which BatchKVCache.merge copies
into the new prefill batch's cache: the stored arrays are never written to.

A sliding-window layer's entry is a RotatingKVCache (BatchRotatingKVCache.extract)
holding, in temporal order, the last min(tokens, window) tokens: exactly what
BatchRotatingKVCache.merge takes back, and all that later tokens attend to. It
is served whole (the prompt cache asks for no other length).
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache, RotatingKVCache

from ..errors import ModelLoadError
from .caches import ModelCaches, layer_caches
from .prompt_cache import KVCost
from .quantized_cache import RowQuantizedKVCache, triple_nbytes, view

FULL = (KVCache, RowQuantizedKVCache)  # caches that keep every token, cut at any


def measured_caches(model: nn.Module, routing, draft: nn.Module | None = None,
                    quant: tuple[int, int] | None = None) -> list:
    """``model``'s caches per layer (and the ``draft``'s; quantized when
    ``quant``, --kv-bits, is given) after a one-token forward pass: what
    kv_cost and kv_bytes_per_token read, measured once at start. The pass is
    never evaluated: the caches' shapes and dtypes, all that is read, are
    known from its graph (evaluating it read every weight: 1.7 s of a cached
    1.7B-shaped Q4_K_M start on a CPU)."""
    measured = []
    routing.set([0], [1.0])
    for m in (model, draft) if draft is not None else (model,):
        cache = layer_caches(m, quant)
        try:
            m(mx.array([[0]], dtype=mx.uint32), cache=cache)
        except ValueError as e:  # heads --kv-group-size does not divide
            if quant is None:
                raise
            raise ModelLoadError(f"--kv-bits {quant[0]} --kv-group-size {quant[1]} cannot quantize this "
                                 f"model's KV cache: {e}") from None
        measured += cache
    return measured


def kv_cost(caches: list) -> KVCost | None:
    """What KV state of n tokens takes in the ``caches`` (measured_caches):
    bytes per token of the caches that keep every token, and per sliding
    window its size and bytes per token; None when a cache is neither
    (recurrent state) or keeps its first tokens too (mlx-lm's batch of
    windows keeps none), so cannot be snapshotted."""
    if not caches or any(type(c) not in (*FULL, RotatingKVCache) or getattr(c, "keep", 0) for c in caches):
        return None
    full = kv_bytes_per_token(caches, only=FULL)
    windows = {size: kv_bytes_per_token(caches, only=(RotatingKVCache,), window=size)
               for size in sorted({c.max_size for c in caches if type(c) is RotatingKVCache})}
    return KVCost(full, tuple(windows.items()))


def kv_bytes_per_token(caches: list, only: tuple = (), window: int | None = None) -> int:
    """KV bytes one token takes in the ``caches`` (measured_caches: one
    position each): the bytes a position takes in every cache that has keys
    and values (a sliding window's counted as if it never wrapped: an upper
    bound), or in those of the types ``only`` (and of the sliding ``window``
    size) when given."""
    # keys, values: [1, H, capacity, D] (or a quantized triple of such)
    return sum((triple_nbytes(c.keys) + triple_nbytes(c.values)) // _positions(c.keys)
               for c in caches if getattr(c, "keys", None) is not None
               and (not only or type(c) in only) and (window is None or c.max_size == window))


def snapshot(cache, num_tokens: int):
    """One row's extracted cache cut back to its first ``num_tokens`` tokens;
    a sliding window's holds only the last min(num_tokens, window) of them."""
    extra = cache.offset - num_tokens
    assert extra >= 0, (cache.offset, num_tokens)
    if type(cache) is not RotatingKVCache:
        if extra:
            cache.trim(extra)
        return cache
    keep = min(num_tokens, cache.max_size)
    held = cache.keys.shape[2] - extra  # extract left it in temporal order, [1, H, held + extra, D]
    assert held >= keep, f"a sliding window holding {held} of {num_tokens} tokens cannot be cut to them"
    cache.keys = cache.keys[..., held - keep : held, :]
    cache.values = cache.values[..., held - keep : held, :]
    cache.offset, cache._idx = num_tokens, keep
    return cache


def _view(stored, num_tokens: int):
    if type(stored) is RotatingKVCache:
        assert num_tokens == stored.offset, (num_tokens, stored.offset)  # served whole
        return stored
    return view(stored, num_tokens)


def _positions(keys) -> int:
    return (keys[0] if isinstance(keys, tuple) else keys).shape[2]


class KVStore:
    def __init__(self):
        self._entries: dict[int, ModelCaches] = {}  # entry id -> one KVCache per layer

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, entry: int, batch: ModelCaches, row: int, num_tokens: int) -> None:
        """Store the first ``num_tokens`` tokens of ``row`` of a batch's caches."""
        stored = batch.map(lambda c: snapshot(c.extract(row), num_tokens))  # keys, values: [1, H, n, D]
        mx.async_eval([c.state[:2] for c in stored.layers])
        self._entries[entry] = stored

    def view(self, entry: int, num_tokens: int) -> ModelCaches:
        """The first ``num_tokens`` of an entry, as caches for BatchKVCache.merge
        (which copies them, leaving the entry as it is)."""
        return self._entries[entry].map(lambda stored: _view(stored, num_tokens))

    def drop(self, entries: list[int]) -> None:
        for entry in entries:
            self._entries.pop(entry, None)

    def clear(self) -> None:
        self._entries.clear()
