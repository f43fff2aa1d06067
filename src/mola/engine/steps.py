"""What a decode step carries inside the runner: the step launched or
about to be sampled, its tokens once read back (with their
log-probabilities), and the runner's counters."""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from .plan import StepResult, TokenLogprobs
from .sequence import Sequence


@dataclass
class Launch:
    """A plain decode step in flight."""

    rows: list[Sequence]
    tokens: mx.array  # [B]
    wanted: list[int]  # rows that asked for log-probabilities
    logprob_arrays: tuple = ()  # (chosen [W], top ids [W, k] | None, top logprobs [W, k] | None)


@dataclass
class Forward:
    """A decode step's forward pass, not yet sampled: P positions per row
    (1, or 1 + D in a speculative step), row-major."""

    rows: list[Sequence]
    logits: mx.array  # [B * P, V] the model's own
    processed: mx.array  # [B * P, V] after biases and penalties
    width: int = 1  # P

    @property
    def flat_rows(self) -> list[Sequence]:
        """The row of each of the B * P positions."""
        return self.rows if self.width == 1 else [s for s in self.rows for _ in range(self.width)]


@dataclass
class RunnerStats:
    """Counters of what the runner computed (read by tests and metrics)."""

    decode_steps: int = 0
    decode_rows: int = 0  # sum of batch sizes over decode steps
    mixed_steps: int = 0  # decode steps whose rows used more than one slot
    max_batch: int = 0
    max_slots_in_step: int = 0  # most distinct slots (base included) in one step
    prefill_tokens: int = 0  # prompt tokens written, padding excluded
    masked_steps: int = 0  # decode steps sampled under grammar masks
    masked_rows: int = 0  # constrained rows over those steps
    spec_steps: int = 0  # speculative (verifying) decode steps
    spec_rows: int = 0  # rows that drafted, over those steps
    draft_tokens: int = 0  # tokens drafted
    accepted_tokens: int = 0  # drafted tokens accepted
    # Sampled after every step: the bytes the batches' KV caches hold (after the
    # last step, and at most), and MLX's active memory at most (weights, caches,
    # the prompt cache, ...).
    kv_bytes: int = 0
    peak_kv_bytes: int = 0

    def count_decode(self, slots: list[int]) -> None:
        """A decode step of rows on ``slots``."""
        distinct = len(set(slots))
        self.decode_steps += 1
        self.decode_rows += len(slots)
        self.mixed_steps += distinct > 1
        self.max_batch = max(self.max_batch, len(slots))
        self.max_slots_in_step = max(self.max_slots_in_step, distinct)

    def count_speculation(self, result: StepResult, num_draft: list[int]) -> None:
        """A speculative step drafted ``num_draft`` tokens per row and gave ``result``."""
        self.spec_steps += 1
        self.spec_rows += len(result.speculated)
        self.draft_tokens += sum(num_draft)
        self.accepted_tokens += sum(a for _, _, a in result.speculated)


def token_logprobs(logits: mx.array, tokens: mx.array, rows: list[Sequence], wanted: list[int]) -> tuple:
    """The model's own log-probability of each sampled token [N] and its top
    alternatives (before temperature, penalties and biases, as vLLM reports
    them), for the positions in ``wanted`` of ``logits`` [N, V]."""
    sel = mx.array(wanted, dtype=mx.int32)
    raw = logits[sel]
    raw = raw - mx.logsumexp(raw, axis=-1, keepdims=True)  # [W, V]
    chosen = mx.take_along_axis(raw, tokens[sel][:, None], axis=-1)[:, 0]  # [W]
    k = max(rows[i].params.logprobs for i in wanted)
    if k == 0:
        return chosen, None, None
    top_ids = mx.argpartition(-raw, kth=k - 1, axis=-1)[:, :k]  # [W, k], unordered
    return chosen, top_ids, mx.take_along_axis(raw, top_ids, axis=-1)


def read_logprobs(rows: list[Sequence], wanted: list[int], arrays: tuple) -> dict[int, TokenLogprobs]:
    """Position -> (chosen, top alternatives, best first) for ``wanted``."""
    if not wanted:
        return {}
    chosen, top_ids, top_lps = arrays
    chosen = chosen.tolist()
    ids = top_ids.tolist() if top_ids is not None else None
    lps = top_lps.tolist() if top_lps is not None else None
    out = {}
    for j, i in enumerate(wanted):
        n = rows[i].params.logprobs
        top = sorted(zip(ids[j], lps[j]), key=lambda p: -p[1])[:n] if n else []
        out[i] = (chosen[j], top)
    return out


def read_launch(launch: Launch) -> StepResult:
    """A plain step's tokens, read back (waits for the step): one per row."""
    tokens = launch.tokens.tolist()
    lps = read_logprobs(launch.rows, launch.wanted, launch.logprob_arrays)
    return StepResult(launch.rows, [[t] for t in tokens],
                      [[lps[i]] if i in lps else None for i in range(len(tokens))],
                      [False] * len(tokens))


def advance_matchers(result: StepResult | None) -> StepResult | None:
    """Each constrained row's matcher consumes its accepted tokens (rows that
    finished or were aborted while the step ran accept nothing); returns ``result``."""
    for seq, tokens in zip(result.rows, result.tokens) if result is not None else ():
        if seq.constraint is not None and not seq.is_finished:
            for token in tokens:
                seq.constraint.advance(token)
    return result
