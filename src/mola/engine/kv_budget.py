"""The KV budget: how much KV cache the decode and prefill batches may hold,
counted in plain Python from token counts (no arrays).

A batch's cache is mlx-lm's BatchKVCache: every row is as wide as the
longest row (shorter ones are left-padded), and the buffer grows by
``STEP`` positions at a time, so a batch of ``n`` rows whose longest row
holds ``w`` tokens takes at most ``n * (w + STEP)`` positions. All rows
grow one position per decode step together.

Admission (Scheduler._form_prefill) asks whether the batch, with one more
sequence, stays within the budget:

- ``reserve``: at every future step, with each row allowed to run to its
  ``max_tokens`` (:func:`peak`); admitted rows then never outgrow it.
- ``optimistic``: for the next steps only (ADMISSION_HEADROOM of them when
  admitting, the next step's while running). Rows that outgrow the budget later are
  preempted, the youngest first, and recomputed when there is room again
  (their KV goes to the prompt cache, if there is one, so that most of it
  comes back as a prefix hit).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from mlx_lm.models.cache import BatchKVCache

from .config import KV_ADMISSION_MODES as ADMISSION_MODES
from .config import KV_FREE_SHARE, EngineConfig
from .memory import gib
from .outputs import KVStats

if TYPE_CHECKING:
    from .sequence import Sequence

log = logging.getLogger("mola.engine")
STEP = BatchKVCache.step  # positions a batch cache grows by at a time


def peak(rows: list[tuple[int, int]]) -> int:
    """The most KV positions a batch of ``rows`` may hold at any step from
    now: each row is (tokens in its KV now, steps it may still grow); a row
    leaves after its last step. At step k the rows still there hold
    ``len(rows) * (longest + k + STEP)``; that is largest just before a row
    leaves, so the candidates are each row's last step."""
    most, alive, longest = 0, 0, 0
    for length, steps in sorted(rows, key=lambda r: -r[1]):
        alive += 1
        longest = max(longest, length)
        most = max(most, alive * (longest + steps + STEP))
    return most


def held(seq: Sequence) -> int:
    """Tokens in a row's KV, at most: its prompt and output (and the token in
    flight, which the allocation step covers)."""
    return seq.num_prompt_tokens + seq.num_output_tokens


@dataclass(frozen=True)
class KVBudget:
    """What the batches' KV caches may hold: ``capacity`` positions of
    ``bytes_per_token`` bytes each (every layer, keys and values, the draft
    model's too)."""

    capacity: int  # KV positions (a row's token in every layer)
    bytes_per_token: int
    mode: str = "reserve"
    step_width: int = 1  # positions a step may add to a row (1 + a speculative step's drafts)

    def row(self, seq: Sequence, reserve: bool, headroom: int = 0) -> tuple[int, int]:
        """What the budget counts of a row: (tokens in its KV, steps it may
        still grow): to its max_tokens when reserving, else the token in
        flight and the next step's, and ``headroom`` steps more."""
        remaining = seq.params.max_tokens - seq.num_output_tokens + 1
        return held(seq), remaining if reserve else min(remaining, self.step_width + 1 + headroom)

    def positions(self, seqs: list[Sequence], reserve: bool, headroom: int = 0) -> int:
        """KV positions a batch of ``seqs`` may hold (:func:`peak`)."""
        return peak([self.row(s, reserve, headroom) for s in seqs])

    def fits(self, seqs: list[Sequence], headroom: int = 0) -> bool:
        """A batch of ``seqs`` stays within the budget, as the mode counts it."""
        return self.positions(seqs, self.mode == "reserve", headroom) <= self.capacity

    def stats(self, seqs: list[Sequence], held_bytes: int, preemptions: int, waits: int) -> KVStats:
        """What /health and /metrics show of a batch of ``seqs`` (rows and prefilling)."""
        return KVStats(budget_bytes=self.nbytes, mode=self.mode,
                       used_bytes=peak([(held(s), 0) for s in seqs]) * self.bytes_per_token,
                       reserved_bytes=self.positions(seqs, reserve=True) * self.bytes_per_token,
                       held_bytes=held_bytes, preemptions=preemptions, waits=waits)

    def __post_init__(self):
        if self.mode not in ADMISSION_MODES:
            raise ValueError(f"KV admission must be one of {', '.join(ADMISSION_MODES)}, got {self.mode!r}")
        if self.capacity < 1 or self.bytes_per_token < 1:
            raise ValueError(f"a KV budget needs a capacity and bytes per token, got {self}")

    @classmethod
    def of_bytes(cls, nbytes: int, bytes_per_token: int, mode: str = "reserve") -> KVBudget:
        return cls(max(1, nbytes // bytes_per_token), bytes_per_token, mode)

    @property
    def nbytes(self) -> int:
        return self.capacity * self.bytes_per_token

    def alone(self, prompt_tokens: int, max_tokens: int) -> int:
        """Positions one request needs with the batch to itself, at its
        longest: its prompt and every token it may add (and one computed
        after its last, as the pipelined decode does)."""
        return peak([(prompt_tokens, max_tokens + 1)])

    def max_tokens_for(self, prompt_tokens: int) -> int:
        """The most tokens a request with this prompt can be given alone."""
        return self.capacity - STEP - prompt_tokens - 1

    def refusal(self, prompt_tokens: int, max_tokens: int) -> str | None:
        """Why a request can never run within the budget (None: it can)."""
        need = self.alone(prompt_tokens, max_tokens)
        if need <= self.capacity:
            return None
        return (f"this request's KV cache ({prompt_tokens} prompt tokens + max_tokens {max_tokens}) needs "
                f"{need * self.bytes_per_token:,} bytes, more than the server's KV budget of "
                f"{self.nbytes:,} bytes (--kv-cache-bytes); send a shorter prompt or a smaller max_tokens")


def make_kv_budget(config: EngineConfig, bytes_per_token: int, max_model_len: int | None,
                   free: int | None) -> KVBudget | None:
    """The budget --kv-cache-bytes asks for (None: 0, no budget). Auto, the
    default: KV_FREE_SHARE of what is ``free`` (bytes, once the base is
    resident; the slot packs hold nothing yet, and grow into the rest, each
    growth checked against what the budget leaves: engine/memory.py) after
    the prompt cache's budget, capped at what
    every row at the model's full context takes; no budget when neither is known."""
    nbytes = config.kv_cache_bytes
    if nbytes is None:
        cap = None
        if max_model_len is not None:
            cap = peak([(max_model_len + 1, 0)] * config.max_num_seqs) * bytes_per_token
        if free is not None:
            share = int(KV_FREE_SHARE * max(0, free - config.prompt_cache_bytes))
            # never so little that one request at the full context (or 4096 tokens) cannot run
            floor = peak([((max_model_len or 4096) + 1, 0)]) * bytes_per_token
            if share < floor:
                log.warning("little memory is free for the KV cache (%s): the KV budget is one request at "
                            "the full context, %s; set --kv-cache-bytes", gib(share), gib(floor))
            nbytes = max(share, floor) if cap is None else min(max(share, floor), cap)
        else:
            nbytes = cap
    if not nbytes:
        return None
    spec = config.speculative
    budget = KVBudget(max(1, nbytes // bytes_per_token), bytes_per_token, config.kv_admission,
                      1 + (spec.num_draft_tokens if spec is not None else 0))
    log.info("KV budget: %s (%d positions of %d bytes; %s admission)", gib(budget.nbytes), budget.capacity,
             bytes_per_token, budget.mode)
    return budget
