"""Decides, in plain Python, what each engine step computes.

Three collections: ``waiting`` (a FIFO deque), one prefill ``group`` whose
prompts are being written into a KV cache chunk by chunk, and ``running``, the
rows of the decode batch in row order. Every step decodes one token for each
running row; a finished prefill group joins the decode batch in the same step.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from .sequence import Sequence, SequenceStatus


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

    @property
    def is_empty(self) -> bool:
        return not self.decode and not self.group


def prefill_len(seq: Sequence) -> int:
    """Prompt tokens written by prefill: all but the last, which is the first
    input of the decode batch."""
    return seq.num_prompt_tokens - 1


class Scheduler:
    def __init__(self, max_num_seqs: int = 32, prefill_step_size: int = 512, max_group: int = 8):
        self.max_num_seqs = max_num_seqs  # decode rows plus prefilling ones
        self.prefill_step_size = prefill_step_size  # prompt tokens per step
        self.max_group = max_group  # prompts prefilled together
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

    def schedule(self) -> StepPlan:
        plan = StepPlan()
        kept = [i for i, s in enumerate(self.running) if not s.is_finished]
        if len(kept) < len(self.running):
            plan.keep = kept
            self.running = [self.running[i] for i in kept]

        if not self.group:
            self._form_group(plan)
        if self.group:
            self._advance_group(plan)
        plan.decode = list(self.running)
        return plan

    def _form_group(self, plan: StepPlan) -> None:
        room = self.max_num_seqs - len(self.running)
        group: list[Sequence] = []
        longest = 0
        while self.waiting and len(group) < min(room, self.max_group):
            seq = self.waiting[0]
            cols = max(longest, prefill_len(seq))
            # Batch prompts only while the whole group fits in one step; a
            # long prompt is prefilled alone, chunk by chunk.
            if group and cols * (len(group) + 1) > self.prefill_step_size:
                break
            group.append(self.waiting.popleft())
            longest = cols
        for seq in group:
            seq.status = SequenceStatus.PREFILLING
        self.group, self.group_done = group, 0
        plan.group_is_new = bool(group)

    def _advance_group(self, plan: StepPlan) -> None:
        total = max(prefill_len(s) for s in self.group)
        chunk = max(1, self.prefill_step_size // len(self.group))
        plan.group = list(self.group)
        plan.start = self.group_done
        plan.end = min(total, self.group_done + chunk)
        self.group_done = plan.end
        if plan.end < total:
            return
        plan.join = [i for i, s in enumerate(self.group) if not s.is_finished]
        for i in plan.join:
            self.group[i].status = SequenceStatus.RUNNING
            self.running.append(self.group[i])
        self.group, self.group_done = [], 0
