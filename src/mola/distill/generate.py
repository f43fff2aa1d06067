"""Answers of a local model, batched by mlx-lm's BatchGenerator: sampled or
greedy, each with the model's K most likely tokens at every answer token
(the teacher's distribution, kept as it samples; no second pass). The
prompts' shared first tokens (the system prompt) are prefilled once."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

COMPLETION_BATCH = 32  # rows decoded together
PREFILL_BATCH = 8  # prompts prefilled together
# Prompts that share this many first tokens (a system prompt, a chat
# template's preamble) have them prefilled once.
MIN_SHARED_PREFIX = 8


@dataclass
class Generated:
    tokens: list[int]  # the answer; its end-of-turn token last when it ``stopped``
    stopped: bool  # ended by an end-of-turn token, not cut at max_tokens
    top_idx: np.ndarray | None = None  # [n, k] int32: the k most likely tokens at each answer token
    top_logp: np.ndarray | None = None  # [n, k] float32: their log-probabilities


def generate(model, tokenizer, prompts: list[list[int]], *, max_tokens: int, temperature: float, seed: int,
             top_k: int = 0, log: Callable[[str], None] | None = None, what: str = "answers") -> list[Generated]:
    """Each prompt's answer, in order. ``temperature`` 0 is greedy; with
    ``top_k``, the k most likely tokens and their log-probabilities at each
    answer token come along."""
    import mlx.core as mx
    from mlx_lm.generate import BatchGenerator
    from mlx_lm.sample_utils import make_sampler

    if not prompts:
        return []
    mx.random.seed(seed)
    eos = set(tokenizer.eos_token_ids)
    gen = BatchGenerator(model, stop_tokens=[[t] for t in sorted(eos)], sampler=make_sampler(temperature),
                         completion_batch_size=COMPLETION_BATCH, prefill_batch_size=PREFILL_BATCH)
    try:
        n = len(shared_prefix(prompts))
        caches = [prefill(model, prompts[0][:n])] * len(prompts) if n >= MIN_SHARED_PREFIX else None
        uids = gen.insert([p[n:] for p in prompts] if caches else prompts, [max_tokens] * len(prompts), caches=caches)
        out = {u: Generated(tokens=[], stopped=False) for u in uids}
        tops: dict[int, list] = {u: [] for u in uids}
        finished = 0
        while responses := gen.next_generated():
            if top_k:
                _keep_top_k(responses, tops, top_k)
            for r in responses:
                out[r.uid].tokens.append(int(r.token))
                if r.finish_reason is not None:
                    out[r.uid].stopped = r.finish_reason == "stop"
                    finished += 1
                    if log and (finished % 64 == 0 or finished == len(uids)):
                        log(f"[mola] {what}: {finished}/{len(uids)}")
    finally:
        gen.close()
    if top_k:
        for u in uids:
            out[u].top_idx = np.stack([i for i, _ in tops[u]]).astype(np.int32)
            out[u].top_logp = np.stack([p for _, p in tops[u]]).astype(np.float32)
    return [out[u] for u in uids]


def shared_prefix(prompts: list[list[int]]) -> list[int]:
    """The tokens every prompt starts with, leaving each at least one of its own."""
    n = min(len(p) for p in prompts) - 1
    first = prompts[0]
    for p in prompts[1:]:
        n = next((i for i in range(n) if p[i] != first[i]), n)
    return first[:max(n, 0)]


def prefill(model, tokens: list[int]) -> list:
    """mlx-lm's KV cache of the model after ``tokens``. BatchGenerator merges
    it into each batch by copying, so one cache serves every prompt."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    model(mx.array(tokens)[None], cache=cache)
    mx.eval([c.state for c in cache])
    return cache


def _keep_top_k(responses, tops: dict[int, list], k: int) -> None:
    """The k most likely tokens of each row's distribution at this step."""
    import mlx.core as mx

    logp = mx.stack([r.logprobs for r in responses])  # [B, V]
    k = min(k, logp.shape[-1])
    idx = mx.argpartition(-logp, k - 1, axis=-1)[:, :k]  # [B, k]
    top = mx.take_along_axis(logp, idx, axis=-1)  # [B, k]
    idx, top = np.array(idx), np.array(top.astype(mx.float32))
    for i, r in enumerate(responses):
        tops[r.uid].append((idx[i], top[i]))
