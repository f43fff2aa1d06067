"""The engine's settings: frozen dataclasses, checked when they are made."""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_PROMPT_CACHE_BYTES = 1 << 30  # 1 GiB of KV state
# --kv-cache-bytes auto: this share of the memory free once the base, its
# slot packs and the prompt cache are counted (the rest stays for the step's
# activations, other bases and the machine), and no more than every row at
# the model's full context takes.
KV_FREE_SHARE = 0.5
KV_ADMISSION_MODES = ("optimistic", "reserve")
KV_BITS = (4, 8)  # --kv-bits
KV_GROUP_SIZES = (32, 64, 128)  # --kv-group-size (mx.quantize's)
DEFAULT_EXPERT_SLOTS = 4  # adapter slots that can also carry expert LoRA (--max-expert-loras)
DEFAULT_EXPERT_RANK = 16  # the largest rank in the experts (--max-expert-lora-rank)
SPECULATIVE_METHODS = ("ngram", "draft")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding: rows draft tokens that the target model verifies
    in one forward pass of the whole batch (see mola.engine.speculative)."""

    method: str = "ngram"  # "ngram": prompt lookup; "draft": a draft model
    num_draft_tokens: int = 8  # most tokens a row drafts in one step
    prompt_lookup_min: int = 2  # n-gram sizes prompt lookup matches, the longest first
    prompt_lookup_max: int = 4
    max_batch: int = 8  # a step with more decode rows than this does not speculate
    draft_model: str | None = None  # "draft": a local directory or hub id, same tokenizer
    # Speculate only when the learned step costs say it pays; False: whenever
    # a row drafts (for tests and measurements of the verification itself).
    cost_aware: bool = True

    def __post_init__(self):
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative method must be one of {', '.join(SPECULATIVE_METHODS)}, "
                             f"got {self.method!r}")
        for name in ("num_draft_tokens", "prompt_lookup_min", "max_batch"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.prompt_lookup_max < self.prompt_lookup_min:
            raise ValueError(f"prompt_lookup_max ({self.prompt_lookup_max}) must be at least "
                             f"prompt_lookup_min ({self.prompt_lookup_min})")
        if self.method == "draft" and self.draft_model is None:
            raise ValueError("--speculative draft needs a --draft-model")
        if self.method != "draft" and self.draft_model is not None:
            raise ValueError(f"--draft-model is used by --speculative draft only, not by --speculative "
                             f"{self.method}")

@dataclass(frozen=True)
class EngineConfig:
    max_loras: int = 8  # adapter slots (slot 0, the base model, comes on top)
    max_lora_rank: int = 64
    # Slots 1..expert_slots can also carry LoRA on the experts of a mixture
    # of experts, of rank up to max_expert_rank there (an expert slot weighs
    # E times a dense one); bases without experts ignore both.
    expert_slots: int | None = None  # None: DEFAULT_EXPERT_SLOTS, or max_loras if fewer
    max_expert_rank: int = DEFAULT_EXPERT_RANK
    max_num_seqs: int = 32  # rows decoded together
    prefill_step_size: int = 512  # prompt tokens prefilled per step
    # KV state of earlier prompts (and outputs) kept for reuse; 0: no prompt cache.
    prompt_cache_bytes: int = DEFAULT_PROMPT_CACHE_BYTES
    speculative: SpeculativeConfig | None = None  # None: no speculative decoding
    # What the decode and prefill batches' KV caches may hold (mola.engine.kv_budget);
    # None: auto (KV_FREE_SHARE), 0: no budget.
    kv_cache_bytes: int | None = None
    # "optimistic": admit when the prompt fits, preempt the youngest rows when the
    # batch outgrows the budget; "reserve": admit when the prompt and max_tokens fit.
    kv_admission: str = "optimistic"
    # Keys and values quantized to this many bits (mlx-lm's QuantizedKVCache) in groups of
    # kv_group_size along the head dimension; None: the model's dtype.
    kv_bits: int | None = None
    kv_group_size: int = 64
    # The slot packs shrink to fit what is loaded once the engine has been idle this long
    # (seconds; under traffic they shrink only lazily: mola.lora.pack), so that short lulls
    # in bursty traffic do not copy them down and up again.
    pack_compact_idle_s: float = 5.0

    def __post_init__(self):
        for name in ("max_loras", "max_lora_rank", "max_num_seqs", "prefill_step_size", "max_expert_rank"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.expert_slots is None:
            object.__setattr__(self, "expert_slots", min(self.max_loras, DEFAULT_EXPERT_SLOTS))
        if not 0 <= self.expert_slots <= self.max_loras:
            raise ValueError(f"expert_slots must be in 0..max_loras ({self.max_loras}), got {self.expert_slots}")
        if isinstance(self.prompt_cache_bytes, bool) or not isinstance(self.prompt_cache_bytes, int) \
                or self.prompt_cache_bytes < 0:
            raise ValueError(f"prompt_cache_bytes must be a whole number of bytes >= 0, "
                             f"got {self.prompt_cache_bytes!r}")
        if self.kv_cache_bytes is not None and (isinstance(self.kv_cache_bytes, bool)
                                                or not isinstance(self.kv_cache_bytes, int)
                                                or self.kv_cache_bytes < 0):
            raise ValueError(f"kv_cache_bytes must be a whole number of bytes >= 0, or auto, "
                             f"got {self.kv_cache_bytes!r}")
        if self.kv_bits is not None and self.kv_bits not in KV_BITS:
            raise ValueError(f"kv_bits must be one of {', '.join(map(str, KV_BITS))}, got {self.kv_bits!r}")
        if self.kv_group_size not in KV_GROUP_SIZES:
            raise ValueError(f"kv_group_size must be one of {', '.join(map(str, KV_GROUP_SIZES))}, "
                             f"got {self.kv_group_size!r}")
        if not self.pack_compact_idle_s >= 0:
            raise ValueError(f"pack_compact_idle_s must be >= 0, got {self.pack_compact_idle_s!r}")
        if self.kv_admission not in KV_ADMISSION_MODES:
            raise ValueError(f"kv_admission must be one of {', '.join(KV_ADMISSION_MODES)}, "
                             f"got {self.kv_admission!r}")

    @property
    def kv_quant(self) -> tuple[int, int] | None:
        """(bits, group size) of a quantized KV cache; None: not quantized."""
        return None if self.kv_bits is None else (self.kv_bits, self.kv_group_size)
