"""Slot-indexed adapter packs across a whole model.

:meth:`AdapterPacks.install` wraps the target linears of an mlx-lm model in
place (wrap, don't fork) and keeps them by module path, so that one adapter can
be written into, or cleared from, one slot of every layer at once.

The packs hold what is loaded, not the ceilings (--max-loras, --max-lora-rank):
a layer that no written adapter targets has no pack at all, a layer's rank is
the largest written into it in powers of two, and every dense pack holds the
slots up to the highest written one, in powers of two (slot numbers index the
packs directly, so that count must be the same in every layer). Packs grow
in the slot write that needs them and shrink lazily after clears, and fully
when :meth:`AdapterPacks.compact` runs (the engine calls it once idle for
EngineConfig.pack_compact_idle_s). Every
resize is a copy between two steps on the engine thread: the step in flight
keeps reading the arrays it was built with.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_unflatten

from .experts import EXPERT_BASES, MultiLoRASwitchGLU, MultiLoRASwitchLinear, expert_dims
from .geometry import WRAPPABLE, TargetGeometry, bucket, compute_dtype, full_dims, sharding_of
from .embedding import VocabGeometry, vocab_geometry, vocab_targets, wrap_vocab
from .layer import MultiLoRALinear
from .routing import LoRARouting
# What goes into the packs, re-exported: mola's other packages import them from here.
from .slot_rows import Adapter, Factors, PackStats, SlotGeometry, SlotRows, prepare_rows

__all__ = ["Adapter", "AdapterPacks", "Factors", "PackStats", "SlotGeometry", "SlotRows", "expert_targets",
           "geometry_of", "lora_targets", "prepare_rows"]


class AdapterPacks:
    """Every multi-LoRA layer of one model (module path -> MultiLoRALinear,
    or MultiLoRASwitchLinear for an expert projection). Slot 0 is always
    "no adapter"; slots 1..expert_slots can also carry expert LoRA."""

    def __init__(self, layers: dict[str, MultiLoRALinear | MultiLoRASwitchLinear], routing: LoRARouting,
                 max_rank: int, num_slots: int, expert_slots: int = 0, max_expert_rank: int = 0,
                 vocab: VocabGeometry | None = None):
        self.layers = layers  # module path -> layer
        self.vocab = vocab  # where the embedding and the head are (mola.lora.embedding)
        self.routing = routing
        self.max_rank = max_rank  # the ceiling (--max-lora-rank)
        self.num_slots = num_slots  # the ceiling, slot 0 included (--max-loras + 1)
        self.expert_slots = expert_slots  # slots 1..expert_slots carry expert LoRA
        self.max_expert_rank = max_expert_rank
        self.num_resizes = 0  # slot writes and clears that changed the packs' size
        self._held: set[int] = set()  # slots written (1..num_slots - 1)
        self._dense = [l for l in layers.values() if isinstance(l, MultiLoRALinear)]
        self._set_slot_capacity(1)

    @property
    def slot_capacity(self) -> int:
        """Slots every dense pack holds now (slot 0 included)."""
        return self._slot_capacity

    def _set_slot_capacity(self, n: int) -> None:
        self._slot_capacity = n
        for layer in self._dense:
            layer.resize(n, layer.rank_capacity)

    @classmethod
    def install(cls, model: nn.Module, *, max_loras: int, max_rank: int,
                expert_slots: int = 0, max_expert_rank: int = 0) -> "AdapterPacks":
        """Wrap every linear inside ``model.layers`` (attention and MLP
        projections, routers, shared experts; plain, quantized or
        tensor-parallel parts) with ``max_loras`` slots of rank up to
        ``max_rank``, plus the empty slot 0; and, with ``expert_slots`` > 0,
        every SwitchGLU's expert projections with that many slots of rank up
        to ``max_expert_rank`` (mola.lora.experts)."""
        if expert_slots > max_loras:
            raise ValueError(f"expert slots ({expert_slots}) cannot outnumber adapter slots ({max_loras})")
        routing = LoRARouting()
        wrapped = [
            (path, MultiLoRALinear.from_base(module, routing, num_slots=max_loras + 1, max_rank=max_rank))
            for path, module in lora_targets(model)
        ]
        if not wrapped:
            raise ValueError(f"{type(model).__name__} has no linear layers to wrap")
        vocab = vocab_geometry(model)  # before wrapping: it reads the base layers
        vocab_tree, vocab_layers = wrap_vocab(model, routing, max_loras + 1, max_rank)
        glus = []
        if expert_slots:
            glus = [(path, MultiLoRASwitchGLU.from_base(glu, routing, expert_slots, max_expert_rank))
                    for path, glu in expert_targets(model)]
        routing.expert_slots = expert_slots if glus else 0  # 0: every row runs the base's experts
        model.update_modules(tree_unflatten(wrapped + vocab_tree + glus))
        layers = dict(wrapped) | vocab_layers
        for path, glu in glus:
            layers.update((f"{path}.{name}", p) for name, p in glu.projections())
        packs = cls(layers, routing, max_rank, max_loras + 1, expert_slots if glus else 0,
                    max_expert_rank if glus else 0, vocab)
        mx.eval(packs.arrays())
        return packs

    @property
    def geometry(self) -> SlotGeometry:
        """What adapters must fit to be written into these packs."""
        first = next(iter(self.layers.values()))
        return SlotGeometry(
            targets={p: l.geometry for p, l in self.layers.items()},
            max_rank=self.max_rank, num_slots=self.num_slots, dtype=first.dtype,
            expert_slots=self.expert_slots, max_expert_rank=self.max_expert_rank, vocab=self.vocab,
            bases={p: l.base for p, l in self.layers.items() if isinstance(l, MultiLoRALinear)},
        )

    def arrays(self) -> list[mx.array]:
        packs = [a for l in self.layers.values() for a in (l.lora_a, l.lora_b)]
        return packs + [l.dora.g for l in self._dense if l.dora.g is not None]  # DoRA's g [S, out]

    @property
    def nbytes(self) -> int:
        return sum(l.nbytes for l in self.layers.values())

    def stats(self) -> PackStats:
        """What the packs hold now (any thread may keep the result)."""
        dense = [l for l in self._dense if l.rank_capacity]
        experts = [l for l in self.layers.values() if not isinstance(l, MultiLoRALinear) and l.rank_capacity]
        return PackStats(
            dense_bytes=sum(l.nbytes for l in dense), expert_bytes=sum(l.nbytes for l in experts),
            slot_capacity=self.slot_capacity, num_packs=len(dense) + len(experts), num_layers=len(self.layers),
            ranks=tuple(sorted({l.rank_capacity for l in dense + experts})), num_resizes=self.num_resizes,
            shape={p: l.rank_capacity for p, l in self.layers.items() if l.rank_capacity},
        )

    def fill(self, slot: int, rows: SlotRows) -> None:
        """Write prepared rows into ``slot`` of every layer; layers the adapter
        does not touch are zeroed there. The packs grow first where the rows
        need it (more slots, a higher rank); ranks the slot's old adapter
        alone needed are given back lazily. Engine thread.

        The copies are queued on the engine's stream (``mx.async_eval``), not
        waited for: they run after the step in flight and before any step
        launched later, which is all the order that matters, and the engine
        thread goes on planning meanwhile. A copy, not a pointer swap:
        ``gather_mm`` needs every slot in one pack, and rebuilding a pack
        around new per-slot arrays copies all of its slots (benchmarks/README.md)."""
        if not 0 < slot < self.num_slots:
            raise ValueError(f"slot {slot} is outside 1..{self.num_slots - 1}")
        if rows.has_experts and slot > self.expert_slots:
            raise ValueError(f"slot {slot} cannot carry expert LoRA (slots 1..{self.expert_slots} can)")
        before = self._shapes()
        self._held.add(slot)
        slots = max(self.slot_capacity, bucket(max(self._held) + 1, self.num_slots))
        for path, layer in self.layers.items():  # one copy per pack that grows, slots and rank at once
            row = rows.modules.get(path)
            rank = max(layer.rank_capacity, bucket(row.rank, layer.max_rank) if row is not None else 0)
            if isinstance(layer, MultiLoRALinear):
                layer.resize(slots, rank)
            else:
                layer.resize(rank)
        self._slot_capacity = slots
        for path, layer in self.layers.items():
            row = rows.modules.get(path)
            if row is None:
                layer.zero_rows(slot)
            else:
                layer.set_rows(slot, row)
        self._shrink(lazy=True)
        self.num_resizes += self._shapes() != before
        mx.async_eval(self.arrays())

    def fill_from(self, slot: int, weights: Adapter, scale: float = 1.0) -> None:
        """Prepare and write a validated adapter into ``slot`` (its scales
        multiplied by ``scale``)."""
        self.fill(slot, prepare_rows(weights, self.geometry, scale))

    def empty(self, slot: int) -> None:
        """Zero ``slot`` in every layer; packs it alone needed shrink lazily."""
        before = self._shapes()
        for layer in self.layers.values():
            layer.zero_rows(slot)
        self._held.discard(slot)
        self._shrink(lazy=True)
        self.num_resizes += self._shapes() != before
        mx.eval(self.arrays())

    @property
    def is_oversized(self) -> bool:
        """Would :meth:`compact` shrink something?"""
        slots = bucket(max(self._held, default=0) + 1, self.num_slots)
        return slots < self.slot_capacity or any(l.rank_capacity > l.rank_needed for l in self.layers.values())

    def compact(self) -> bool:
        """Shrink every pack to what its written slots need (an idle engine
        calls it); True when something shrank."""
        before = self._shapes()
        self._shrink(lazy=False)
        changed = self._shapes() != before
        if changed:
            self.num_resizes += 1
            mx.eval(self.arrays())
        return changed

    def _shrink(self, lazy: bool) -> None:
        """Give back slots and ranks no written slot needs (``lazy``: only
        what is gone entirely, or down from 4x the need; see MultiLoRALinear.shrink)."""
        for layer in self.layers.values():
            layer.shrink(lazy)
        need = bucket(max(self._held, default=0) + 1, self.num_slots)
        if need < self.slot_capacity and (not lazy or 4 * need <= self.slot_capacity):
            self._set_slot_capacity(need)

    def _shapes(self) -> tuple:
        return self.slot_capacity, tuple(l.rank_capacity for l in self.layers.values())


def lora_targets(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(module path, linear) of every linear that can carry LoRA slots: the
    attention and MLP projections inside ``model.layers`` (plain, quantized
    or tensor-parallel parts)."""
    in_blocks = {id(m) for block in model.layers for _, m in block.named_modules()}
    return [(path, module) for path, module in model.named_modules()
            if id(module) in in_blocks and isinstance(module, WRAPPABLE)]


def expert_targets(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(module path, SwitchGLU) of every mixture-of-experts block inside
    ``model.layers`` whose expert projections can carry LoRA."""
    from mlx_lm.models.switch_layers import SwitchGLU

    in_blocks = {id(m) for block in model.layers for _, m in block.named_modules()}
    return [(path, m) for path, m in model.named_modules()
            if id(m) in in_blocks and isinstance(m, SwitchGLU)
            and all(isinstance(getattr(m, n), EXPERT_BASES) for n in ("gate_proj", "up_proj", "down_proj"))]


def geometry_of(model: nn.Module, max_rank: int, num_slots: int, expert_slots: int = 0,
                max_expert_rank: int = 0) -> "SlotGeometry":
    """The SlotGeometry that AdapterPacks.install would give ``model``, from
    its linears' shapes and dtypes alone (no array is evaluated: a model
    loaded lazily stays on disk)."""
    targets = lora_targets(model)
    if not targets:
        raise ValueError(f"{type(model).__name__} has no linear layers to wrap")
    geometry = {path: TargetGeometry(*full_dims(m), sharding_of(m)) for path, m in targets}
    geometry.update(vocab_targets(model))  # the token embedding and the output head
    glus = expert_targets(model) if expert_slots else []
    for path, glu in glus:
        for name in ("gate_proj", "up_proj", "down_proj"):
            E, i, o = expert_dims(getattr(glu, name))
            geometry[f"{path}.{name}"] = TargetGeometry(i, o, num_experts=E)
    return SlotGeometry(
        targets=geometry, max_rank=max_rank, num_slots=num_slots, dtype=compute_dtype(targets[0][1]),
        expert_slots=expert_slots if glus else 0, max_expert_rank=max_expert_rank if glus else 0,
        vocab=vocab_geometry(model, with_rows=False),
    )
