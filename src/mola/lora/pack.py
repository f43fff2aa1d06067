"""Slot-indexed adapter packs across a whole model.

:meth:`AdapterPacks.install` wraps the target linears of an mlx-lm model in
place (wrap, don't fork) and keeps them by module path, so that one adapter can
be written into, or cleared from, one slot of every layer at once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Protocol

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_unflatten

from .experts import EXPERT_BASES, MultiLoRASwitchGLU, MultiLoRASwitchLinear, expert_dims
from .geometry import WRAPPABLE, ModuleRows, TargetGeometry, compute_dtype, full_dims, module_rows, sharding_of
from .layer import MultiLoRALinear
from .routing import LoRARouting


class Factors(Protocol):
    """One module's LoRA as the packs take it: delta(x) = scale * (x @ a) @ b
    (mola.adapters.weights.ModuleLoRA is one)."""

    @property
    def a(self) -> mx.array: ...  # [in, r], or [E, in, r] for experts

    @property
    def b(self) -> mx.array: ...  # [r, out], or [E, r, out] for experts

    @property
    def scale(self) -> float: ...


class Adapter(Protocol):
    """An adapter as the packs take it, by module path (mola.adapters.weights.LoRAWeights is one)."""

    @property
    def modules(self) -> Mapping[str, Factors]: ...


class AdapterPacks:
    """Every multi-LoRA layer of one model (module path -> MultiLoRALinear,
    or MultiLoRASwitchLinear for an expert projection). Slot 0 is always
    "no adapter"; slots 1..expert_slots can also carry expert LoRA."""

    def __init__(self, layers: dict[str, MultiLoRALinear | MultiLoRASwitchLinear], routing: LoRARouting,
                 max_rank: int, num_slots: int, expert_slots: int = 0, max_expert_rank: int = 0):
        self.layers = layers  # module path -> layer
        self.routing = routing
        self.max_rank = max_rank
        self.num_slots = num_slots  # slot 0 included
        self.expert_slots = expert_slots  # slots 1..expert_slots carry expert LoRA
        self.max_expert_rank = max_expert_rank

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
        glus = []
        if expert_slots:
            glus = [(path, MultiLoRASwitchGLU.from_base(glu, routing, expert_slots, max_expert_rank))
                    for path, glu in expert_targets(model)]
        routing.expert_slots = expert_slots if glus else 0  # 0: every row runs the base's experts
        model.update_modules(tree_unflatten(wrapped + glus))
        layers = dict(wrapped)
        for path, glu in glus:
            layers.update((f"{path}.{name}", p) for name, p in glu.projections())
        packs = cls(layers, routing, max_rank, max_loras + 1, expert_slots if glus else 0,
                    max_expert_rank if glus else 0)
        mx.eval(packs.arrays())
        return packs

    @property
    def geometry(self) -> SlotGeometry:
        """What adapters must fit to be written into these packs."""
        first = next(iter(self.layers.values()))
        return SlotGeometry(
            targets={p: l.geometry for p, l in self.layers.items()},
            max_rank=self.max_rank, num_slots=self.num_slots, dtype=first.dtype,
            expert_slots=self.expert_slots, max_expert_rank=self.max_expert_rank,
        )

    def arrays(self) -> list[mx.array]:
        return [a for l in self.layers.values() for a in (l.lora_a, l.lora_b, getattr(l, "folded_scale", None))
                if a is not None]

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
        if rows.has_experts and slot > self.expert_slots:
            raise ValueError(f"slot {slot} cannot carry expert LoRA (slots 1..{self.expert_slots} can)")
        for path, layer in self.layers.items():
            row = rows.modules.get(path)
            if row is None:
                layer.zero_rows(slot)
            else:
                layer.set_rows(slot, row)
        mx.async_eval(self.arrays())

    def fill_from(self, slot: int, weights: Adapter, scale: float = 1.0) -> None:
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
    glus = expert_targets(model) if expert_slots else []
    for path, glu in glus:
        for name in ("gate_proj", "up_proj", "down_proj"):
            E, i, o = expert_dims(getattr(glu, name))
            geometry[f"{path}.{name}"] = TargetGeometry(i, o, num_experts=E)
    return SlotGeometry(
        targets=geometry, max_rank=max_rank, num_slots=num_slots, dtype=compute_dtype(targets[0][1]),
        expert_slots=expert_slots if glus else 0, max_expert_rank=max_expert_rank if glus else 0,
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
    expert_slots: int = 0  # slots 1..expert_slots also carry expert LoRA (0: none, or no experts)
    max_expert_rank: int = 0  # the largest rank of an expert module

    @property
    def dims(self) -> dict[str, tuple[int, int]]:
        """Module path -> (input_dims, output_dims) of the whole linear."""
        return {p: t.dims for p, t in self.targets.items()}

    @property
    def num_experts(self) -> int | None:
        """Experts per MoE layer when the base has expert targets."""
        return next((t.num_experts for t in self.targets.values() if t.num_experts), None)

    @property
    def dense_slot_bytes(self) -> int:
        """What one slot of every plain linear takes on the device, at max_rank."""
        size = self.dtype.size
        return sum(self.max_rank * (t.input_dims + t.output_dims) * size + 4
                   for t in self.targets.values() if t.num_experts is None)

    @property
    def expert_slot_bytes(self) -> int:
        """What one expert slot of every expert projection takes, at max_expert_rank."""
        size = self.dtype.size
        return sum(t.num_experts * self.max_expert_rank * (t.input_dims + t.output_dims) * size
                   for t in self.targets.values() if t.num_experts is not None)

    @property
    def pack_bytes(self) -> int:
        """Every pack of the model: dense ones with the empty slot 0, expert ones without."""
        experts = self.expert_slots * self.expert_slot_bytes
        return self.num_slots * self.dense_slot_bytes + experts


@dataclass(frozen=True)
class SlotRows:
    """One adapter, ready to be written into a slot of every layer (at its
    own ranks: the write zero-pads)."""

    modules: Mapping[str, ModuleRows]  # module path -> its rows; other layers are zeroed
    nbytes: int  # host memory the rows take

    @property
    def has_experts(self) -> bool:
        """Rows for expert projections: the adapter needs an expert slot."""
        return any(r.a.ndim == 3 for r in self.modules.values())

    @staticmethod
    def of(modules: Mapping[str, ModuleRows]) -> "SlotRows":
        return SlotRows(modules, sum(r.a.nbytes + r.b.nbytes for r in modules.values()))


def prepare_rows(weights: Adapter, geometry: SlotGeometry, scale: float = 1.0) -> SlotRows:
    """The slot rows of a validated adapter, its scales multiplied by
    ``scale``, evaluated. Pure: any thread (the reader thread does it, so that
    the engine thread only copies)."""
    modules = {}
    for path, m in weights.modules.items():
        target = geometry.targets[path]
        max_rank = geometry.max_expert_rank if target.num_experts else geometry.max_rank
        modules[path] = module_rows(target, max_rank, geometry.dtype, m.a, m.b, m.scale * scale)
    mx.eval([(r.a, r.b) for r in modules.values()])
    return SlotRows.of(modules)
