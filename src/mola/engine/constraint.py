"""Per-sequence grammar constraints on the engine thread (plain Python and
numpy; the runner turns the bitmask into an array).

A :class:`Constraint` is one sequence's llguidance matcher: it advances on
each token the engine accepts for that sequence and says which tokens may
come next. :class:`MaskFiller` writes the next-token bitmask of every
constrained row of a decode step into one ``[B, ceil(V / 32)]`` int32 array,
all rows at once on llguidance's own threads (which drop the GIL); rows
without a constraint keep every bit set.
"""

from __future__ import annotations

import numpy as np
from llguidance import LLExecutor, LLMatcher


class Constraint:
    """One sequence's matcher. Made (compiled) off the engine thread, then
    owned by it once the sequence is added."""

    def __init__(self, matcher: LLMatcher, grammar: str, vocab_size: int):
        self.matcher = matcher
        self.grammar = grammar  # llguidance grammar text (what other ranks rebuild it from)
        self.vocab_size = vocab_size  # tokens its masks cover (>= the model's logits)
        self.num_tokens = 0  # tokens consumed
        self.error: str | None = None  # set when a token was refused: the row must end
        self.error_at = 0  # the refused token's index in the output

    def advance(self, token: int) -> None:
        """Consume an accepted token (one the mask allowed)."""
        if self.error is not None:
            return
        if not self.matcher.consume_token(token):
            self.error = self.matcher.get_error() or f"token {token} is outside the grammar"
            self.error_at = self.num_tokens
        self.num_tokens += 1

    @property
    def is_accepting(self) -> bool:
        """The output so far is complete under the grammar."""
        return self.matcher.is_accepting()


def bitmask_width(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


class MaskFiller:
    """Fills the next-token bitmask of a batch's constrained rows."""

    def __init__(self, num_threads: int | None = None):
        self._executor: LLExecutor | None = None
        self._num_threads = num_threads

    def fill(self, constraints: list[Constraint | None]) -> np.ndarray:
        """``constraints[i]``: row i's constraint or None (at least one is
        set). Returns the bitmask [B, ceil(V / 32)] int32, V the constraints'
        vocabulary: bit t of row i is set when token t is allowed (every bit
        of an unconstrained or failed row)."""
        vocab_size = next(c.vocab_size for c in constraints if c is not None)
        mask = np.full((len(constraints), bitmask_width(vocab_size)), -1, dtype=np.int32)  # [B, W]
        rows = [(c.matcher, i) for i, c in enumerate(constraints) if c is not None and c.error is None]
        if rows:
            if self._executor is None:
                self._executor = LLExecutor(self._num_threads)
            self._executor.unsafe_compute_mask_ptr(rows, mask.ctypes.data, mask.shape[1] * 4, mask.shape[0])
        return mask
