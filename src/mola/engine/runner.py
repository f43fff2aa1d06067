"""The only place where the engine builds arrays and evaluates the model.

The runner owns the decode batch's state, one row per running sequence in
the scheduler's row order: mlx-lm KV caches, a PRNG key per row, the next
input token per row (still on the device), and token counts for penalties.
It also owns the prefill batch being written. It follows the scheduler's
:class:`StepPlan` exactly: drop finished rows, prefill one chunk of the
prefill batch (right-padded, as mlx-lm's own batch generator does), let a
finished prefill batch join, then launch one decode step for every row.

Decode is pipelined, as mlx-lm's generator does it: a step is launched with
``mx.async_eval`` and its tokens are read back at the next step, after that
step was launched, so the device never waits for Python between steps. A
sequence that finished is therefore computed one step too many; its extra
token is dropped by the engine.

With a prompt cache the runner also holds the cached KV state (a KVStore),
and follows the plan's cache orders: store a leaving row or a joining member,
start a prefill batch's member from a cached prefix, drop entries.

Rows under a grammar (``Sequence.constraint``) are sampled through one
``where`` over the batch's [B, V] mask, filled while the step's forward pass
runs (see :meth:`ModelRunner.run`); a batch without one pays nothing.

A speculative step feeds each row its input and its drafts, verifies them in
one forward pass (mola.engine.verify) and reads its tokens back at its end.
A draft model has caches of its own beside the target's (ModelCaches), and
it is fed whatever the target is fed, so both always hold the same tokens.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.cache import KVCache, RotatingKVCache

from ..lora.pack import AdapterPacks
from . import verify
from .caches import ModelCaches, held_nbytes
from .constraint import MaskFiller
from .kv_store import KVStore, kv_bytes_per_token, kv_cost, measured_caches
from .logits import add_biases, apply_bitmask, count_tokens, output_counts, penalize
from .plan import StepPlan, StepResult
from .prefill import PrefillBatch
from .sampling import row_keys, sample
from .sequence import Sequence
from .steps import Forward, Launch, RunnerStats, advance_matchers, read_launch, token_logprobs
from . import vision_rows

__all__ = ["ModelRunner", "RunnerStats", "StepResult"]

CLEAR_CACHE_EVERY = 256  # steps between returns of MLX's buffer cache


class ModelRunner:
    def __init__(self, model: nn.Module, packs: AdapterPacks, vocab_size: int, prompt_cache: bool = False,
                 draft: nn.Module | None = None, kv_quant: tuple[int, int] | None = None):
        self.model = model
        self.is_vision = hasattr(model, "image_rows")  # a vision base: rows carry positions (vision_rows)
        self.draft = draft  # a draft model, fed what the target is fed (None: none)
        self.packs = packs
        self.routing = packs.routing
        self.vocab_size = vocab_size
        self.kv_quant = kv_quant  # (bits, group size) of a quantized KV cache (--kv-bits); None: not
        # Speculation needs caches it can cut back by a step's drafts, per row: full ones, and the
        # target's sliding windows (verify.rewind_window); a draft model's are fed one token at a time.
        caches = self._new_cache()
        self.can_rewind = all(type(c) in (KVCache, RotatingKVCache) for c in caches.target) \
            and all(type(c) is KVCache for c in caches.draft)
        self.has_windows = any(type(c) is RotatingKVCache for c in caches.target)  # (verify.order_windows)
        # The prompt cache's KV state, and what it takes (None: no prompt cache, or caches it cannot snapshot).
        self.kv = KVStore()
        measured = measured_caches(model, self.routing, draft, kv_quant)  # one pass, never evaluated
        self.kv_cost = kv_cost(measured) if prompt_cache else None
        self.kv_position_bytes = kv_bytes_per_token(measured) or 1  # (budget)
        # Decode rows, aligned with the scheduler's running list:
        self.cache: ModelCaches | None = None  # one batch cache per layer of each model
        self.keys: mx.array | None = None  # [B, 2] PRNG key per row
        self.inputs: mx.array | None = None  # [B] next input token per row
        self.counts: mx.array | None = None  # [B, V] generated-token counts (penalties only)
        self.inflight: Launch | None = None
        self.masks = MaskFiller()  # next-token masks of constrained rows
        self.prefill: PrefillBatch | None = None  # the prefill batch being written
        self.num_steps = 0
        self.stats = RunnerStats()

    @property
    def num_rows(self) -> int:
        return 0 if self.keys is None else self.keys.shape[0]

    def reset(self) -> None:
        """Drop every cache and the step in flight (after a failed step)."""
        self.cache = self.keys = self.inputs = self.counts = self.inflight = None
        self.prefill = None
        self.routing.clear()
        self.kv.clear()

    def run(self, plan: StepPlan) -> StepResult | None:
        """Execute ``plan``; returns the tokens read back this step (None when
        there are none): a plain step's are read at the next step, a
        speculative step's at its end."""
        if plan.keep is not None:
            for row, entry, num_tokens in plan.cache.store_rows:
                self.kv.put(entry, self.cache, row, num_tokens)
            for row, seq in plan.preempted:  # it goes on sampling from where it was when it rejoins
                seq.resume_key = tuple(np.array(self.keys[row]).tolist())
            self._keep_rows(plan.keep)
        if plan.drop_prefill:
            self.prefill = None
        if plan.prefill:
            self._prefill(plan)
        previous, self.inflight = self.inflight, None
        if plan.proposal is not None:
            result = self._speculate(plan, previous)
        else:
            result = self._decode(plan, previous)
        self.kv.drop(plan.cache.evict)
        # the decode and prefill batches' caches
        self.stats.kv_bytes = held_nbytes(self.cache) + held_nbytes(self.prefill.cache if self.prefill else None)
        self.stats.peak_kv_bytes = max(self.stats.peak_kv_bytes, self.stats.kv_bytes)
        self.num_steps += 1
        if self.num_steps % CLEAR_CACHE_EVERY == 0:
            mx.clear_cache()
        return result

    def _decode(self, plan: StepPlan, previous: Launch | None) -> StepResult | None:
        """A plain step, launched and left in flight; returns the previous one.

        With a constrained row in the batch, sampling waits for the masks:
        the forward pass is launched first, and while it runs the previous
        tokens are read back, the matchers advance on them and the bitmask
        is filled; then the masks are applied and the rows sampled."""
        forward = self._forward(plan.decode) if plan.decode else None
        if forward is not None and is_constrained(forward.rows):
            bitmask, result = self._masks_after(forward, previous)
            self.inflight = self._sample(forward, bitmask)
            return result
        if forward is not None:
            self.inflight = self._sample(forward)
        result = read_launch(previous) if previous is not None else None
        # the rows of an unconstrained batch need no matcher, but a constrained row preempted
        # out of it this step still takes the token it had in flight
        return advance_matchers(result) if plan.preempted else result

    def _speculate(self, plan: StepPlan, previous: Launch | None) -> StepResult | None:
        """A speculative step: verify every row's drafts in one forward pass
        (the previous step's tokens are read back while it runs) and read
        this step's tokens back too."""
        rows, num_draft, width = plan.decode, plan.proposal.num_draft, max(plan.proposal.num_draft)
        if plan.proposal.tokens is not None:
            drafts = verify.draft_array(plan.proposal.tokens, width)  # [B, D]
        else:
            drafts = verify.draft_with_model(self.draft, self.cache.draft, self.inputs, width, self.vocab_size)
        forward = self._forward(rows, drafts)
        constrained = is_constrained(rows)
        bitmask, result = self._masks_after(forward, previous) if constrained else (None, None)
        launched, self.inputs, self.keys, self.counts = verify.launch(
            forward, drafts, num_draft, self.keys, self.counts, bitmask)
        if not constrained and previous is not None:
            result = read_launch(previous)
            if plan.preempted:  # a constrained row preempted out of the batch still takes its token
                advance_matchers(result)
        mine, rejected = verify.read(launched)  # waits for the step
        verify.rewind(self.cache.layers, rejected)
        advance_matchers(mine)
        self.stats.count_speculation(mine, num_draft)
        return mine if result is None else result.extend(mine)

    def _masks_after(self, forward: Forward, previous: Launch | None) -> tuple[np.ndarray, StepResult | None]:
        """A batch with a constrained row: its masks follow the previous
        step's tokens. While ``forward`` runs, read those back, advance the
        matchers on them and fill the bitmask [B, W]; returns it and the
        previous step's result."""
        mx.async_eval(forward.logits, forward.processed)
        result = read_launch(previous) if previous is not None else None
        advance_matchers(result)
        constraints = [s.constraint for s in forward.rows]
        self.stats.masked_steps += 1
        self.stats.masked_rows += sum(c is not None for c in constraints)
        return self.masks.fill(constraints), result

    # ---- rows -------------------------------------------------------------

    def _keep_rows(self, keep: list[int]) -> None:
        if not keep:
            self.cache = self.keys = self.inputs = self.counts = None
            return
        for c in self.cache.layers:
            c.filter(keep)
        idx = mx.array(keep, dtype=mx.int32)
        self.keys, self.inputs = self.keys[idx], self.inputs[idx]
        if self.counts is not None:
            self.counts = self.counts[idx]

    def _append_rows(self, cache: ModelCaches, seqs: list[Sequence]) -> None:
        """Rows join: new ones, and preempted ones with their keys and (penalties) counts."""
        keys = row_keys(seqs)
        inputs = mx.array([s.last_token for s in seqs], dtype=mx.uint32)
        if self.counts is None and any(s.params.has_penalties and s.output for s in seqs):
            self.counts = mx.zeros((self.num_rows, self.vocab_size))
        if self.cache is None:
            self.cache, self.keys, self.inputs = cache, keys, inputs
        else:
            self.cache.extend(cache)
            self.keys = mx.concatenate([self.keys, keys])
            self.inputs = mx.concatenate([self.inputs, inputs])
        if self.counts is not None:
            self.counts = mx.concatenate([self.counts, output_counts(seqs, self.vocab_size)])
        mx.eval([c.state for c in self.cache.layers], self.keys, self.inputs)

    # ---- prefill ------------------------------------------------------------

    def _feed(self, tokens: mx.array, cache: ModelCaches, **vision) -> mx.array:
        """Run the target on ``tokens`` [B, L] over its caches (a vision base
        also on ``vision``: embeds, positions), and the draft model, if any,
        over its own; returns the target's logits."""
        logits = self.model(tokens, cache=cache.target, **vision)  # [B, L, V]
        if self.draft is not None:
            self.draft(tokens, cache=cache.draft)
        return logits

    def _prefill(self, plan: StepPlan) -> None:
        members = plan.prefill
        if plan.prefill_is_new:
            hits = plan.cache.hits or [None] * len(members)
            self.prefill = PrefillBatch.start(
                members, [self.kv.view(h.entry, h.num_tokens) if h else self._new_cache() for h in hits],
                [h.num_tokens if h else 0 for h in hits])
            if self.is_vision:  # the vision tower runs here, once per image row not cached
                self.prefill.images = vision_rows.start_rows(self.model, self.routing, members,
                                                                  self.prefill.done)
        if plan.end > plan.start:
            self.stats.prefill_tokens += self.prefill.num_tokens(plan.start, plan.end)
            self.routing.set([s.slot for s in members], [s.lora_scale for s in members],
                             self.prefill.active(members, plan.start, plan.end))
            tokens = self.prefill.tokens[:, plan.start : plan.end]
            vision = vision_rows.prefill_inputs(self.model, self.prefill, tokens, plan.start, plan.end) \
                if self.is_vision else {}
            self._feed(tokens, self.prefill.cache, **vision)
            mx.eval([c.state for c in self.prefill.cache.layers])
        if plan.join is not None:
            self._join(members, plan)

    def _new_cache(self) -> ModelCaches:
        return ModelCaches.new(self.model, self.draft, self.kv_quant)

    def _join(self, members: list[Sequence], plan: StepPlan) -> None:
        cache, join = self.prefill.finish(), plan.join
        for member, entry, num_tokens in plan.cache.store_joined:
            self.kv.put(entry, cache, member, num_tokens)
        self.prefill = None
        if not join:
            return
        if len(join) < len(members):
            for c in cache.layers:
                c.filter(join)
        self._append_rows(cache, [members[i] for i in join])

    # ---- decode -------------------------------------------------------------

    def _forward(self, rows: list[Sequence], drafts: mx.array | None = None) -> Forward:
        """Every row's next input, and in a speculative step its drafts [B, D]
        after it (the draft model, if any, already saw them)."""
        assert self.num_rows == len(rows), (self.num_rows, len(rows))
        slots = [s.slot for s in rows]
        self.routing.set(slots, [s.lora_scale for s in rows])
        self.stats.count_decode(slots)
        if drafts is None:
            x = self.inputs[:, None]  # [B, 1]
            vision = vision_rows.decode_inputs(self.cache.target, rows) if self.is_vision else {}
            logits = self._feed(x, self.cache, **vision)
        else:
            x = mx.concatenate([self.inputs[:, None], drafts], axis=1)  # [B, P]
            if self.has_windows:
                verify.order_windows(self.cache.target)
            logits = self.model(x, cache=self.cache.target)
        forward = Forward(rows, logits.reshape(-1, logits.shape[-1]), None, x.shape[1])  # logits [B * P, V]
        flat = forward.flat_rows
        forward.processed = add_biases(forward.logits, flat)
        if any(s.params.has_penalties for s in rows):
            if self.counts is None:
                self.counts = mx.zeros((len(rows), self.vocab_size))
            counts = self.counts if drafts is None else verify.position_counts(self.counts, drafts)
            forward.processed = penalize(forward.processed, counts, flat)
        elif self.counts is not None:
            self.counts = None  # no row needs them any more
        return forward

    def _sample(self, forward: Forward, bitmask: np.ndarray | None = None) -> Launch:
        """Sample every row (under ``bitmask`` [B, W] int32, when given) and
        launch the step."""
        rows, logits, processed = forward.rows, forward.logits, forward.processed
        if bitmask is not None:
            processed = apply_bitmask(processed, bitmask)
        tokens, _, self.keys = sample(
            processed,
            [s.params.temperature for s in rows],
            [s.params.top_p for s in rows],
            self.keys,
        )
        if self.counts is not None:
            self.counts = count_tokens(self.counts, tokens)
        self.inputs = tokens
        launch = Launch(rows, tokens, [i for i, s in enumerate(rows) if s.params.logprobs is not None])
        if launch.wanted:
            launch.logprob_arrays = token_logprobs(logits, tokens, rows, launch.wanted)
        mx.async_eval(tokens, self.keys, *(a for a in launch.logprob_arrays if a is not None),
                      *([self.counts] if self.counts is not None else []),
                      *(c.state[:2] for c in self.cache.draft))  # the draft model's caches
        return launch


def is_constrained(rows: list[Sequence]) -> bool:
    """A row samples under a grammar's mask."""
    return any(s.constraint is not None for s in rows)
