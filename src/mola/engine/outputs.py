"""What the engine thread tells other threads: each sequence's new tokens
after a step, and an immutable snapshot of its state."""

from __future__ import annotations

from dataclasses import dataclass, field

from .prompt_cache import PromptCacheStats
from .steps import RunnerStats
from .sequence import FinishReason, Sequence


@dataclass(frozen=True)
class SeqOutput:
    """New tokens of one sequence after one step: everything the event loop
    learns of it (the Sequence itself stays on the engine thread)."""

    seq_id: int
    tokens: tuple[int, ...] = ()
    finish_reason: FinishReason | None = None  # None: more tokens will come
    error: str | None = None
    # Per token, when the sequence asked for them: (log-probability,
    # [(token id, log-probability)] of the top alternatives).
    logprobs: tuple | None = None
    num_cached_tokens: int = 0  # prompt tokens whose KV state came from the prompt cache

    @classmethod
    def of(cls, seq: Sequence, tokens=(), logprobs=None, error: str | None = None) -> SeqOutput:
        """What ``seq`` tells the event loop now: ``tokens`` (and their
        ``logprobs``) and, once finished, why."""
        # (a preempted sequence's second prefill may find its whole prompt cached)
        cached = min(seq.num_cached_tokens, seq.num_prompt_tokens - 1)
        return cls(seq.seq_id, tuple(tokens), seq.finish_reason, error,
                   None if logprobs is None else tuple(logprobs), cached)


@dataclass(frozen=True)
class KVStats:
    """The KV budget and what the batches hold of it (all 0 without a budget)."""

    budget_bytes: int = 0
    mode: str = ""  # "optimistic" or "reserve" admission
    used_bytes: int = 0  # the batches' caches now, as the budget counts them
    reserved_bytes: int = 0  # what they may grow to, every row to its max_tokens
    held_bytes: int = 0  # the caches' arrays now, measured
    preemptions: int = 0  # rows sent back to the queue (each time)
    waits: int = 0  # sequences that waited at the queue's head for KV memory

    @property
    def free_bytes(self) -> int:
        return max(0, self.budget_bytes - self.used_bytes)


@dataclass(frozen=True)
class EngineSnapshot:
    """What other threads may know of the engine. The engine thread publishes
    a new one after every step and command; it is immutable, so the event
    loop and the metrics read it without a lock."""

    num_running: int = 0  # rows of the decode batch
    num_prefilling: int = 0  # prompts being written into a KV cache
    num_waiting: int = 0  # queued, nothing computed yet
    num_steps: int = 0
    stats: RunnerStats = field(default_factory=RunnerStats)  # a copy, never updated
    prompt_cache: PromptCacheStats = field(default_factory=PromptCacheStats)  # frozen
    kv: KVStats = field(default_factory=KVStats)
