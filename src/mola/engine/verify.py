"""Speculative decoding, the device's half (called by the runner, which
alone builds arrays): one forward pass verifies every row's drafts.

Each decode row is fed its next input and then its drafted tokens,
right-padded to the step's widest draft: ``x`` [B, P], P = 1 + D. Every
LoRA layer routes the row's P positions to the row's slot, so rows of
different adapters, scales and stacks verify together; a row that drafted
nothing decodes its one token in the same pass.

Acceptance. Position j of a row is sampled exactly as a plain step would
sample it after the row's first j drafts: the same biases, penalties (counts
that include those drafts), temperature, top-p and PRNG key (the key that the
j-th of as many plain steps would use). Drafts are accepted while they equal
the token sampled there; the first position that differs gives its own token,
and a row whose drafts are all accepted gets the token after them. This is
the standard rejection rule for a deterministic draft (q one-hot on the
draft: accept x with probability min(1, p(x) / q(x)) = p(x); on rejection
draw from norm(max(0, p - q)), p without x), so outputs follow the target's
distribution; and since the draws are the ones plain decoding makes, a
seeded or greedy request yields the same tokens with or without speculation.

The KV cache then holds 1 + D new positions per row, of which 1 + a (the
input and the accepted drafts) are right; the rest are cut off: the part
every row rejected by trimming, the rest as BatchKVCache finalize() treats
right padding, rolling each row's tail out into its left padding. A sliding
window's BatchRotatingKVCache is cut back the same way: a pass of P > 1
positions leaves it in temporal order (mlx-lm's concatenating update) holding
its window's last W - 1 positions before them, so after cutting up to P - 1 a
row still holds what its next tokens attend to, and the cache is in the state
a prefill of that length would leave (see rewind_window).
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.cache import BatchRotatingKVCache, dynamic_roll

from .logits import apply_bitmask
from .plan import StepResult
from .sampling import draw, key_chain
from .sequence import Sequence
from .steps import Forward, read_logprobs, token_logprobs


@dataclass
class Verification:
    """A speculative step launched, for reading back."""

    rows: list[Sequence]
    num_draft: list[int]  # per row: tokens it drafted
    width: int  # P = 1 + the widest draft
    tokens: mx.array  # [B, P] per row: the accepted drafts, the token after them, padding
    accepted: mx.array  # [B] drafts accepted per row
    wanted: list[int]  # positions (of B * P) whose log-probabilities were asked for
    logprob_arrays: tuple = ()  # as token_logprobs returns them


def draft_array(drafts: list[list[int]], width: int) -> mx.array:
    """Prompt lookup's drafts, right-padded: [B, width] uint32."""
    return mx.array([d + [0] * (width - len(d)) for d in drafts], dtype=mx.uint32)


def draft_with_model(model: nn.Module, caches: list, inputs: mx.array, width: int, vocab: int) -> mx.array:
    """``width`` greedy tokens per row from a draft model, from the rows' next
    inputs [B]: [B, width]. The draft's KV cache is also fed the last draft,
    so that it gains the positions the target's gains (1 + width per row) and
    both are cut back alike."""
    x = inputs[:, None]  # [B, 1]
    out = []
    for _ in range(width):
        logits = model(x, cache=caches)[:, -1, :vocab]  # [B, V]
        x = mx.argmax(logits, axis=-1).astype(mx.uint32)[:, None]
        out.append(x)
    model(x, cache=caches)
    return mx.concatenate(out, axis=1)


def position_counts(counts: mx.array, drafts: mx.array) -> mx.array:
    """Generated-token counts [B, V] as each of the P = D + 1 positions sees
    them, after the drafts before it: [B * P, V]."""
    B, D = drafts.shape
    rows = mx.repeat(mx.arange(B), D)
    cols = mx.tile(mx.arange(D), B)
    seen = mx.zeros((B, D, counts.shape[-1]), dtype=counts.dtype)
    seen = seen.at[rows, cols, drafts.reshape(-1)].add(1.0).cumsum(axis=1)  # [B, D, V]
    per_position = mx.concatenate([counts[:, None], counts[:, None] + seen], axis=1)  # [B, P, V]
    return per_position.reshape(B * (D + 1), -1)


def sample_positions(processed: mx.array, rows: list, keys: mx.array | None, width: int):
    """Each position's token, drawn as plain steps draw them: (tokens [B, P],
    keys after each number of draws [P + 1, B, 2] or None when all greedy).
    ``processed`` [B * P, V]: the logits after biases, penalties and masks."""
    P = width
    temps = [s.params.temperature for s in rows for _ in range(P)]
    top_p = [s.params.top_p for s in rows for _ in range(P)]
    if all(t == 0 for t in temps):
        tokens, _ = draw(processed, temps, top_p, None)
        return tokens.reshape(len(rows), P), None
    chain, draws = key_chain(keys, P)  # [P + 1, B, 2], [P, B, 2]
    draw_keys = draws.swapaxes(0, 1).reshape(len(rows) * P, 2)  # row-major, as processed
    tokens, _ = draw(processed, temps, top_p, draw_keys)
    return tokens.reshape(len(rows), P), chain


def accepted_lengths(tokens: mx.array, drafts: mx.array, num_draft: list[int]) -> mx.array:
    """Per row, how many drafts lead the sampled tokens [B, P]: [B] int32."""
    D = drafts.shape[1]
    allowed = mx.arange(D)[None] < mx.array(num_draft)[:, None]  # [B, D]
    match = (tokens[:, :D] == drafts) & allowed
    return mx.cumprod(match.astype(mx.int32), axis=1).sum(axis=1)  # [B]


def produced_tokens(tokens: mx.array, drafts: mx.array, accepted: mx.array) -> mx.array:
    """Per row, its accepted drafts and then the token sampled after them
    (beyond: padding): [B, P]. Under the rule above the accepted drafts are
    the tokens sampled there, but the output is what was accepted."""
    B, P = tokens.shape
    padded = mx.concatenate([drafts, mx.zeros((B, 1), dtype=drafts.dtype)], axis=1)  # [B, P]
    return mx.where(mx.arange(P)[None] < accepted[:, None], padded, tokens.astype(drafts.dtype))


def next_state(produced: mx.array, accepted: mx.array, chain: mx.array | None, keys: mx.array | None):
    """The rows' next inputs [B] (the token after their accepted drafts) and
    PRNG keys [B, 2] (one split per token produced)."""
    B = produced.shape[0]
    inputs = mx.take_along_axis(produced, accepted[:, None], axis=1)[:, 0]
    if chain is not None:
        keys = chain[accepted + 1, mx.arange(B)]
    return inputs, keys


def count_produced(counts: mx.array, tokens: mx.array, accepted: mx.array) -> mx.array:
    """Counts [B, V] plus each row's produced tokens, tokens[:, :accepted + 1]."""
    B, P = tokens.shape
    produced = (mx.arange(P)[None] <= accepted[:, None]).astype(counts.dtype)  # [B, P]
    return counts.at[mx.repeat(mx.arange(B), P), tokens.reshape(-1)].add(produced.reshape(-1))


def rewind(caches: list, rejected: list[int]) -> None:
    """Cut each row's last ``rejected[i]`` positions out of every batch cache."""
    common = min(rejected)
    rest = [r - common for r in rejected]
    for c in caches:
        if isinstance(c, BatchRotatingKVCache):
            rewind_window(c, common, rest)
            continue
        if common:
            c.trim(common)
        if any(rest):
            c.prepare(right_padding=rest)
            c.finalize()  # rolls each row's tail into its left padding


def order_windows(caches: list) -> None:
    """Put sliding windows that one-token steps left rotated back in temporal
    order before a pass of several positions: mlx-lm's BatchRotatingKVCache
    builds that pass's mask from the write index as if it were (mlx-lm 0.32),
    and would hide a short row's oldest token."""
    for c in caches:
        if isinstance(c, BatchRotatingKVCache) and c.rotated:
            c._temporal_order()


def rewind_window(c: BatchRotatingKVCache, common: int, rest: list[int]) -> None:
    """Cut a sliding window's batch cache back: ``common`` positions of every
    row, then ``rest[i]`` more of row i, rolled into its left padding (as
    BatchRotatingKVCache.finalize rolls a right-padded prefill's)."""
    if not common and not any(rest):
        return
    # a pass of one position (nothing drafted) rejects none; wider ones concatenate
    assert not c.rotated and c.keys.shape[2] >= c._idx, "a rotated window cannot be cut back"
    c.trim(common)  # offsets and the write index
    c.keys, c.values = c.keys[..., : c._idx, :], c.values[..., : c._idx, :]  # [B, H, kept, D]
    if any(rest):
        roll = mx.array(rest)
        c.keys = dynamic_roll(c.keys, roll[:, None], axis=2)
        c.values = dynamic_roll(c.values, roll[:, None], axis=2)
        c.left_padding = c.left_padding + roll
        c.offset = c.offset - roll


def launch(forward: Forward, drafts: mx.array, num_draft: list[int], keys: mx.array | None,
           counts: mx.array | None, bitmask: np.ndarray | None = None):
    """Sample every position (under ``bitmask`` [B, W], when given), accept
    the drafts that match and launch the step. Returns the verification and
    the rows' next inputs [B], PRNG keys [B, 2] and counts [B, V] (or None)."""
    rows, P = forward.rows, forward.width
    processed = forward.processed
    if bitmask is not None:  # constrained rows draft nothing: only position 0 counts
        processed = apply_bitmask(processed, np.repeat(bitmask, P, axis=0))
    sampled, chain = sample_positions(processed, rows, keys, P)  # [B, P]
    accepted = accepted_lengths(sampled, drafts, num_draft)  # [B]
    tokens = produced_tokens(sampled, drafts, accepted)  # [B, P]
    inputs, keys = next_state(tokens, accepted, chain, keys)
    if counts is not None:
        counts = count_produced(counts, tokens, accepted)
    flat = forward.flat_rows
    wanted = [i for i, s in enumerate(flat) if s.params.logprobs is not None]
    arrays = token_logprobs(forward.logits, tokens.reshape(-1), flat, wanted) if wanted else ()
    mx.async_eval(tokens, accepted, inputs, keys, *(a for a in arrays if a is not None),
                  *([counts] if counts is not None else []))
    return Verification(rows, num_draft, P, tokens, accepted, wanted, arrays), inputs, keys, counts


def read(v: Verification) -> tuple[StepResult, list[int]]:
    """The tokens each row produced (its accepted drafts and the token after
    them), and how many of its positions each row rejected."""
    tokens, accepted = v.tokens.tolist(), v.accepted.tolist()
    P = v.width
    lps = read_logprobs([s for s in v.rows for _ in range(P)], v.wanted, v.logprob_arrays)
    result = StepResult(v.rows, [], [], [True] * len(v.rows))
    for i, (seq, a) in enumerate(zip(v.rows, accepted)):
        result.tokens.append(tokens[i][: a + 1])
        wants = seq.params.logprobs is not None
        result.logprobs.append([lps[i * P + j] for j in range(a + 1)] if wants else None)
        if v.num_draft[i]:
            result.speculated.append((seq, v.num_draft[i], a))
    return result, [P - 1 - a for a in accepted]
