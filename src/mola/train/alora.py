"""Training an activated LoRA (`mola train --alora-invocation TEXT`): the
adapter's delta applies from the last place the invocation's tokens start in
each example, the base model alone before it, as PEFT's aLoRA trains
(peft/tuners/lora/variants.py: ALoraLinearVariant, with the offsets of
calculate_alora_offsets over the whole input) and as mola serves it.

mlx-lm's LoRALinear layers are made ActivatedLoRALinear, which multiply their
delta by a per-position mask; the batches carry each row's start, and the
loss sets the mask from it before the forward pass. The adapter's factors
keep mlx-lm's names; its adapter_config.json adds PEFT's
``alora_invocation_tokens``.
"""

from __future__ import annotations

from typing import Callable

import mlx.core as mx
import numpy as np
from mlx_lm.tuner.lora import LoRALinear
from mlx_lm.tuner.trainer import default_loss, iterate_batches

from ..adapters.weights import invocation_start
from ..errors import TrainError


class Activation:
    """The per-position mask of the batch in the forward pass: [B, L, 1], 1
    from each row's start on; None outside an activated LoRA's loss."""

    def __init__(self):
        self.mask: mx.array | None = None


class ActivatedLoRALinear(LoRALinear):
    """mlx-lm's LoRALinear whose delta is masked by position (``activation``)."""

    activation: Activation

    def __call__(self, x):
        y = self.linear(x)
        z = (self.dropout(x) @ self.lora_a) @ self.lora_b
        if self.activation.mask is not None:
            z = z * self.activation.mask
        return y + (self.scale * z).astype(x.dtype)


def activate(model) -> Activation:
    """Make ``model``'s LoRALinear layers activated ones sharing one mask; returns it."""
    activation, count = Activation(), 0
    for _, module in model.named_modules():
        if type(module) is LoRALinear:
            module.__class__ = ActivatedLoRALinear
            module.activation = activation
            count += 1
    if not count:
        raise TrainError("an activated LoRA is trained on dense linear layers; this model's targets have none "
                         "(LoRA on experts cannot be activated)")
    return activation


def invocation_tokens(tokenizer, text: str) -> tuple[int, ...]:
    """The invocation's tokens, as the tokenizer encodes it alone."""
    tokens = tuple(tokenizer.encode(text, add_special_tokens=False))
    if not tokens:
        raise TrainError(f"--alora-invocation {text!r} encodes to no tokens")
    return tokens


def check_invoked(examples: list[tuple[list[int], int]], invocation: tuple[int, ...], max_seq_length: int,
                  what: str, text: str) -> None:
    """TrainError when an example's tokens (as truncated to ``max_seq_length``)
    do not hold the invocation."""
    missing = [i for i, (tokens, _) in enumerate(examples)
               if invocation_start(invocation, tokens[:max_seq_length]) is None]
    if missing:
        raise TrainError(f"--alora-invocation {text!r} (tokens {list(invocation)}) is not in {len(missing)} of the "
                         f"{len(examples)} {what} examples (the first: example {missing[0] + 1}); an activated "
                         "LoRA learns only from where its invocation starts")


def find_invocation(text: str, tokenizer, max_seq_length: int, *example_sets, log) -> tuple[int, ...]:
    """The invocation's tokens, checked to be in every example of each
    (examples, what) set; said on the log."""
    invocation = invocation_tokens(tokenizer, text)
    for examples, what in example_sets:
        check_invoked(examples, invocation, max_seq_length, what, text)
    log(f"[mola] an activated LoRA: its delta applies from {text!r} (tokens {list(invocation)}) on, the base "
        "model alone before it")
    return invocation


def batches(invocation: tuple[int, ...]) -> Callable:
    """mlx-lm's iterate_batches, each batch with its rows' starts: (batch,
    lengths, starts), found again in the rows (the last place the invocation
    begins within each row's length)."""

    def iterate(dataset, batch_size, max_seq_length, loop=False, seed=None, comm_group=None):
        for batch, lengths in iterate_batches(dataset, batch_size, max_seq_length, loop=loop, seed=seed,
                                              comm_group=comm_group):
            rows, ends = np.array(batch), np.array(lengths)[:, 1]
            found = [invocation_start(invocation, row[:end].tolist()) for row, end in zip(rows, ends)]
            yield batch, lengths, mx.array([len(row) if s is None else s for row, s in zip(rows, found)])

    return iterate


def loss(activation: Activation) -> Callable:
    """mlx-lm's default loss with the mask of the batch's starts set for its forward pass."""

    def activated_loss(model, batch, lengths, starts_):
        positions = mx.arange(batch.shape[1] - 1)  # the inputs: all but the last token
        activation.mask = (positions[None, :] >= starts_[:, None])[..., None].astype(mx.float32)
        try:
            return default_loss(model, batch, lengths)
        finally:
            activation.mask = None

    return activated_loss
