"""PEFT's trainable tokens as LoRA factors on the embedding and the head.

PEFT's TrainableTokensLayer (peft/tuners/trainable_tokens/layer.py) keeps,
for ``token_indices`` I = (i_1 .. i_k), a ``trainable_tokens_delta`` V
[k, hidden] that, despite its name, holds the rows' new values: its forward
is ``F.embedding(x, W.index_copy(0, I, V))`` (rows replaced, not added to),
and on a tied head ``F.linear(x, W.index_copy(0, I, V))``.

A replacement of k rows is a LoRA of rank k, exactly: with the selector
S [vocab, k] (S[i_j, j] = 1) and D = V - W[I] [k, hidden] (W[I] dequantized),

    embedding:  onehot(x) @ W + onehot(x) @ S @ D   = row x of W, or V_j where x = i_j
    head:       h @ W.T + (h @ D.T) @ S.T           = logits with columns I from V

so mola writes them into the embedding's and the head's slot packs as factors
a = S, b = D (and a = D.T, b = S.T on the head), and every row of the mixed
batch gets its slot's replaced rows with the packs' own gathers. They weigh
what a rank-k LoRA weighs there. A ``lora_scale`` s gives W[x] + s * (V - W[x]).
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx


@dataclass(frozen=True)
class TrainableTokens:
    """Rows of one layer's weight that an adapter replaces."""

    path: str  # mlx-lm module path: the embedding ("model.embed_tokens") or "lm_head"
    indices: tuple[int, ...]  # token ids, distinct
    values: mx.array  # [k, hidden]: their new rows
    tied: bool = False  # the embedding's tokens that also replace a tied head's rows (PEFT ties them)

    @property
    def count(self) -> int:
        return len(self.indices)


def selector(indices: tuple[int, ...], vocab: int) -> mx.array:
    """S [vocab, k] with S[indices[j], j] = 1, else 0."""
    return (mx.arange(vocab)[:, None] == mx.array(indices)[None, :]).astype(mx.float32)  # [vocab, k]


def embedding_factors(indices: tuple[int, ...], delta: mx.array, vocab: int) -> tuple[mx.array, mx.array]:
    """(a [vocab, k], b [k, hidden]) replacing rows ``indices`` by base + ``delta`` [k, hidden]."""
    return selector(indices, vocab), delta


def head_factors(indices: tuple[int, ...], delta: mx.array, vocab: int) -> tuple[mx.array, mx.array]:
    """(a [hidden, k], b [k, vocab]) adding h @ delta.T to the logits of ``indices``."""
    return delta.T, selector(indices, vocab).T
