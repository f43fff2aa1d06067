"""One batch's KV caches, held by the runner: the target model's, one per
layer, and a draft model's of its own (speculative decoding with --draft-model),
so that each model is fed its own list. What is done to the batch's rows
(keep some, append others, store one, cut positions back) is done to both
alike, so both always hold the same tokens."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import mlx.nn as nn
from mlx_lm.models.cache import make_prompt_cache

from ..errors import ModelLoadError
from .quantized_cache import quantized_caches, triple_nbytes


def layer_caches(model: nn.Module, quant: tuple[int, int] | None = None) -> list:
    """mlx-lm's caches for ``model``, one per layer, quantized when ``quant`` (bits, group size) is given."""
    caches = make_prompt_cache(model)
    if quant is None:
        return caches
    try:
        return quantized_caches(caches, group_size=quant[1], bits=quant[0])
    except ValueError as e:
        raise ModelLoadError(f"--kv-bits {quant[0]}: {e}") from None


def merge_caches(caches: list[list]) -> list:
    """Per-sequence caches -> one batch cache per layer (mlx-lm's merge)."""
    return [layer[0].merge(list(layer)) for layer in zip(*caches)]


@dataclass
class ModelCaches:
    target: list  # one mlx-lm cache per layer of the target model
    draft: list = field(default_factory=list)  # the draft model's, one per layer ([] without one)

    @classmethod
    def new(cls, model: nn.Module, draft: nn.Module | None = None, quant: tuple[int, int] | None = None) -> ModelCaches:
        """Empty caches; ``quant`` (bits, group size): quantized ones (--kv-bits)."""
        return cls(layer_caches(model, quant), layer_caches(draft, quant) if draft is not None else [])

    @classmethod
    def merge(cls, caches: list[ModelCaches]) -> ModelCaches:
        """Per-sequence caches -> one batch cache per layer of each model."""
        return cls(merge_caches([c.target for c in caches]), merge_caches([c.draft for c in caches]))

    @property
    def layers(self) -> list:
        """Every cache: the target's, then the draft's."""
        return self.target + self.draft

    def map(self, fn: Callable) -> ModelCaches:
        """``fn`` of each cache, each model's kept apart."""
        return ModelCaches([fn(c) for c in self.target], [fn(c) for c in self.draft])

    def extend(self, other: ModelCaches) -> None:
        """``other``'s rows after this batch's."""
        for mine, theirs in zip(self.layers, other.layers):
            mine.extend(theirs)


def held_nbytes(caches: ModelCaches | None) -> int:
    """Bytes of the keys and values ``caches`` hold (0: None)."""
    layers = caches.layers if caches is not None else ()
    return sum(triple_nbytes(getattr(c, "keys", None)) + triple_nbytes(getattr(c, "values", None)) for c in layers)
