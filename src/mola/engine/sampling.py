"""Per-row sampling for a whole batch in one pass.

Every row has its own temperature, top_p and PRNG key, so a seeded request
draws the same tokens whatever else shares its batch. Greedy rows take the
argmax exactly. A row's key advances by one split per token it samples, so a
speculative step that verifies several positions of a row draws them with the
keys that as many plain steps would have used (:func:`key_chain`).
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


def draw(
    logits: mx.array,  # [B, V]
    temperature: list[float],
    top_p: list[float],
    draw_keys: mx.array | None,  # [B, 2] uint32, one key per row for this draw (None: all greedy)
) -> tuple[mx.array, mx.array]:
    """Returns (tokens [B], logprobs [B, V])."""
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)  # [B, V]
    greedy = mx.argmax(logprobs, axis=-1)
    if all(t == 0 for t in temperature):
        return greedy, logprobs
    temps = mx.array([max(t, 1e-6) for t in temperature], dtype=mx.float32)[:, None]
    scaled = logprobs / temps  # [B, V]
    if any(p < 1.0 for p in top_p):
        scaled = scaled - mx.logsumexp(scaled, axis=-1, keepdims=True)
        mask = top_p_mask(scaled, mx.array(top_p, dtype=mx.float32)[:, None])
        scaled = mx.where(mask, scaled, -mx.inf)
    drawn = mx.argmax(scaled + _gumbel_rows(draw_keys, scaled.shape[-1]), axis=-1)
    is_greedy = mx.array([t == 0 for t in temperature])
    return mx.where(is_greedy, greedy, drawn), logprobs


def sample(
    logits: mx.array,  # [B, V]
    temperature: list[float],
    top_p: list[float],
    keys: mx.array | None,  # [B, 2] uint32, one PRNG key per row
) -> tuple[mx.array, mx.array, mx.array | None]:
    """Returns (tokens [B], logprobs [B, V], next keys [B, 2])."""
    if all(t == 0 for t in temperature):
        tokens, logprobs = draw(logits, temperature, top_p, None)
        return tokens, logprobs, keys
    split = _split(keys)  # [B, 2, 2]
    tokens, logprobs = draw(logits, temperature, top_p, split[:, 1])
    return tokens, logprobs, split[:, 0]


def key_chain(keys: mx.array, n: int) -> tuple[mx.array, mx.array]:
    """The keys of ``n`` plain steps in a row: (the key before each step and
    after the last [n + 1, B, 2], the draw key of each step [n, B, 2])."""
    chain, draws = [keys], []
    for _ in range(n):
        split = _split(chain[-1])  # [B, 2, 2]
        chain.append(split[:, 0])
        draws.append(split[:, 1])
    return mx.stack(chain), mx.stack(draws)


def make_keys(seeds: list[int]) -> mx.array:
    """One PRNG key per row from integer seeds: [B, 2] uint32."""
    return mx.stack([mx.random.key(s % 2**64) for s in seeds])


def row_keys(seqs) -> mx.array:
    """One PRNG key per joining row: from its seed, or where it was when it
    was preempted (Sequence.resume_key, taken here)."""
    fresh = make_keys([s.params.seed for s in seqs])
    if all(s.resume_key is None for s in seqs):
        return fresh
    keys = [fresh[i] if s.resume_key is None else mx.array(s.resume_key, mx.uint32) for i, s in enumerate(seqs)]
    for s in seqs:
        s.resume_key = None
    return mx.stack(keys)
