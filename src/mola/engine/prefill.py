"""The prefill batch's device state, held by the runner: the prompts of one
prefill batch written into one KV cache together, a chunk of columns per step.

Each member starts from its cached prefix, if the prompt cache held one
(mlx-lm's merge left-pads them to one length), and the rest of its prompt
is right-padded to the longest (as mlx-lm's own batch generator does); when
the batch is done the right padding is rolled into left padding, and the
cache is ready to join the decode batch."""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx

from .caches import ModelCaches
from .plan import prefill_len
from .sequence import Sequence


@dataclass
class PrefillBatch:
    cache: ModelCaches  # one batch cache per layer of each model
    tokens: mx.array  # [G, L] right-padded uncached prompt tokens
    todo: list[int]  # per member: tokens to prefill (its context but the last)
    padding: list[int]  # per member: columns of right padding
    done: list[int]  # per member: tokens its cache held at the start (column 0 is this position)
    images: list = field(default_factory=list)  # a vision base's: per member, vision_rows.ImageRows or None

    @classmethod
    def start(cls, members: list[Sequence], starts: list[ModelCaches], done: list[int]) -> PrefillBatch:
        """``starts``: each member's cache, holding its first ``done`` prompt tokens."""
        todo = [prefill_len(s) - d for s, d in zip(members, done)]
        width = max(todo)
        padding = [width - n for n in todo]
        cache = ModelCaches.merge(starts)
        tokens = mx.array([s.context[d:-1] + [0] * pad for s, d, pad in zip(members, done, padding)],
                          dtype=mx.uint32)  # [G, width]
        if max(padding) > 0:
            for c in cache.layers:
                c.prepare(lengths=todo, right_padding=padding)
        return cls(cache, tokens, todo, padding, list(done))

    def active(self, members: list[Sequence], start: int, end: int) -> mx.array | None:
        """[G, end - start] 1 where a member's adapter applies in columns
        [start, end) (activated LoRA: from its adapter_start on); None when
        every member's applies everywhere."""
        if all(s.adapter_start is None for s in members):
            return None
        cols = mx.arange(start, end)[None, :] + mx.array(self.done)[:, None]  # positions
        first = mx.array([0 if s.adapter_start is None else s.adapter_start for s in members])[:, None]
        return (cols >= first).astype(mx.float32)

    def num_tokens(self, start: int, end: int) -> int:
        """Prompt tokens in columns [start, end), padding excluded."""
        return sum(max(0, min(end, n) - start) for n in self.todo)

    def finish(self) -> ModelCaches:
        """The written cache, its right padding rolled into left padding."""
        if max(self.padding) > 0:
            for c in self.cache.layers:
                c.finalize()
        return self.cache
