"""The engine's settings: one frozen dataclass, checked when it is made."""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_PROMPT_CACHE_BYTES = 1 << 30  # 1 GiB of KV state


@dataclass(frozen=True)
class EngineConfig:
    max_loras: int = 8  # adapter slots (slot 0, the base model, comes on top)
    max_lora_rank: int = 64
    max_num_seqs: int = 32  # rows decoded together
    prefill_step_size: int = 512  # prompt tokens prefilled per step
    # KV state of earlier prompts (and outputs) kept for reuse; 0: no prompt cache.
    prompt_cache_bytes: int = DEFAULT_PROMPT_CACHE_BYTES

    def __post_init__(self):
        for name in ("max_loras", "max_lora_rank", "max_num_seqs", "prefill_step_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if isinstance(self.prompt_cache_bytes, bool) or not isinstance(self.prompt_cache_bytes, int) \
                or self.prompt_cache_bytes < 0:
            raise ValueError(f"prompt_cache_bytes must be a whole number of bytes >= 0, "
                             f"got {self.prompt_cache_bytes!r}")
