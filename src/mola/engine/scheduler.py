"""Decides, in plain Python, what each engine step computes.

Three collections: ``waiting`` (a FIFO deque), one prefill ``group`` whose
prompts are being written into a KV cache chunk by chunk, and ``running``, the
rows of the decode batch in row order. Every step decodes one token for each
running row; a finished prefill group joins the decode batch in the same step.

With a prompt cache, a prompt whose prefix has KV state stored prefills only
the rest; what a sequence computed is stored when it joins the decode batch
(its prompt) and when it leaves it (prompt and output, for the next turn of a
conversation). The plan says which entries the runner reads, writes and drops.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from .prompt_cache import PrefixHit, PromptCache
from .sequence import Sequence, SequenceStatus
from .speculative import Speculator


@dataclass
class StepPlan:
    """What the runner does in one step, in this order."""

    # Rows of the previous decode batch to keep (indices); None keeps all.
    keep: list[int] | None = None
    # The prefill group, its columns [start, end) processed this step.
    group: list[Sequence] = field(default_factory=list)
    group_is_new: bool = False  # the runner makes the group's cache first
    start: int = 0
    end: int = 0
    # Members of the group (indices into it) joining the decode batch now;
    # None: the group is still prefilling.
    join: list[int] | None = None
    # This step's decode rows, in row order: kept rows, then joined ones.
    decode: list[Sequence] = field(default_factory=list)
    # The prompt cache, in the order the runner acts: rows of the previous
    # decode batch to store before they leave, as (row, entry id, tokens);
    # the cached prefix of each member of a new group (None: none); members
    # to store as they join, as (index into the group, entry id, tokens);
    # entries to drop once the step is done.
    store_rows: list[tuple[int, int, int]] = field(default_factory=list)
    hits: list[PrefixHit | None] = field(default_factory=list)
    store_joined: list[tuple[int, int, int]] = field(default_factory=list)
    evict: list[int] = field(default_factory=list)
    # Speculation: per decode row, how many tokens it drafted (0: it decodes
    # one), and prompt lookup's drafts (None: the draft model drafts them on
    # the device). num_draft None: a plain decode step, pipelined.
    num_draft: list[int] | None = None
    draft_tokens: list[list[int]] | None = None

    @property
    def is_empty(self) -> bool:
        return not self.decode and not self.group


def prefill_len(seq: Sequence) -> int:
    """Prompt tokens written by prefill: all but the last, which is the first
    input of the decode batch."""
    return seq.num_prompt_tokens - 1


def prefill_todo(seq: Sequence) -> int:
    """Prompt tokens prefill computes: those the prompt cache did not hold."""
    return prefill_len(seq) - seq.num_cached_tokens


class Scheduler:
    def __init__(self, max_num_seqs: int = 32, prefill_step_size: int = 512, max_group: int = 8,
                 prompt_cache: PromptCache | None = None, speculator: Speculator | None = None):
        self.max_num_seqs = max_num_seqs  # decode rows plus prefilling ones
        self.prefill_step_size = prefill_step_size  # prompt tokens per step
        self.max_group = max_group  # prompts prefilled together
        self.prompt_cache = prompt_cache  # None: no prompt cache
        self.speculator = speculator  # None: no speculative decoding
        # Rows of the last plan if it was a plain decode step: the token it
        # samples for them is not known here until the step after.
        self._in_flight: set[int] = set()
        self.waiting: deque[Sequence] = deque()
        self.group: list[Sequence] = []
        self.group_done = 0  # columns of the group's prompts already prefilled
        self.running: list[Sequence] = []

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.group) + len(self.running)

    def has_work(self) -> bool:
        return bool(self.waiting or self.group or self.running)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def abort(self, seq_id: int) -> Sequence | None:
        """Finish the sequence with "abort". Its row leaves at the next step."""
        for seq in self.waiting:
            if seq.seq_id == seq_id:
                self.waiting.remove(seq)
                seq.finish("abort")
                return seq
        for seq in (*self.group, *self.running):
            if seq.seq_id == seq_id and not seq.is_finished:
                seq.finish("abort")
                return seq
        return None

    def take_batch(self) -> list[Sequence]:
        """Empty the decode batch and the prefill group (their KV caches are
        gone after a failed step); returns their unfinished sequences."""
        taken = [s for s in (*self.group, *self.running) if not s.is_finished]
        self.group, self.group_done, self.running = [], 0, []
        self._in_flight = set()
        return taken

    def take_all(self) -> list[Sequence]:
        """Empty every collection (the engine is stopping); returns the
        unfinished sequences, queued ones first."""
        taken = [s for s in self.waiting if not s.is_finished]
        self.waiting.clear()
        return taken + self.take_batch()

    def expire(self, now: float) -> list[Sequence]:
        """Finish the sequences past their deadline: "timeout" for those not yet
        running (they produced nothing), "length" for running ones."""
        expired = []
        for seq in list(self.waiting):
            if seq.deadline is not None and now > seq.deadline:
                self.waiting.remove(seq)
                seq.finish("timeout")
                expired.append(seq)
        for seq in (*self.group, *self.running):
            if seq.deadline is not None and now > seq.deadline and not seq.is_finished:
                seq.finish("timeout" if seq in self.group else "length")
                expired.append(seq)
        return expired

    def schedule(self, now: float | None = None) -> StepPlan:
        """The next step's plan; ``now`` (seconds, a monotonic clock) times
        the steps for speculation's cost model."""
        plan = StepPlan()
        kept = [i for i, s in enumerate(self.running) if not s.is_finished]
        if len(kept) < len(self.running):
            for i, seq in enumerate(self.running):
                if seq.is_finished:  # its KV state holds the prompt and its output (but a last unfed token)
                    fed = seq.output[:seq.num_output_tokens - seq.num_unfed_tokens]
                    self._store(plan, plan.store_rows, i, seq, seq.prompt + fed)
            plan.keep = kept
            self.running = [self.running[i] for i in kept]

        if not self.group:
            self._form_group(plan)
        if self.group:
            self._advance_group(plan)
        plan.decode = list(self.running)
        if self.speculator is not None:
            proposal = self.speculator.propose(plan.decode, self._in_flight)
            if proposal is not None:
                plan.num_draft, plan.draft_tokens = proposal.num_draft, proposal.tokens
            if now is not None:
                width = 1 + max(plan.num_draft) if plan.num_draft is not None else None
                self.speculator.clock(now, len(plan.decode), width, plan.end > plan.start)
        self._in_flight = {s.seq_id for s in plan.decode} if plan.num_draft is None else set()
        return plan

    def record_speculation(self, speculated: list[tuple[Sequence, int, int]]) -> None:
        """What a speculative step's rows accepted: (row, drafted, accepted)."""
        for seq, drafted, accepted in speculated if self.speculator is not None else ():
            self.speculator.record(seq, drafted, accepted)

    def _form_group(self, plan: StepPlan) -> None:
        room = self.max_num_seqs - len(self.running)
        group: list[Sequence] = []
        hits: list[PrefixHit | None] = []
        longest = 0
        while self.waiting and len(group) < min(room, self.max_group):
            seq = self.waiting[0]
            hit = self._lookup(seq)
            cols = max(longest, prefill_len(seq) - (hit.num_tokens if hit else 0))
            # Batch prompts only while the whole group fits in one step; a
            # long prompt is prefilled alone, chunk by chunk.
            if group and cols * (len(group) + 1) > self.prefill_step_size:
                break
            group.append(self.waiting.popleft())
            hits.append(hit)
            longest = cols
        for seq, hit in zip(group, hits):
            seq.status = SequenceStatus.PREFILLING
            seq.num_cached_tokens = hit.num_tokens if hit else 0
            if self.prompt_cache is not None and seq.cache_key is not None and prefill_len(seq) > 0:
                self.prompt_cache.use(hit)
        self.group, self.group_done = group, 0
        plan.group_is_new = bool(group)
        plan.hits = hits

    def _lookup(self, seq: Sequence) -> PrefixHit | None:
        if self.prompt_cache is None or seq.cache_key is None:
            return None
        return self.prompt_cache.peek(seq.cache_key, seq.prompt[:-1])

    def _store(self, plan: StepPlan, where: list, index: int, seq: Sequence, tokens: list[int]) -> None:
        """Give ``tokens`` of ``seq`` an entry in the prompt cache, if it has
        none yet; the runner stores the KV state at ``index`` under it."""
        if self.prompt_cache is None or seq.cache_key is None:
            return
        entry, dropped = self.prompt_cache.store(seq.cache_key, tokens)
        plan.evict += dropped
        if entry is not None:
            where.append((index, entry, len(tokens)))

    def _advance_group(self, plan: StepPlan) -> None:
        total = max(prefill_todo(s) for s in self.group)
        chunk = max(1, self.prefill_step_size // len(self.group))
        plan.group = list(self.group)
        plan.start = self.group_done
        plan.end = min(total, self.group_done + chunk)
        self.group_done = plan.end
        if plan.end < total:
            return
        plan.join = [i for i, s in enumerate(self.group) if not s.is_finished]
        for i in plan.join:
            seq = self.group[i]
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            self._store(plan, plan.store_joined, i, seq, seq.prompt[:-1])
        self.group, self.group_done = [], 0
