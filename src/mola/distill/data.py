"""The student's training examples and their batches: each question as the
student sees it (no system prompt) followed by the teacher's answer, with the
teacher's top-K distribution at every answer token (for the KL loss)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import numpy as np

from .generate import Generated

BUCKET = 64  # batches draw from examples within this many tokens of length
PAD_TO = 32  # batch widths are multiples of this (fewer shapes for mx.compile to trace)


@dataclass
class Example:
    tokens: list[int]  # the student's prompt, then the teacher's answer
    offset: int  # where the answer starts
    top_idx: np.ndarray | None = None  # [n, K] int32: the teacher's K most likely tokens at each answer token
    top_logp: np.ndarray | None = None  # [n, K] float32: their log-probabilities


def build_examples(prompts: list[list[int]], answers: list[Generated], max_seq_length: int) -> list[Example]:
    """One example per non-empty answer, cut at ``max_seq_length`` tokens
    (an example left with no answer token is dropped)."""
    out = []
    for prompt, answer in zip(prompts, answers):
        tokens = (list(prompt) + list(answer.tokens))[:max_seq_length]
        n = len(tokens) - len(prompt)
        if n < 1:
            continue
        top_idx = None if answer.top_idx is None else answer.top_idx[:n]
        top_logp = None if answer.top_logp is None else answer.top_logp[:n]
        out.append(Example(tokens, len(prompt), top_idx, top_logp))
    return out


def batch_arrays(examples: list[Example], with_teacher: bool) -> tuple:
    """(tokens [B, L], lengths [B, 2] (offset, length)) and, ``with_teacher``,
    (top_idx [B, L-1, K], top_logp [B, L-1, K]), zero-padded on the right
    (the teacher's rows outside the answers hold a uniform distribution)."""
    import mlx.core as mx

    width = 1 + PAD_TO * math.ceil(max(len(e.tokens) for e in examples) / PAD_TO)
    tokens = np.zeros((len(examples), width), np.int32)
    lengths = np.array([(e.offset, len(e.tokens)) for e in examples], np.int32)
    for i, e in enumerate(examples):
        tokens[i, :len(e.tokens)] = e.tokens
    if not with_teacher:
        return mx.array(tokens), mx.array(lengths)
    k = examples[0].top_idx.shape[1]
    top_idx = np.zeros((len(examples), width - 1, k), np.int32)
    top_logp = np.full((len(examples), width - 1, k), -math.log(k), np.float32)
    for i, e in enumerate(examples):
        n = len(e.tokens) - e.offset
        top_idx[i, e.offset - 1:e.offset - 1 + n] = e.top_idx
        top_logp[i, e.offset - 1:e.offset - 1 + n] = e.top_logp
    return mx.array(tokens), mx.array(lengths), mx.array(top_idx), mx.array(top_logp)


def make_iterate_batches(with_teacher: bool, order_seed: int, on_train_batch: Callable[[], None] | None = None):
    """An ``iterate_batches`` for mlx-lm's trainer over a list of Examples:
    batches of similar length (shuffled within length buckets), in an order
    ``order_seed`` fixes. ``on_train_batch`` runs before each training batch is
    handed over, when the step before it has finished."""

    def iterate_batches(dataset, batch_size, max_seq_length, loop=False, seed=None, comm_group=None):
        if comm_group is not None and comm_group.size() > 1:
            raise ValueError("mola distill trains on one device")
        if len(dataset) < batch_size:
            raise ValueError(f"{len(dataset)} examples cannot fill a batch of {batch_size}")
        rng = np.random.RandomState(order_seed)
        order = rng.permutation(len(dataset))
        order = sorted(order, key=lambda i: len(dataset[i].tokens) // BUCKET)  # stable: shuffled within a bucket
        batches = [order[i:i + batch_size] for i in range(0, len(order) - batch_size + 1, batch_size)]
        while True:
            for b in rng.permutation(len(batches)):
                if loop and on_train_batch is not None:
                    on_train_batch()
                yield batch_arrays([dataset[i] for i in batches[b]], with_teacher)
            if not loop:
                return

    return iterate_batches
