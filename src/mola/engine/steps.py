"""What a decode step carries inside the runner, and what it hands the
engine: the step launched or about to be sampled, its tokens once read back
(with their log-probabilities), and the runner's counters."""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx

from .sequence import Sequence

# (log-probability of the sampled token, [(token id, log-probability)] of the
# most likely tokens, best first)
TokenLogprobs = tuple[float, list[tuple[int, float]]]


@dataclass
class StepResult:
    """New tokens of the rows, per row in order: the token of a plain step,
    and after it, or alone, a speculative step's accepted drafts and the
    token that follows them."""

    rows: list[Sequence]
    tokens: list[list[int]]
    logprobs: list[list[TokenLogprobs] | None]
    # Per row: its last token was never fed to the model (a speculative
    # step's last token), so the row's KV state lacks it.
    last_unfed: list[bool]
    # (row, drafted, accepted) of the rows that drafted in a speculative step
    speculated: list[tuple[Sequence, int, int]] = field(default_factory=list)

    def extend(self, other: StepResult) -> StepResult:
        """This result, then ``other``'s tokens (a later step's)."""
        at = {id(s): i for i, s in enumerate(self.rows)}
        for seq, tokens, lps, unfed in zip(other.rows, other.tokens, other.logprobs, other.last_unfed):
            i = at.get(id(seq))
            if i is None:
                self.rows.append(seq)
                self.tokens.append(tokens)
                self.logprobs.append(lps)
                self.last_unfed.append(unfed)
                continue
            self.tokens[i] = self.tokens[i] + tokens
            if lps is not None:
                self.logprobs[i] = (self.logprobs[i] or []) + lps
            self.last_unfed[i] = unfed
        self.speculated += other.speculated
        return self


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


def advance_matchers(result: StepResult | None) -> None:
    """Each constrained row's matcher consumes its accepted tokens (rows that
    finished or were aborted while the step ran accept nothing)."""
    for seq, tokens in zip(result.rows, result.tokens) if result is not None else ():
        if seq.constraint is not None and not seq.is_finished:
            for token in tokens:
                seq.constraint.advance(token)
