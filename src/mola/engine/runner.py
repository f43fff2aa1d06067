"""The only place where the engine builds arrays and evaluates the model.

The runner owns the decode batch's state, one row per running sequence in
the scheduler's row order: mlx-lm KV caches, a PRNG key per row, the next
input token per row (still on the device), and token counts for penalties.
It also owns the prefill group being written. It follows the scheduler's
:class:`StepPlan` exactly: drop finished rows, prefill one chunk of the group
(right-padded, as mlx-lm's own batch generator does), let a finished group
join, then launch one decode step for every row.

Decode is pipelined, as mlx-lm's generator does it: a step is launched with
``mx.async_eval`` and its tokens are read back at the next step, after that
step was launched, so the device never waits for Python between steps. A
sequence that finished is therefore computed one step too many; its extra
token is dropped by the engine.

With a prompt cache the runner also holds the cached KV state (a KVStore),
and follows the plan's cache orders: store a leaving row or a joining member,
start a group member from a cached prefix, drop entries.

Rows under a grammar (``Sequence.constraint``) are sampled through one
``where`` over the batch's [B, V] mask, filled while the step's forward pass
runs (see :meth:`ModelRunner.run`); a batch without one pays nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.cache import make_prompt_cache

from ..lora.pack import AdapterPacks
from .constraint import MaskFiller
from .kv_store import KVStore, kv_bytes_per_token
from .logits import add_biases, apply_bitmask, count_tokens, penalize
from .sampling import make_keys, sample
from .scheduler import StepPlan, prefill_len
from .sequence import Sequence

CLEAR_CACHE_EVERY = 256  # steps between returns of MLX's buffer cache

# (log-probability of the sampled token, [(token id, log-probability)] of the
# most likely tokens, best first)
TokenLogprobs = tuple[float, list[tuple[int, float]]]


@dataclass
class StepResult:
    """Tokens of one completed decode step, for the rows it ran."""

    rows: list[Sequence]
    tokens: list[int]
    logprobs: list[TokenLogprobs | None]


@dataclass
class _Launch:
    """A decode step in flight."""

    rows: list[Sequence]
    tokens: mx.array  # [B]
    wanted: list[int]  # rows that asked for log-probabilities
    logprob_arrays: tuple = ()  # (chosen [W], top ids [W, k] | None, top logprobs [W, k] | None)


@dataclass
class _Forward:
    """A decode step's forward pass, not yet sampled."""

    rows: list[Sequence]
    logits: mx.array  # [B, V] the model's own
    processed: mx.array  # [B, V] after biases and penalties


@dataclass
class RunnerStats:
    """Counters of what the runner computed (read by tests and metrics)."""

    decode_steps: int = 0
    decode_rows: int = 0  # sum of batch sizes over decode steps
    mixed_steps: int = 0  # decode steps whose rows used more than one slot
    max_batch: int = 0
    max_slots_in_step: int = 0  # most distinct slots (base included) in one step
    prefill_tokens: int = 0  # prompt tokens written, padding excluded
    masked_steps: int = 0  # decode steps sampled under grammar masks
    masked_rows: int = 0  # constrained rows over those steps


def _advance(result: StepResult) -> None:
    """Each constrained row's matcher consumes its accepted token (rows that
    finished or were aborted while the step ran accept nothing)."""
    for seq, token in zip(result.rows, result.tokens):
        if seq.constraint is not None and not seq.is_finished:
            seq.constraint.advance(token)


def merge_caches(caches: list[list]) -> list:
    """Per-sequence caches -> one batch cache per layer (mlx-lm's merge)."""
    return [layer[0].merge(list(layer)) for layer in zip(*caches)]


class ModelRunner:
    def __init__(self, model: nn.Module, packs: AdapterPacks, vocab_size: int, prompt_cache: bool = False):
        self.model = model
        self.packs = packs
        self.routing = packs.routing
        self.vocab_size = vocab_size
        # The prompt cache's KV state, and what one token of it takes (None:
        # no prompt cache, or a model whose caches cannot be cut at a token).
        self.kv = KVStore()
        self.kv_bytes_per_token = kv_bytes_per_token(model, self.routing) if prompt_cache else None
        # Decode rows, aligned with the scheduler's running list:
        self.cache: list | None = None  # one batch cache per layer
        self.keys: mx.array | None = None  # [B, 2] PRNG key per row
        self.inputs: mx.array | None = None  # [B] next input token per row
        self.counts: mx.array | None = None  # [B, V] generated-token counts (penalties only)
        self.inflight: _Launch | None = None
        self.masks = MaskFiller()  # next-token masks of constrained rows
        # The prefill group:
        self.group_cache: list | None = None
        self.group_tokens: mx.array | None = None  # [G, L] right-padded uncached prompt tokens
        self.group_todo: list[int] = []  # per member: prompt tokens to prefill
        self.group_padding: list[int] = []
        self.num_steps = 0
        self.stats = RunnerStats()

    @property
    def num_rows(self) -> int:
        return 0 if self.keys is None else self.keys.shape[0]

    def reset(self) -> None:
        """Drop every cache and the step in flight (after a failed step)."""
        self.cache = self.keys = self.inputs = self.counts = self.inflight = None
        self.group_cache = self.group_tokens = None
        self.group_todo, self.group_padding = [], []
        self.routing.clear()
        self.kv.clear()

    def run(self, plan: StepPlan) -> StepResult | None:
        """Execute ``plan``; returns the previous decode step's tokens (None
        when nothing was in flight).

        With a constrained row in the batch, sampling waits for the masks:
        the forward pass is launched first, and while it runs the previous
        tokens are read back, the matchers advance on them and the bitmask
        is filled; then the masks are applied and the rows sampled."""
        if plan.keep is not None:
            for row, entry, num_tokens in plan.store_rows:
                self.kv.put(entry, self.cache, row, num_tokens)
            self._keep_rows(plan.keep)
        if plan.group:
            self._prefill(plan)
        previous, self.inflight = self.inflight, None
        forward = self._forward(plan.decode) if plan.decode else None
        constrained = forward is not None and any(s.constraint is not None for s in plan.decode)
        if constrained:
            mx.async_eval(forward.logits, forward.processed)
        elif forward is not None:
            self.inflight = self._sample(forward)
        self.kv.drop(plan.evict)
        result = self._collect(previous) if previous is not None else None
        if constrained:
            if result is not None:
                _advance(result)
            constraints = [s.constraint for s in plan.decode]
            self.stats.masked_steps += 1
            self.stats.masked_rows += sum(c is not None for c in constraints)
            self.inflight = self._sample(forward, self.masks.fill(constraints))
        self.num_steps += 1
        if self.num_steps % CLEAR_CACHE_EVERY == 0:
            mx.clear_cache()
        return result

    # ---- rows -------------------------------------------------------------

    def _keep_rows(self, keep: list[int]) -> None:
        if not keep:
            self.cache = self.keys = self.inputs = self.counts = None
            return
        for c in self.cache:
            c.filter(keep)
        idx = mx.array(keep, dtype=mx.int32)
        self.keys, self.inputs = self.keys[idx], self.inputs[idx]
        if self.counts is not None:
            self.counts = self.counts[idx]

    def _append_rows(self, cache: list, seqs: list[Sequence]) -> None:
        keys = make_keys([s.params.seed for s in seqs])
        inputs = mx.array([s.prompt[-1] for s in seqs], dtype=mx.uint32)
        if self.cache is None:
            self.cache, self.keys, self.inputs = cache, keys, inputs
        else:
            for mine, theirs in zip(self.cache, cache):
                mine.extend(theirs)
            self.keys = mx.concatenate([self.keys, keys])
            self.inputs = mx.concatenate([self.inputs, inputs])
        if self.counts is not None:
            self.counts = mx.concatenate([self.counts, mx.zeros((len(seqs), self.vocab_size))])
        mx.eval([c.state for c in self.cache], self.keys, self.inputs)

    # ---- prefill ------------------------------------------------------------

    def _prefill(self, plan: StepPlan) -> None:
        group = plan.group
        if plan.group_is_new:
            self._start_group(group, plan.hits or [None] * len(group))
        if plan.end > plan.start:
            self.stats.prefill_tokens += sum(
                max(0, min(plan.end, n) - plan.start) for n in self.group_todo
            )
            self.routing.set([s.slot for s in group], [s.lora_scale for s in group])
            self.model(self.group_tokens[:, plan.start : plan.end], cache=self.group_cache)
            mx.eval([c.state for c in self.group_cache])
        if plan.join is not None:
            self._join(group, plan)

    def _start_group(self, group: list[Sequence], hits: list) -> None:
        """The group's cache: each member's cached prefix (mlx-lm's merge
        left-pads them to one length) and room for the rest of its prompt
        (right-padded, rolled into left padding when the group joins)."""
        done = [h.num_tokens if h else 0 for h in hits]
        self.group_todo = [prefill_len(s) - d for s, d in zip(group, done)]
        width = max(self.group_todo)
        self.group_padding = [width - n for n in self.group_todo]
        self.group_cache = merge_caches(
            [self.kv.view(h.entry, h.num_tokens) if h else make_prompt_cache(self.model) for h in hits]
        )
        self.group_tokens = mx.array(
            [s.prompt[d:-1] + [0] * pad for s, d, pad in zip(group, done, self.group_padding)],
            dtype=mx.uint32,
        )  # [G, width]
        if max(self.group_padding) > 0:
            for c in self.group_cache:
                c.prepare(lengths=self.group_todo, right_padding=self.group_padding)

    def _join(self, group: list[Sequence], plan: StepPlan) -> None:
        cache, join = self.group_cache, plan.join
        if max(self.group_padding) > 0:
            for c in cache:
                c.finalize()
        for member, entry, num_tokens in plan.store_joined:
            self.kv.put(entry, cache, member, num_tokens)
        self.group_cache = self.group_tokens = None
        if not join:
            return
        if len(join) < len(group):
            for c in cache:
                c.filter(join)
        self._append_rows(cache, [group[i] for i in join])

    # ---- decode -------------------------------------------------------------

    def _forward(self, rows: list[Sequence]) -> _Forward:
        assert self.num_rows == len(rows), (self.num_rows, len(rows))
        slots = [s.slot for s in rows]
        self.routing.set(slots, [s.lora_scale for s in rows])
        self._count_decode(slots)
        logits = self.model(self.inputs[:, None], cache=self.cache)[:, -1, :]  # [B, V]
        processed = add_biases(logits, rows)
        if any(s.params.has_penalties for s in rows):
            if self.counts is None:
                self.counts = mx.zeros((len(rows), self.vocab_size))
            processed = penalize(processed, self.counts, rows)
        elif self.counts is not None:
            self.counts = None  # no row needs them any more
        return _Forward(rows, logits, processed)

    def _sample(self, forward: _Forward, bitmask: np.ndarray | None = None) -> _Launch:
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
        launch = _Launch(rows, tokens, [i for i, s in enumerate(rows) if s.params.logprobs is not None])
        if launch.wanted:
            launch.logprob_arrays = self._logprobs(logits, tokens, rows, launch.wanted)
        mx.async_eval(tokens, self.keys, *(a for a in launch.logprob_arrays if a is not None),
                      *([self.counts] if self.counts is not None else []))
        return launch

    def _logprobs(self, logits, tokens, rows, wanted) -> tuple:
        """The model's own log-probability of each sampled token and its top
        alternatives (before temperature, penalties and biases, as vLLM
        reports them), for the rows that asked."""
        sel = mx.array(wanted, dtype=mx.int32)
        raw = logits[sel]
        raw = raw - mx.logsumexp(raw, axis=-1, keepdims=True)  # [W, V]
        chosen = mx.take_along_axis(raw, tokens[sel][:, None], axis=-1)[:, 0]  # [W]
        k = max(rows[i].params.logprobs for i in wanted)
        if k == 0:
            return chosen, None, None
        top_ids = mx.argpartition(-raw, kth=k - 1, axis=-1)[:, :k]  # [W, k], unordered
        return chosen, top_ids, mx.take_along_axis(raw, top_ids, axis=-1)

    def _collect(self, launch: _Launch) -> StepResult:
        tokens = launch.tokens.tolist()
        logprobs: list[TokenLogprobs | None] = [None] * len(launch.rows)
        if launch.wanted:
            chosen, top_ids, top_lps = launch.logprob_arrays
            chosen = chosen.tolist()
            ids = top_ids.tolist() if top_ids is not None else None
            lps = top_lps.tolist() if top_lps is not None else None
            for j, i in enumerate(launch.wanted):
                n = launch.rows[i].params.logprobs
                top = sorted(zip(ids[j], lps[j]), key=lambda p: -p[1])[:n] if n else []
                logprobs[i] = (chosen[j], top)
        return StepResult(launch.rows, tokens, logprobs)

    def _count_decode(self, slots: list[int]) -> None:
        st = self.stats
        distinct = len(set(slots))
        st.decode_steps += 1
        st.decode_rows += len(slots)
        st.mixed_steps += distinct > 1
        st.max_batch = max(st.max_batch, len(slots))
        st.max_slots_in_step = max(st.max_slots_in_step, distinct)
