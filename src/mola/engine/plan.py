"""What crosses between the scheduler and the runner, in plain Python: the
plan of one step (its batch, the prompt cache's orders, its drafts) and
the tokens the step gives back."""

from __future__ import annotations

from dataclasses import dataclass, field

from .prompt_cache import PrefixHit
from .sequence import Sequence
from .speculative import Proposal

# (log-probability of the sampled token, [(token id, log-probability)] of the
# most likely tokens, best first)
TokenLogprobs = tuple[float, list[tuple[int, float]]]


@dataclass
class CacheOrders:
    """The prompt cache's part of a step, in the order the runner acts."""

    # Rows of the previous decode batch to store before they leave, as (row, entry id, tokens).
    store_rows: list[tuple[int, int, int]] = field(default_factory=list)
    # The cached prefix of each member of a new prefill batch (None: none).
    hits: list[PrefixHit | None] = field(default_factory=list)
    # Members to store as they join, as (index into the prefill batch, entry id, tokens).
    store_joined: list[tuple[int, int, int]] = field(default_factory=list)
    evict: list[int] = field(default_factory=list)  # entries to drop once the step is done


@dataclass
class StepPlan:
    """What the runner does in one step, in this order."""

    # Rows of the previous decode batch to keep (indices); None keeps all.
    keep: list[int] | None = None
    # Rows of the previous decode batch preempted by the KV budget (indices):
    # they leave with the others not kept, and the runner keeps their PRNG
    # keys for when they come back.
    preempted: list[tuple[int, Sequence]] = field(default_factory=list)
    # The prefill batch in progress was preempted: the runner drops it.
    drop_prefill: bool = False
    # The prefill batch (prompts written into one KV cache together), its
    # columns [start, end) processed this step: one chunk.
    prefill: list[Sequence] = field(default_factory=list)
    prefill_is_new: bool = False  # the runner makes the prefill batch's cache first
    start: int = 0
    end: int = 0
    # Members of the prefill batch (indices into it) joining the decode batch
    # now; None: the batch is still prefilling.
    join: list[int] | None = None
    # This step's decode rows, in row order: kept rows, then joined ones.
    decode: list[Sequence] = field(default_factory=list)
    cache: CacheOrders = field(default_factory=CacheOrders)
    # What the decode rows drafted, to verify in one forward pass; None: a
    # plain decode step, pipelined.
    proposal: Proposal | None = None

    @property
    def is_empty(self) -> bool:
        return not self.decode and not self.prefill


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


def prefill_len(seq: Sequence) -> int:
    """Tokens written by prefill: all of the context but the last, which is
    the first input of the decode batch (a preempted sequence's context
    holds its output so far)."""
    return seq.num_prompt_tokens + seq.num_output_tokens - 1


def prefill_todo(seq: Sequence) -> int:
    """Prompt tokens prefill computes: those the prompt cache did not hold."""
    return prefill_len(seq) - seq.num_cached_tokens
