"""How a slot's contents are made from adapter files, and the one function that
reads and checks them.

A :class:`SlotRecipe` names the adapter files (resolved paths) and scales whose
sum a slot holds: one adapter, or several stacked. Rank 0 reads a recipe when
it loads an adapter; the other ranks of a tensor-parallel group read the same
recipe at the same point of the stream of steps. Both go through
:func:`read_recipe`, so every rank reads and checks an adapter the same way.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import InvalidAdapter
from .formats import read_adapter
from .dora import refuse_in_stack
from .pushed import PushedAdapters, is_pushed
from ..lora.pack import SlotGeometry
from .vocab import resolve_vocab
from .weights import LoRAWeights, stack_weights, validate


@dataclass(frozen=True)
class SlotRecipe:
    """What one slot holds: the sum of ``part_scale * adapter`` over its parts,
    all multiplied by ``slot_scale``. (Not the demo's training recipes.)"""

    parts: tuple[tuple[str, float], ...]  # (resolved path, part scale) of each adapter
    slot_scale: float = 1.0  # multiplies the whole: the scale an adapter was loaded with

    @staticmethod
    def single(path: str, slot_scale: float = 1.0) -> "SlotRecipe":
        return SlotRecipe(((str(path), 1.0),), slot_scale)

    @property
    def is_single(self) -> bool:
        return len(self.parts) == 1 and self.parts[0][1] == 1.0


def read_checked(path: str, geometry: SlotGeometry, model_config: dict | None,
                 pushed: PushedAdapters | None = None) -> LoRAWeights:
    """The adapter at ``path`` in whichever format it is, cast to the packs'
    dtype and checked against the base (InvalidAdapter or AdapterPathNotFound
    naming the problem otherwise). A pushed adapter's source name is read
    from ``pushed`` (the base's held factors)."""
    config = model_config or {}
    if is_pushed(path):  # PUT /v1/adapters/{name}/weights: held in memory
        if pushed is None:
            raise InvalidAdapter(f"the pushed adapter {path} is held by a server's base, not read from a file.")
        weights = pushed.read(path, geometry.dtype)
    else:
        weights = read_adapter(path, dtype=geometry.dtype, model_type=config.get("model_type"),
                               model_config=config)
    return fitted(weights, geometry)


def fitted(weights: LoRAWeights, geometry: SlotGeometry) -> LoRAWeights:
    """``weights`` resolved against the base (trainable tokens, tied heads:
    mola.adapters.vocab), or InvalidAdapter naming the problem unless they
    fit the packs."""
    weights = resolve_vocab(weights, geometry)
    validate(weights, geometry.targets, geometry.max_rank, geometry.max_expert_rank,
             geometry.expert_slots)
    return weights


def read_recipe(recipe: SlotRecipe, geometry: SlotGeometry, model_config: dict | None,
                pushed: PushedAdapters | None = None) -> LoRAWeights:
    """The weights a recipe describes (before its ``slot_scale``, which the
    slot rows apply): one adapter read and checked, or several stacked
    into one LoRA of rank r1 + r2 + ..."""
    if recipe.is_single:
        return read_checked(recipe.parts[0][0], geometry, model_config, pushed)
    parts = [(read_checked(path, geometry, model_config, pushed), scale) for path, scale in recipe.parts]
    for weights, _ in parts:
        if weights.invocation_tokens is not None:
            raise InvalidAdapter(f"The adapter at {weights.source} is an activated LoRA, which applies from its "
                                 "own invocation on: it is not stacked with others.")
        refuse_in_stack(weights)
    return stack_weights(parts, geometry.max_rank, geometry.max_expert_rank)
