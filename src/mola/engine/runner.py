"""The only place where the engine builds arrays and evaluates the model.

The runner owns two sets of mlx-lm KV caches: the decode batch (one row per
running sequence, in the scheduler's row order) and the prefill group being
written. It follows the scheduler's :class:`StepPlan` exactly: drop finished
rows, prefill one chunk of the group (right-padded, as mlx-lm's own batch
generator does), let a finished group join, then decode one token per row.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import make_prompt_cache

from ..lora.pack import AdapterPacks
from .sampling import make_keys, sample
from .scheduler import StepPlan, prefill_len
from .sequence import Sequence

CLEAR_CACHE_EVERY = 256  # steps between returns of MLX's buffer cache

# (log-probability of the sampled token, [(token id, log-probability)] of the
# most likely tokens, best first)
TokenLogprobs = tuple[float, list[tuple[int, float]]]
StepTokens = tuple[list[int], list["TokenLogprobs | None"]]


def process_logits(logits: mx.array, rows: list[Sequence]) -> mx.array:
    """Per-row logit biases and frequency/presence penalties as one sparse
    add over [B, V]; rows without them are untouched."""
    r_idx, t_idx, vals = [], [], []
    for i, seq in enumerate(rows):
        p = seq.params
        for token, bias in p.logit_bias:
            r_idx.append(i)
            t_idx.append(token)
            vals.append(bias)
        if p.has_penalties:
            for token, count in seq.counts.items():
                r_idx.append(i)
                t_idx.append(token)
                vals.append(-(p.frequency_penalty * count + p.presence_penalty))
    if not r_idx:
        return logits
    rows_a = mx.array(r_idx, dtype=mx.int32)
    toks_a = mx.array(t_idx, dtype=mx.int32)
    return logits.at[rows_a, toks_a].add(mx.array(vals, dtype=logits.dtype))


@dataclass
class RunnerStats:
    """Counters of what the runner computed (read by tests and metrics)."""

    decode_steps: int = 0
    decode_rows: int = 0  # sum of batch sizes over decode steps
    mixed_steps: int = 0  # decode steps whose rows used more than one slot
    max_batch: int = 0
    max_slots_in_step: int = 0  # most distinct slots (base included) in one step
    prefill_tokens: int = 0  # prompt tokens written, padding excluded


def merge_caches(caches: list[list]) -> list:
    """Per-sequence caches -> one batch cache per layer (mlx-lm's merge)."""
    return [layer[0].merge(list(layer)) for layer in zip(*caches)]


class ModelRunner:
    def __init__(self, model: nn.Module, packs: AdapterPacks):
        self.model = model
        self.packs = packs
        self.routing = packs.routing
        self.cache: list | None = None  # decode batch: one batch cache per layer
        self.keys: mx.array | None = None  # [B, 2] PRNG key per decode row
        self.group_cache: list | None = None
        self.group_tokens: mx.array | None = None  # [G, L] right-padded prompts
        self.group_padding: list[int] = []
        self.num_steps = 0
        self.stats = RunnerStats()

    @property
    def num_rows(self) -> int:
        return 0 if self.keys is None else self.keys.shape[0]

    def reset(self) -> None:
        """Drop every cache (after a failed step)."""
        self.cache = self.keys = self.group_cache = self.group_tokens = None
        self.group_padding = []
        self.routing.clear()

    def run(self, plan: StepPlan) -> StepTokens:
        """Execute ``plan``; returns one sampled token per decode row, and the
        log-probabilities of the rows that asked for them."""
        if plan.keep is not None:
            self._keep_rows(plan.keep)
        if plan.group:
            self._prefill(plan)
        self.num_steps += 1
        if self.num_steps % CLEAR_CACHE_EVERY == 0:
            mx.clear_cache()
        if not plan.decode:
            return [], []
        return self._decode(plan.decode)

    def _keep_rows(self, keep: list[int]) -> None:
        if not keep:
            self.cache = self.keys = None
            return
        for c in self.cache:
            c.filter(keep)
        self.keys = self.keys[mx.array(keep, dtype=mx.int32)]

    def _prefill(self, plan: StepPlan) -> None:
        group = plan.group
        if plan.group_is_new:
            lengths = [prefill_len(s) for s in group]
            width = max(lengths)
            self.group_padding = [width - n for n in lengths]
            self.group_cache = merge_caches([make_prompt_cache(self.model) for _ in group])
            self.group_tokens = mx.array(
                [s.prompt[:-1] + [0] * pad for s, pad in zip(group, self.group_padding)],
                dtype=mx.uint32,
            )  # [G, L]
            if max(self.group_padding) > 0:
                for c in self.group_cache:
                    c.prepare(lengths=lengths, right_padding=self.group_padding)
        if plan.end > plan.start:
            self.stats.prefill_tokens += sum(
                max(0, min(plan.end, prefill_len(s)) - plan.start) for s in group
            )
            self.routing.set([s.slot for s in group], [s.lora_scale for s in group])
            self.model(self.group_tokens[:, plan.start : plan.end], cache=self.group_cache)
            mx.eval([c.state for c in self.group_cache])
        if plan.join is not None:
            self._join(group, plan.join)

    def _join(self, group: list[Sequence], join: list[int]) -> None:
        cache = self.group_cache
        if max(self.group_padding) > 0:
            for c in cache:
                c.finalize()
        self.group_cache = self.group_tokens = None
        if not join:
            return
        if len(join) < len(group):
            for c in cache:
                c.filter(join)
        keys = make_keys([group[i].params.seed for i in join])
        if self.cache is None:
            self.cache, self.keys = cache, keys
        else:
            for mine, theirs in zip(self.cache, cache):
                mine.extend(theirs)
            self.keys = mx.concatenate([self.keys, keys])
        mx.eval([c.state for c in self.cache], self.keys)

    def _decode(self, rows: list[Sequence]) -> StepTokens:
        assert self.num_rows == len(rows), (self.num_rows, len(rows))
        inputs = mx.array([[s.last_token] for s in rows], dtype=mx.uint32)  # [B, 1]
        slots = [s.slot for s in rows]
        self.routing.set(slots, [s.lora_scale for s in rows])
        self._count_decode(slots)
        logits = self.model(inputs, cache=self.cache)[:, -1, :]  # [B, V]
        tokens, _, self.keys = sample(
            process_logits(logits, rows),
            [s.params.temperature for s in rows],
            [s.params.top_p for s in rows],
            self.keys,
        )
        wanted = [i for i, s in enumerate(rows) if s.params.logprobs is not None]
        if not wanted:
            mx.eval(tokens, self.keys)
            return tokens.tolist(), [None] * len(rows)
        return self._with_logprobs(logits, tokens, rows, wanted)

    def _with_logprobs(self, logits, tokens, rows, wanted) -> StepTokens:
        """Tokens plus, for the rows that asked, the model's own log-probability
        of the sampled token and its top alternatives (before temperature,
        penalties and biases, as vLLM reports them)."""
        sel = mx.array(wanted, dtype=mx.int32)
        raw = logits[sel]
        raw = raw - mx.logsumexp(raw, axis=-1, keepdims=True)  # [W, V]
        chosen = mx.take_along_axis(raw, tokens[sel][:, None], axis=-1)[:, 0]  # [W]
        k = max(rows[i].params.logprobs for i in wanted)
        top_ids = top_lps = None
        if k > 0:
            top_ids = mx.argpartition(-raw, kth=k - 1, axis=-1)[:, :k]  # [W, k], unordered
            top_lps = mx.take_along_axis(raw, top_ids, axis=-1)
        mx.eval(tokens, self.keys, chosen, *(a for a in (top_ids, top_lps) if a is not None))
        out: list[TokenLogprobs | None] = [None] * len(rows)
        chosen = chosen.tolist()
        ids = top_ids.tolist() if top_ids is not None else None
        lps = top_lps.tolist() if top_lps is not None else None
        for j, i in enumerate(wanted):
            n = rows[i].params.logprobs
            top = sorted(zip(ids[j], lps[j]), key=lambda p: -p[1])[:n] if n else []
            out[i] = (chosen[j], top)
        return tokens.tolist(), out

    def _count_decode(self, slots: list[int]) -> None:
        st = self.stats
        distinct = len(set(slots))
        st.decode_steps += 1
        st.decode_rows += len(slots)
        st.mixed_steps += distinct > 1
        st.max_batch = max(st.max_batch, len(slots))
        st.max_slots_in_step = max(st.max_slots_in_step, distinct)
