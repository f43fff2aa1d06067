"""Slot-indexed adapter packs across a whole model.

:meth:`AdapterPacks.install` wraps the target linears of an mlx-lm model in
place (wrap, don't fork) and keeps them by module path, so that one adapter can
be written into, or cleared from, one slot of every layer at once.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_unflatten

from .layer import WRAPPABLE, LoRARouting, MultiLoRALinear
from .weights import LoRAWeights


class AdapterPacks:
    """Every MultiLoRALinear of one model. Slot 0 is always "no adapter"."""

    def __init__(self, layers: dict[str, MultiLoRALinear], routing: LoRARouting):
        self.layers = layers  # module path -> layer
        self.routing = routing

    @classmethod
    def install(
        cls, model: nn.Module, *, max_loras: int, max_rank: int
    ) -> "AdapterPacks":
        """Wrap every linear inside ``model.layers`` (attention and MLP
        projections; plain, quantized or tensor-parallel parts) with
        ``max_loras`` slots of rank up to ``max_rank``, plus the empty slot 0."""
        routing = LoRARouting()
        in_blocks = {id(m) for block in model.layers for _, m in block.named_modules()}
        wrapped = []
        for path, module in model.named_modules():
            if id(module) not in in_blocks:
                continue
            if isinstance(module, WRAPPABLE):
                layer = MultiLoRALinear.from_base(
                    module, routing, num_slots=max_loras + 1, max_rank=max_rank
                )
                wrapped.append((path, layer))
        if not wrapped:
            raise ValueError(f"{type(model).__name__} has no linear layers to wrap")
        model.update_modules(tree_unflatten(wrapped))
        packs = cls(dict(wrapped), routing)
        mx.eval(packs.arrays())
        return packs

    @property
    def num_slots(self) -> int:
        return next(iter(self.layers.values())).num_slots

    @property
    def max_rank(self) -> int:
        return next(iter(self.layers.values())).max_rank

    def targets(self) -> dict[str, tuple[int, int]]:
        """Module path -> (input_dims, output_dims) of every wrapped linear
        (whole, also when this rank holds a tensor-parallel part of it)."""
        return {p: l.full_dims for p, l in self.layers.items()}

    def arrays(self) -> list[mx.array]:
        return [a for l in self.layers.values() for a in (l.lora_a, l.lora_b, l.lora_scale)]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays())

    def prepare(self, weights: LoRAWeights, scale: float = 1.0) -> dict:
        """The slot rows of a validated adapter, its scales multiplied by
        ``scale``, evaluated (see MultiLoRALinear.slot_rows). Any thread."""
        rows = {}
        for path, m in weights.modules.items():
            a_row, b_row = self.layers[path].slot_rows(m.a, m.b, m.scale * scale)
            rows[path] = (a_row, b_row, m.rank, m.scale * scale)
        mx.eval([r[:2] for r in rows.values()])
        return rows

    def store(self, slot: int, rows: dict) -> None:
        """Write prepared rows into ``slot`` of every layer; layers the adapter
        does not touch are zeroed there. Engine thread."""
        if not 0 < slot < self.num_slots:
            raise ValueError(f"slot {slot} is outside 1..{self.num_slots - 1}")
        for path, layer in self.layers.items():
            row = rows.get(path)
            if row is None:
                layer.clear_slot(slot)
            else:
                layer.store_slot(slot, row[0], row[1], rank=row[2], scale=row[3])
        mx.eval(self.arrays())

    def write(self, slot: int, weights: LoRAWeights, scale: float = 1.0) -> None:
        """Write a validated adapter into ``slot`` of every layer, its scale
        multiplied by ``scale``; layers the adapter does not touch are zeroed
        there."""
        self.store(slot, self.prepare(weights, scale))

    def clear(self, slot: int) -> None:
        """Zero ``slot`` in every layer."""
        for layer in self.layers.values():
            layer.clear_slot(slot)
        mx.eval(self.arrays())
