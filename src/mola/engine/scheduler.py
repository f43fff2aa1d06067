"""Decides, in plain Python, what each engine step computes, and what each
sequence gets of what it computed.

Three collections: ``waiting`` (a FIFO deque), one prefill batch
(``prefilling``) whose prompts are being written into a KV cache chunk by
chunk, and ``running``, the rows of the decode batch in row order. Every step
decodes one token for each running row; a finished prefill batch joins the
decode batch in the same step.

With a prompt cache, a prompt whose prefix has KV state stored prefills only
the rest; what a sequence computed is stored when it joins the decode batch
(its prompt) and when it leaves it (prompt and output, for the next turn of a
conversation). The plan says which entries the runner reads, writes and drops.

With a KV budget (mola.engine.kv_budget), the queue's head leaves it only
when the batches still fit with it. Rows that outgrow the budget (optimistic
mode) are preempted before the step that would pass it, the youngest first
(a prefill batch in progress first): back to the queue's head with their
output, their KV stored in the prompt cache as a finished row's, prefilled
again from there when there is room. The oldest row always stays.

A step is :meth:`Scheduler.schedule` (sequences past their deadline end
first), the runner's run, then :meth:`Scheduler.postprocess`, which hands
each sequence its tokens and says what the engine tells the event loop.
"""

from __future__ import annotations

import logging
from collections import deque

from .kv_budget import KVBudget
from .outputs import SeqOutput
from .plan import StepPlan, StepResult, prefill_len, prefill_todo
from .prompt_cache import PrefixHit, PromptCache
from .sequence import FinishReason, Sequence, SequenceStatus
from .speculative import Speculator

log = logging.getLogger("mola.engine")

# Optimistic admission leaves room for the batch to grow this many steps.
ADMISSION_HEADROOM = 16


class Scheduler:
    def __init__(self, max_num_seqs: int = 32, prefill_step_size: int = 512, max_prefill_batch: int = 8,
                 prompt_cache: PromptCache | None = None, speculator: Speculator | None = None,
                 budget: KVBudget | None = None):
        self.max_num_seqs = max_num_seqs  # decode rows plus prefilling ones
        self.prefill_step_size = prefill_step_size  # prompt tokens per step
        self.max_prefill_batch = max_prefill_batch  # prompts prefilled together
        self.prompt_cache = prompt_cache  # None: no prompt cache
        self.speculator = speculator  # None: no speculative decoding
        self.budget = budget  # None: no KV budget
        self.num_preempted = 0  # rows sent back to the queue by the budget (each time)
        self.num_kv_waits = 0  # sequences that waited at the head of the queue for KV memory
        # Rows of the last plan if it was a plain decode step: the token it
        # samples for them is not known here until the step after.
        self._in_flight: set[int] = set()
        self._expired: list[Sequence] = []  # ended by their deadline, not yet reported
        self.waiting: deque[Sequence] = deque()
        self.prefilling: list[Sequence] = []  # the prefill batch
        self.prefill_done = 0  # columns of the prefill batch's prompts already prefilled
        self.running: list[Sequence] = []

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.prefilling) + len(self.running)

    def has_work(self) -> bool:
        return bool(self.waiting or self.prefilling or self.running)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    # ---- the KV budget --------------------------------------------------------

    def holding(self) -> list[Sequence]:
        """The sequences whose KV the batches hold: running and prefilling."""
        return [s for s in (*self.running, *self.prefilling) if not s.is_finished]

    def _fits(self, seqs: list[Sequence], headroom: int = 0) -> bool:
        return self.budget is None or self.budget.fits(seqs, headroom)

    def _preempt(self, plan: StepPlan) -> list[Sequence]:
        """Before a step that would pass the budget: the youngest rows (a prefill batch first) go back
        to the queue's head until it fits; the oldest row stays. Returns the decode rows preempted."""
        live = [s for s in self.running if not s.is_finished]
        if self.budget is None or self._fits(live + self.prefilling):
            return []
        if self.prefilling:
            plan.drop_prefill = True
            for seq in reversed(self.prefilling):
                if not seq.is_finished:
                    self._requeue(seq)
            self.prefilling, self.prefill_done = [], 0
        victims = []
        while len(live) > 1 and not self._fits(live):
            victims.append(live.pop())
        for seq in victims:  # the youngest first: the oldest ends up at the head
            self._requeue(seq)
        return victims

    def _requeue(self, seq: Sequence) -> None:
        seq.move_to(SequenceStatus.WAITING)
        seq.num_cached_tokens = 0
        seq.num_preemptions += 1
        self.num_preempted += 1
        self.waiting.appendleft(seq)
        log.info("sequence %d preempted by the KV budget at %d tokens", seq.seq_id, len(seq.context))

    def abort(self, seq_id: int) -> Sequence | None:
        """Finish the sequence with ABORT. Its row leaves at the next step."""
        for seq in self.waiting:
            if seq.seq_id == seq_id:
                self.waiting.remove(seq)
                seq.finish(FinishReason.ABORT)
                return seq
        for seq in (*self.prefilling, *self.running):
            if seq.seq_id == seq_id and not seq.is_finished:
                seq.finish(FinishReason.ABORT)
                return seq
        return None

    def take_batch(self) -> list[Sequence]:
        """Empty the decode batch and the prefill batch (their KV caches are
        gone after a failed step); returns their unfinished sequences."""
        taken = [s for s in (*self.prefilling, *self.running) if not s.is_finished]
        self.prefilling, self.prefill_done, self.running = [], 0, []
        self._in_flight = set()
        return taken

    def take_all(self) -> list[Sequence]:
        """Empty every collection (the engine is stopping); returns the
        unfinished sequences, queued ones first."""
        taken = [s for s in self.waiting if not s.is_finished]
        self.waiting.clear()
        return taken + self.take_batch()

    def fail(self, seqs: list[Sequence], message: str) -> list[SeqOutput]:
        """End ``seqs`` with ERROR (``message`` says why); returns their outputs."""
        for seq in seqs:
            seq.finish(FinishReason.ERROR)
        return [SeqOutput.of(seq, error=message) for seq in seqs]

    def fail_all(self, message: str) -> list[SeqOutput]:
        """The engine is stopping: what expired when the last step was
        planned, then every unfinished sequence, ended with ERROR."""
        return self.postprocess(None) + self.fail(self.take_all(), message)

    def expire(self, now: float) -> list[Sequence]:
        """Finish the sequences past their deadline: TIMEOUT for those that
        produced nothing yet, LENGTH for the others (running, or preempted)."""
        expired = []
        for seq in list(self.waiting):
            if seq.deadline is not None and now > seq.deadline:
                self.waiting.remove(seq)
                seq.finish(FinishReason.LENGTH if seq.output else FinishReason.TIMEOUT)
                expired.append(seq)
        for seq in (*self.prefilling, *self.running):
            if seq.deadline is not None and now > seq.deadline and not seq.is_finished:
                seq.finish(FinishReason.TIMEOUT if seq in self.prefilling and not seq.output
                           else FinishReason.LENGTH)
                expired.append(seq)
        return expired

    # ---- a step: schedule, (the runner runs,) postprocess -------------------

    def schedule(self, now: float | None = None) -> StepPlan:
        """The next step's plan. ``now`` (seconds, time.monotonic()) ends the
        sequences past their deadline first (reported by the next
        postprocess) and times the steps for speculation's cost model."""
        if now is not None:
            self._expired += self.expire(now)
        plan = StepPlan()
        self._drop_finished(plan, self._preempt(plan))
        if not self.prefilling:
            self._form_prefill(plan)
        if self.prefilling:
            self._advance_prefill(plan)
        plan.decode = list(self.running)
        if self.speculator is not None:
            plan.proposal = self.speculator.propose(plan.decode, self._in_flight)
            if now is not None:
                width = 1 + max(plan.proposal.num_draft) if plan.proposal is not None else None
                self.speculator.clock(now, len(plan.decode), width, plan.end > plan.start)
        self._in_flight = {s.seq_id for s in plan.decode} if plan.proposal is None else set()
        return plan

    def postprocess(self, result: StepResult | None) -> list[SeqOutput]:
        """What the event loop hears of a step: the sequences that expired
        when it was planned, then each row's new tokens (``result``: None
        when the step gave none), taken into its sequence up to the one that
        ends it. Rows finished or aborted while the step ran get nothing."""
        outputs = [SeqOutput.of(seq) for seq in self._expired]
        self._expired = []
        if result is None:
            return outputs
        for seq, tokens, lps, unfed in zip(result.rows, result.tokens, result.logprobs, result.last_unfed):
            if seq.is_finished:
                continue
            taken, error = seq.take(tokens, unfed)
            if error is not None:
                log.error("sequence %d left its grammar: %s", seq.seq_id, error)
            outputs.append(SeqOutput.of(seq, tokens[:taken], None if lps is None else lps[:taken], error))
        self._record_speculation(result.speculated)
        return outputs

    def _record_speculation(self, speculated: list[tuple[Sequence, int, int]]) -> None:
        """What a speculative step's rows accepted: (row, drafted, accepted)."""
        for seq, drafted, accepted in speculated if self.speculator is not None else ():
            self.speculator.record(seq, drafted, accepted)

    # ---- the plan's parts ---------------------------------------------------

    def _drop_finished(self, plan: StepPlan, preempted: list[Sequence]) -> None:
        """Finished and ``preempted`` rows leave the decode batch (their KV
        state, which holds the prompt and the output but a last unfed token,
        is stored first: a preempted row's comes back from it)."""
        leaving = set(map(id, preempted))
        kept = [i for i, s in enumerate(self.running) if not s.is_finished and id(s) not in leaving]
        if len(kept) == len(self.running):
            return
        for i, seq in enumerate(self.running):
            if seq.is_finished or id(seq) in leaving:
                fed = seq.output[:seq.num_output_tokens - seq.num_unfed_tokens]
                self._store(plan, plan.cache.store_rows, i, seq.cache_key, seq.prompt + fed)
            if id(seq) in leaving:
                plan.preempted.append((i, seq))
        plan.keep = kept
        self.running = [self.running[i] for i in kept]

    def _form_prefill(self, plan: StepPlan) -> None:
        room = self.max_num_seqs - len(self.running)
        batch: list[Sequence] = []
        hits: list[PrefixHit | None] = []
        longest = 0
        while self.waiting and len(batch) < min(room, self.max_prefill_batch):
            seq = self.waiting[0]
            if seq.is_finished:  # preempted, then ended by the token it had in flight
                self.waiting.popleft()
                continue
            # (optimistic: room for the batch to grow a while, or what it admits is preempted at once)
            if not self._fits([*self.holding(), *batch, seq], ADMISSION_HEADROOM):
                if not seq.waited_for_kv:
                    seq.waited_for_kv = True
                    self.num_kv_waits += 1
                break
            hit = self._lookup(seq)
            cols = max(longest, prefill_len(seq) - (hit.num_tokens if hit else 0))
            # Batch prompts only while the whole prefill batch fits in one
            # step; a long prompt is prefilled alone, chunk by chunk.
            if batch and cols * (len(batch) + 1) > self.prefill_step_size:
                break
            batch.append(self.waiting.popleft())
            hits.append(hit)
            longest = cols
        for seq, hit in zip(batch, hits):
            seq.move_to(SequenceStatus.PREFILLING)
            seq.num_cached_tokens = hit.num_tokens if hit else 0
            cacheable = any(key is not None for key, _ in seq.cached_parts)
            if self.prompt_cache is not None and cacheable and prefill_len(seq) > 0:
                self.prompt_cache.use(hit)
        self.prefilling, self.prefill_done = batch, 0
        plan.prefill_is_new = bool(batch)
        plan.cache.hits = hits

    def _lookup(self, seq: Sequence) -> PrefixHit | None:
        """The longest cached prefix of the row's parts (Sequence.cached_parts)."""
        if self.prompt_cache is None:
            return None
        hits = [self.prompt_cache.peek(key, tokens) for key, tokens in seq.cached_parts if key is not None]
        return max(filter(None, hits), key=lambda hit: hit.num_tokens, default=None)

    def _store(self, plan: StepPlan, where: list, index: int, key: tuple | None, tokens: list[int],
               held: int | None = None) -> None:
        """Give ``tokens`` an entry under ``key`` (a Sequence.cache_key) in the prompt
        cache, if it has none yet; the runner stores the KV state at ``index``
        (which holds ``held`` tokens; None: ``tokens``) under it."""
        if self.prompt_cache is None or key is None:
            return
        entry, dropped = self.prompt_cache.store(key, tokens, held)
        plan.cache.evict += dropped
        if entry is not None:
            where.append((index, entry, len(tokens)))

    def _advance_prefill(self, plan: StepPlan) -> None:
        """The prefill batch's next chunk; when it is the last, the batch's
        unfinished members join the decode batch."""
        total = max(prefill_todo(s) for s in self.prefilling)
        chunk = max(1, self.prefill_step_size // len(self.prefilling))
        plan.prefill = list(self.prefilling)
        plan.start = self.prefill_done
        plan.end = min(total, self.prefill_done + chunk)
        self.prefill_done = plan.end
        if plan.end < total:
            return
        plan.join = [i for i, s in enumerate(self.prefilling) if not s.is_finished]
        for i in plan.join:
            seq = self.prefilling[i]
            seq.move_to(SequenceStatus.RUNNING)
            self.running.append(seq)
            for key, tokens in seq.cached_parts:
                self._store(plan, plan.cache.store_joined, i, key, tokens, held=prefill_len(seq))
        self.prefilling, self.prefill_done = [], 0
