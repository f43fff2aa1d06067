"""A quantized KV cache for the batch (--kv-bits 8 or 4): mlx-lm's
QuantizedKVCache, which holds one sequence, made a BatchKVCache.

Each position's keys and values are quantized as mlx-lm's QuantizedKVCache
quantizes them (mx.quantize over groups of ``group_size`` along the head
dimension: packed uint32 words, a scale and a bias a group) and attention
runs through mlx-lm's quantized_scaled_dot_product_attention (its models pick
it when the cache has ``bits``). What the batch adds: left padding, rows kept
or appended, a row cut out for the prompt cache, and per-sequence caches
merged into a batch, as BatchKVCache does for float keys and values, on the
triples instead.

Batch-invariant itself: a group is one position's head dimension, so no row's
groups hold padding or another row. It rounds what it is given, though, so a
last-bit difference in a key (OpenBLAS picks kernels by the batch's shape) can
flip a step: docs/operations.md states that exception, /v1/models shows it.
"""

from __future__ import annotations

import copy

import mlx.core as mx
from mlx.utils import tree_map
from mlx_lm.models.cache import BatchKVCache, QuantizedKVCache, dynamic_roll

Triple = tuple[mx.array, mx.array, mx.array]  # packed words, scales, biases


def _zeros(shape: tuple[int, int, int], dim: int, dtype, group_size: int, bits: int) -> Triple:
    per_word = 32 // bits
    return (mx.zeros((*shape, dim // per_word), dtype=mx.uint32),
            mx.zeros((*shape, dim // group_size), dtype=dtype), mx.zeros((*shape, dim // group_size), dtype=dtype))


def _dim(t: Triple, bits: int) -> int:
    """The head dimension a triple holds."""
    return t[0].shape[-1] * 32 // bits


def triple_nbytes(x) -> int:
    """Bytes of a cache's keys or values: an array, a triple, or None."""
    if x is None:
        return 0
    return sum(a.nbytes for a in x) if isinstance(x, tuple) else x.nbytes


class RowQuantizedKVCache(QuantizedKVCache):
    """One sequence's quantized cache (mlx-lm's) that merges into a batch."""

    def size(self) -> int:
        return self.offset

    @classmethod
    def merge(cls, caches: list[RowQuantizedKVCache]) -> BatchQuantizedKVCache:
        return BatchQuantizedKVCache.merge(caches)


class BatchQuantizedKVCache(BatchKVCache):
    def __init__(self, left_padding: list[int], group_size: int = 64, bits: int = 8):
        super().__init__(left_padding)
        self.group_size, self.bits = group_size, bits

    def update_and_fetch(self, keys, values):
        B, H, T, Dk = keys.shape
        prev = self._idx
        if self.keys is None or prev + T > self.keys[0].shape[2]:
            shape = (B, H, (self.step + T - 1) // self.step * self.step)
            new = (_zeros(shape, Dk, keys.dtype, self.group_size, self.bits),
                   _zeros(shape, values.shape[3], values.dtype, self.group_size, self.bits))
            if self.keys is None:
                self.keys, self.values = new
            else:
                if prev % self.step != 0:
                    self.keys, self.values = tree_map(lambda x: x[..., :prev, :], (self.keys, self.values))
                self.keys, self.values = (tuple(mx.concatenate([a, b], axis=2) for a, b in zip(old, more))
                                          for old, more in zip((self.keys, self.values), new))
        self.offset = self.offset + T
        self._idx += T
        for stored, new in ((self.keys, keys), (self.values, values)):
            for part, q in zip(stored, mx.quantize(new, group_size=self.group_size, bits=self.bits)):
                part[..., prev : self._idx, :] = q
        return self.keys_and_values()

    def keys_and_values(self):
        return tree_map(lambda x: x[..., : self._idx, :], (self.keys, self.values))

    def finalize(self):
        if self._right_padding is not None:
            padding = self._right_padding
            self.keys, self.values = tree_map(lambda x: dynamic_roll(x, padding[:, None], axis=2),
                                              (self.keys, self.values))
            self.offset = self.offset - padding
            self.left_padding += padding
            self._right_padding = None

    def filter(self, batch_indices):
        if self.keys is not None:
            self.keys, self.values = tree_map(lambda x: x[batch_indices], (self.keys, self.values))
        self.offset = self.offset[batch_indices]
        self.left_padding = self.left_padding[batch_indices]
        min_left_pad = min(self.left_padding.tolist())
        if min_left_pad > 0:  # shift left to reduce padding
            if self.keys is not None:
                self.keys, self.values = tree_map(lambda x: x[..., min_left_pad:, :], (self.keys, self.values))
            self._idx -= min_left_pad
            self.left_padding -= min_left_pad

    def extend(self, other: BatchQuantizedKVCache):
        """``other``'s rows after these, both right-justified at the longer index."""
        if self.keys is None and other.keys is None:
            self.left_padding = mx.concatenate([self.left_padding, other.left_padding])
            self.offset = mx.concatenate([self.offset, other.offset])
            return
        ref = self if self.keys is not None else other
        H, dtype = ref.keys[1].shape[1], ref.keys[1].dtype
        dims = (_dim(ref.keys, self.bits), _dim(ref.values, self.bits))
        max_idx = max(self._idx, other._idx)
        max_size = max(c.keys[0].shape[2] for c in (self, other) if c.keys is not None)

        def pad(c):
            kv = c.keys, c.values
            if c.keys is None:
                kv = tuple(_zeros((c.offset.shape[0], H, 0), d, dtype, self.group_size, self.bits) for d in dims)
            left = max_idx - c._idx
            right = max_size - kv[0][0].shape[2] - left
            if right < 0:
                kv, right = tree_map(lambda x: x[..., :right, :], kv), 0
            if left or right:
                kv = tree_map(lambda x: mx.pad(x, [(0, 0), (0, 0), (left, right), (0, 0)]), kv)
            return kv, c.offset, c.left_padding + left

        (mine, o1, l1), (theirs, o2, l2) = pad(self), pad(other)
        self.keys, self.values = (tuple(mx.concatenate([a, b]) for a, b in zip(m, t)) for m, t in zip(mine, theirs))
        self.offset, self.left_padding = mx.concatenate([o1, o2]), mx.concatenate([l1, l2])
        self._idx = max_idx

    def extract(self, idx: int) -> RowQuantizedKVCache:
        cache = RowQuantizedKVCache(self.group_size, self.bits)
        padding = self.left_padding.tolist()[idx]
        cache.keys, cache.values = tree_map(lambda x: mx.contiguous(x[idx : idx + 1, :, padding : self._idx]),
                                            (self.keys, self.values))
        cache.offset = self._idx - padding
        return cache

    @classmethod
    def merge(cls, caches: list[RowQuantizedKVCache]) -> BatchQuantizedKVCache:
        lengths = [c.size() for c in caches]
        longest = max(lengths)
        group_size, bits = caches[0].group_size, caches[0].bits
        if longest == 0:
            return cls([0] * len(caches), group_size, bits)
        padding = [longest - n for n in lengths]
        ref = next(c for c in caches if c.keys is not None)
        shape = (len(caches), ref.keys[1].shape[1], longest)
        keys = _zeros(shape, _dim(ref.keys, bits), ref.keys[1].dtype, group_size, bits)
        values = _zeros(shape, _dim(ref.values, bits), ref.values[1].dtype, group_size, bits)
        for i, (p, c) in enumerate(zip(padding, caches)):
            if c.keys is None:
                continue
            for stored, own in ((keys, c.keys), (values, c.values)):
                for part, x in zip(stored, own):
                    part[i : i + 1, :, p : p + c.offset] = x[..., : c.offset, :]
        cache = cls(padding, group_size, bits)
        cache.keys, cache.values = keys, values
        cache.offset += longest
        cache._idx = longest
        return cache

    @property
    def nbytes(self) -> int:
        return triple_nbytes(self.keys) + triple_nbytes(self.values)


def quantized_caches(caches: list, group_size: int, bits: int) -> list[RowQuantizedKVCache]:
    """One quantized cache per layer for a model whose ``caches`` (mlx-lm's
    make_prompt_cache) are all plain KVCaches; ValueError otherwise."""
    from mlx_lm.models.cache import KVCache

    if not caches or any(type(c) is not KVCache for c in caches):
        kinds = sorted({type(c).__name__ for c in caches})
        raise ValueError(f"--kv-bits quantizes plain KV caches; this model's are {', '.join(kinds)}")
    return [RowQuantizedKVCache(group_size, bits) for _ in caches]


def view(stored, num_tokens: int):
    """The first ``num_tokens`` of a stored cache, sharing its arrays."""
    c = copy.copy(stored)
    c.offset = num_tokens
    return c
