"""The student's losses, in the form mlx-lm's trainer takes (``loss(model,
*batch) -> (loss, tokens)``), both over the answer tokens only.

kl:  KL(teacher || student) per answer token. The teacher's distribution is
     its K most likely tokens plus one bucket for the rest of the vocabulary;
     the student's is read on the same K tokens and the same rest, so this is
     the exact KL between the two distributions coarsened to K + 1 outcomes
     (a lower bound of the full KL, equal to it when K covers the vocabulary).
sft: cross-entropy on the teacher's answer tokens.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

EPS = 1e-6  # the smallest "rest" mass the logarithms see


def answer_mask(lengths: mx.array, width: int) -> mx.array:
    """[B, T] True where input position t predicts an answer token: the
    answer is tokens[offset:length], and position t predicts token t + 1."""
    steps = mx.arange(1, width + 1)  # [T]: the index of the token each position predicts
    return mx.logical_and(steps >= lengths[:, 0:1], steps < lengths[:, 1:])


def kl_loss(model, batch: mx.array, lengths: mx.array, top_idx: mx.array, top_logp: mx.array):
    """batch [B, L] tokens, lengths [B, 2] (offset, length), top_idx [B, L-1, K]
    and top_logp [B, L-1, K]: the teacher's K tokens at each input position."""
    inputs = batch[:, :-1]  # [B, T]
    logits = model(inputs).astype(mx.float32)  # [B, T, V]
    logp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)  # [B, T, V]
    student_k = mx.take_along_axis(logp, top_idx, axis=-1)  # [B, T, K]
    teacher_p = mx.exp(top_logp)  # [B, T, K]
    kl = (teacher_p * (top_logp - student_k)).sum(axis=-1)  # [B, T]
    rest_teacher = mx.maximum(1.0 - teacher_p.sum(axis=-1), EPS)  # [B, T]
    rest_student = mx.maximum(1.0 - mx.exp(student_k).sum(axis=-1), EPS)  # [B, T]
    kl = kl + rest_teacher * (mx.log(rest_teacher) - mx.log(rest_student))
    mask = answer_mask(lengths, inputs.shape[1])
    ntoks = mask.sum()
    return mx.where(mask, kl, 0.0).sum() / ntoks, ntoks


def sft_loss(model, batch: mx.array, lengths: mx.array):
    """Cross-entropy on the answer tokens (batch [B, L], lengths [B, 2])."""
    inputs, targets = batch[:, :-1], batch[:, 1:]  # [B, T] each
    logits = model(inputs)  # [B, T, V]
    mask = answer_mask(lengths, inputs.shape[1])
    ce = nn.losses.cross_entropy(logits, targets).astype(mx.float32)  # [B, T]
    ntoks = mask.sum()
    return mx.where(mask, ce, 0.0).sum() / ntoks, ntoks


LOSSES = {"kl": kl_loss, "sft": sft_loss}
