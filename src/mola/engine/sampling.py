"""Per-row sampling for a whole batch in one pass.

Every row has its own temperature, top_p and PRNG key, so a seeded request
draws the same tokens whatever else shares its batch. Greedy rows take the
argmax exactly.
"""

from __future__ import annotations

import mlx.core as mx

_split = mx.vmap(lambda k: mx.random.split(k, 2))  # [B, 2] -> [B, 2, 2]


def _gumbel_rows(keys: mx.array, vocab: int) -> mx.array:
    return mx.vmap(lambda k: mx.random.gumbel((vocab,), key=k))(keys)  # [B, V]


def top_p_mask(logprobs: mx.array, top_p: mx.array) -> mx.array:
    """Keep, per row, the most likely tokens whose mass reaches top_p [B, 1]."""
    order = mx.argsort(-logprobs, axis=-1)  # [B, V]
    probs = mx.exp(mx.take_along_axis(logprobs, order, axis=-1))  # [B, V] descending
    mass_before = mx.cumsum(probs, axis=-1) - probs
    keep_sorted = mass_before < top_p  # the most likely token is always kept
    keep = mx.zeros(keep_sorted.shape, dtype=mx.bool_)
    return mx.put_along_axis(keep, order, keep_sorted, axis=-1)


def sample(
    logits: mx.array,  # [B, V]
    temperature: list[float],
    top_p: list[float],
    keys: mx.array | None,  # [B, 2] uint32, one PRNG key per row
) -> tuple[mx.array, mx.array, mx.array | None]:
    """Returns (tokens [B], logprobs [B, V], next keys [B, 2])."""
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)  # [B, V]
    greedy = mx.argmax(logprobs, axis=-1)
    if all(t == 0 for t in temperature):
        return greedy, logprobs, keys
    temps = mx.array([max(t, 1e-6) for t in temperature], dtype=mx.float32)[:, None]
    scaled = logprobs / temps  # [B, V]
    if any(p < 1.0 for p in top_p):
        scaled = scaled - mx.logsumexp(scaled, axis=-1, keepdims=True)
        mask = top_p_mask(scaled, mx.array(top_p, dtype=mx.float32)[:, None])
        scaled = mx.where(mask, scaled, -mx.inf)
    split = _split(keys)  # [B, 2, 2]
    next_keys, draw_keys = split[:, 0], split[:, 1]
    drawn = mx.argmax(scaled + _gumbel_rows(draw_keys, scaled.shape[-1]), axis=-1)
    is_greedy = mx.array([t == 0 for t in temperature])
    return mx.where(is_greedy, greedy, drawn), logprobs, next_keys


def make_keys(seeds: list[int]) -> mx.array:
    """One PRNG key per row from integer seeds: [B, 2] uint32."""
    return mx.stack([mx.random.key(s % 2**64) for s in seeds])
