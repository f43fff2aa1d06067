"""The prompt cache's KV arrays, held by the runner on the engine thread, by
the entry ids that mola.engine.prompt_cache hands out.

An entry is one sequence's mlx-lm KVCache per layer (of the target model,
and of the draft model when there is one), cut out of a batch cache with
BatchKVCache.extract and trimmed to the tokens it is stored under. A hit is
served as a view of an entry's first tokens, which BatchKVCache.merge copies
into the new prefill batch's cache: the stored arrays are never written to.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache, trim_prompt_cache

from ..errors import ModelLoadError
from .caches import ModelCaches, layer_caches
from .quantized_cache import RowQuantizedKVCache, triple_nbytes, view


def kv_bytes_per_token(model: nn.Module, routing, draft: nn.Module | None = None,
                       cuttable: bool = True, quant: tuple[int, int] | None = None) -> int | None:
    """KV bytes one token takes in ``model``'s cache (and the ``draft``
    model's, when there is one; quantized when ``quant``, --kv-bits, is given),
    measured on a one-token forward pass. With ``cuttable``, None when the
    caches are not plain KVCaches (sliding windows, recurrent state), whose
    state cannot be cut at a token; without, the bytes a position takes in
    every cache that has keys and values (a sliding window's counted as if
    it never wrapped: an upper bound)."""
    total = 0
    routing.set([0], [1.0])
    for m in (model, draft) if draft is not None else (model,):
        cache = layer_caches(m, quant)
        if cuttable and (not cache or any(type(c) not in (KVCache, RowQuantizedKVCache) for c in cache)):
            return None
        try:
            m(mx.array([[0]], dtype=mx.uint32), cache=cache)
            mx.eval([c.state for c in cache])
        except ValueError as e:  # heads --kv-group-size does not divide
            if quant is None:
                raise
            raise ModelLoadError(f"--kv-bits {quant[0]} --kv-group-size {quant[1]} cannot quantize this "
                                 f"model's KV cache: {e}") from None
        # keys, values: [1, H, capacity, D] (or a quantized triple of such)
        total += sum((triple_nbytes(c.keys) + triple_nbytes(c.values)) // _positions(c.keys)
                     for c in cache if getattr(c, "keys", None) is not None)
    return total


def _positions(keys) -> int:
    return (keys[0] if isinstance(keys, tuple) else keys).shape[2]


class KVStore:
    def __init__(self):
        self._entries: dict[int, ModelCaches] = {}  # entry id -> one KVCache per layer

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, entry: int, batch: ModelCaches, row: int, num_tokens: int) -> None:
        """Store the first ``num_tokens`` tokens of ``row`` of a batch's caches."""
        stored = batch.map(lambda c: c.extract(row))  # keys, values: [1, H, n, D]
        layers = stored.layers
        extra = layers[0].offset - num_tokens
        assert extra >= 0, (layers[0].offset, num_tokens)
        if extra:
            trim_prompt_cache(layers, extra)
        mx.async_eval([c.state[:2] for c in layers])
        self._entries[entry] = stored

    def view(self, entry: int, num_tokens: int) -> ModelCaches:
        """The first ``num_tokens`` of an entry, as caches for BatchKVCache.merge
        (which copies them, leaving the entry as it is)."""
        return self._entries[entry].map(lambda stored: view(stored, num_tokens))

    def drop(self, entries: list[int]) -> None:
        for entry in entries:
            self._entries.pop(entry, None)

    def clear(self) -> None:
        self._entries.clear()
