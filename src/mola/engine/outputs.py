"""What the engine thread tells other threads: each sequence's new tokens
after a step, and an immutable snapshot of its state."""

from __future__ import annotations

from dataclasses import dataclass, field

from .prompt_cache import PromptCacheStats
from .steps import RunnerStats
from .sequence import Sequence


@dataclass
class SeqOutput:
    """New tokens of one sequence after one step."""

    seq: Sequence
    tokens: list[int]
    finish_reason: str | None = None  # "stop", "length", "abort", "error"
    error: str | None = None
    # Per token, when the sequence asked for them: (log-probability,
    # [(token id, log-probability)] of the top alternatives).
    logprobs: list | None = None


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
