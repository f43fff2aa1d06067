"""Per-row logit processing before sampling: OpenAI's logit_bias,
frequency/presence penalties and grammar masks, for a whole batch at once.

Penalties need how often each token was generated so far. That count lives
on the device, one row of [B, V] per decode row, updated from the sampled
tokens without a round trip through Python, so decode steps can be launched
before the previous step's tokens are read back.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from .sequence import Sequence


def add_biases(logits: mx.array, rows: list[Sequence]) -> mx.array:
    """logit_bias of every row as one sparse add over [B, V]."""
    r_idx, t_idx, vals = [], [], []
    for i, seq in enumerate(rows):
        for token, bias in seq.params.logit_bias:
            r_idx.append(i)
            t_idx.append(token)
            vals.append(bias)
    if not r_idx:
        return logits
    at = (mx.array(r_idx, dtype=mx.int32), mx.array(t_idx, dtype=mx.int32))
    return logits.at[at].add(mx.array(vals, dtype=logits.dtype))


def penalize(logits: mx.array, counts: mx.array, rows: list[Sequence]) -> mx.array:
    """logit[t] -= frequency_penalty * count(t) + presence_penalty * (count(t) > 0)."""
    freq = mx.array([s.params.frequency_penalty for s in rows], dtype=mx.float32)[:, None]
    pres = mx.array([s.params.presence_penalty for s in rows], dtype=mx.float32)[:, None]
    penalty = counts * freq + (counts > 0).astype(mx.float32) * pres  # [B, V]
    return logits - penalty.astype(logits.dtype)


def count_tokens(counts: mx.array, tokens: mx.array) -> mx.array:
    """One more occurrence of each row's sampled token: [B, V] += onehot."""
    rows = mx.arange(tokens.shape[0])
    return counts.at[rows, tokens].add(1.0)


def output_counts(seqs, vocab_size: int) -> mx.array:
    """[B, V] counts of each row's generated tokens (a preempted row rejoins with them)."""
    if not any(seq.output for seq in seqs):  # new rows: nothing generated yet
        return mx.zeros((len(seqs), vocab_size))
    counts = np.zeros((len(seqs), vocab_size), dtype=np.float32)
    for row, seq in enumerate(seqs):
        np.add.at(counts[row], seq.output, 1)
    return mx.array(counts)


def apply_bitmask(logits: mx.array, bitmask: np.ndarray) -> mx.array:
    """Every row's allowed tokens in one op: -inf where bit t of row i of
    ``bitmask`` [B, W] int32 (llguidance's layout, bit t % 32 of word t // 32)
    is clear. The mask may cover more tokens than the logits [B, V]."""
    vocab = logits.shape[-1]
    bits = np.unpackbits(bitmask.view(np.uint8), axis=1, bitorder="little")[:, :vocab]  # [B, V]
    allowed = mx.array(bits.astype(np.bool_))
    return mx.where(allowed, logits, mx.array(-mx.inf, dtype=logits.dtype))
