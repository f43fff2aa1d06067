"""Slot-indexed adapter packs across a whole model.

:meth:`AdapterPacks.install` wraps the target linears of an mlx-lm model in
place (wrap, don't fork) and keeps them by module path, so that one adapter can
be written into, or cleared from, one slot of every layer at once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_unflatten

from .layer import (WRAPPABLE, LoRARouting, ModuleRows, MultiLoRALinear, TargetGeometry, compute_dtype, full_dims,
                    module_rows, sharding_of)
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
        wrapped = [
            (path, MultiLoRALinear.from_base(module, routing, num_slots=max_loras + 1, max_rank=max_rank))
            for path, module in lora_targets(model)
        ]
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

    @property
    def geometry(self) -> SlotGeometry:
        """What adapters must fit to be written into these packs."""
        first = next(iter(self.layers.values()))
        return SlotGeometry(
            targets={p: l.geometry for p, l in self.layers.items()},
            max_rank=first.max_rank, num_slots=first.num_slots, dtype=first.dtype,
        )

    def arrays(self) -> list[mx.array]:
        return [a for l in self.layers.values() for a in (l.lora_a, l.lora_b, l.lora_scale)]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays())

    def fill(self, slot: int, rows: SlotRows) -> None:
        """Write prepared rows into ``slot`` of every layer; layers the adapter
        does not touch are zeroed there. Engine thread.

        The copies are queued on the engine's stream (``mx.async_eval``), not
        waited for: they run after the step in flight and before any step
        launched later, which is all the order that matters, and the engine
        thread goes on planning meanwhile. A copy, not a pointer swap:
        ``gather_mm`` needs every slot in one pack, and rebuilding a pack
        around new per-slot arrays copies all of its slots (benchmarks/README.md)."""
        if not 0 < slot < self.num_slots:
            raise ValueError(f"slot {slot} is outside 1..{self.num_slots - 1}")
        for path, layer in self.layers.items():
            row = rows.modules.get(path)
            if row is None:
                layer.zero_rows(slot)
            else:
                layer.set_rows(slot, row)
        mx.async_eval(self.arrays())

    def fill_from(self, slot: int, weights: LoRAWeights, scale: float = 1.0) -> None:
        """Prepare and write a validated adapter into ``slot`` (its scales
        multiplied by ``scale``)."""
        self.fill(slot, prepare_rows(weights, self.geometry, scale))

    def empty(self, slot: int) -> None:
        """Zero ``slot`` in every layer."""
        for layer in self.layers.values():
            layer.zero_rows(slot)
        mx.eval(self.arrays())


def lora_targets(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(module path, linear) of every linear that can carry LoRA slots: the
    attention and MLP projections inside ``model.layers`` (plain, quantized
    or tensor-parallel parts)."""
    in_blocks = {id(m) for block in model.layers for _, m in block.named_modules()}
    return [(path, module) for path, module in model.named_modules()
            if id(module) in in_blocks and isinstance(module, WRAPPABLE)]


def geometry_of(model: nn.Module, max_rank: int, num_slots: int) -> "SlotGeometry":
    """The SlotGeometry that AdapterPacks.install would give ``model``, from
    its linears' shapes and dtypes alone (no array is evaluated: a model
    loaded lazily stays on disk)."""
    targets = lora_targets(model)
    if not targets:
        raise ValueError(f"{type(model).__name__} has no linear layers to wrap")
    return SlotGeometry(
        targets={path: TargetGeometry(*full_dims(m), sharding_of(m)) for path, m in targets},
        max_rank=max_rank, num_slots=num_slots, dtype=compute_dtype(targets[0][1]),
    )


@dataclass(frozen=True)
class SlotGeometry:
    """What an adapter must fit to go into a slot: every linear that can carry
    LoRA (module path -> its whole dims and this rank's sharding), the largest
    rank, the number of slots (slot 0 included) and the packs' dtype. Fixed
    once the model is loaded; any thread may read it."""

    targets: Mapping[str, TargetGeometry]
    max_rank: int
    num_slots: int
    dtype: mx.Dtype

    @property
    def dims(self) -> dict[str, tuple[int, int]]:
        """Module path -> (input_dims, output_dims) of the whole linear."""
        return {p: t.dims for p, t in self.targets.items()}


@dataclass(frozen=True)
class SlotRows:
    """One adapter, ready to be written into a slot of every layer (at its
    own ranks: the write zero-pads)."""

    modules: Mapping[str, ModuleRows]  # module path -> its rows; other layers are zeroed
    nbytes: int  # host memory the rows take

    @staticmethod
    def of(modules: Mapping[str, ModuleRows]) -> "SlotRows":
        return SlotRows(modules, sum(r.a.nbytes + r.b.nbytes for r in modules.values()))


def prepare_rows(weights: LoRAWeights, geometry: SlotGeometry, scale: float = 1.0) -> SlotRows:
    """The slot rows of a validated adapter, its scales multiplied by
    ``scale``, evaluated. Pure: any thread (the reader thread does it, so that
    the engine thread only copies)."""
    modules = {}
    for path, m in weights.modules.items():
        modules[path] = module_rows(geometry.targets[path], geometry.max_rank, geometry.dtype,
                                    m.a, m.b, m.scale * scale)
    mx.eval([(r.a, r.b) for r in modules.values()])
    return SlotRows.of(modules)
