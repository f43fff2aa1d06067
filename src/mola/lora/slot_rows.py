"""What goes into the slot packs and what they weigh, for any thread: the
SlotGeometry an adapter must fit (the ceilings, and the bytes of packs at
them or at any set of adapters), an adapter's SlotRows ready to be written
(prepare_rows), and the PackStats the engine publishes of the packs as sized.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Protocol, Sequence

import mlx.core as mx

from .dora import with_dora_scale
from .embedding import VocabGeometry
from .geometry import ModuleRows, TargetGeometry, bucket, module_rows


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
    """An adapter as the packs take it, by module path (mola.adapters.weights.LoRAWeights is one); a
    DoRA adapter also has ``magnitudes``, module path -> m [out]."""

    @property
    def modules(self) -> Mapping[str, Factors]: ...


@dataclass(frozen=True)
class PackStats:
    """What the packs hold, as the engine publishes it after each slot write
    and clear (immutable: the event loop, /health and /metrics read it)."""

    dense_bytes: int = 0
    expert_bytes: int = 0
    slot_capacity: int = 0  # slots every dense pack holds (slot 0 included)
    num_packs: int = 0  # layers with a pack (some adapter written targets them)
    num_layers: int = 0  # layers that could carry one
    ranks: tuple[int, ...] = ()  # the packs' ranks, distinct
    num_resizes: int = 0
    shape: Mapping[str, int] = field(default_factory=dict)  # module path -> its pack's rank (packs only)

    @property
    def nbytes(self) -> int:
        return self.dense_bytes + self.expert_bytes

    def describe(self) -> dict:
        return {"bytes": self.nbytes, "dense_bytes": self.dense_bytes, "expert_bytes": self.expert_bytes,
                "slots": self.slot_capacity, "packs": self.num_packs, "layers": self.num_layers,
                "ranks": list(self.ranks), "resizes": self.num_resizes}

    def summary(self) -> str:
        """One line for the log."""
        if not self.num_packs:
            return f"slot packs: 0 MiB (no adapter loaded; {self.num_layers} layers can carry one)"
        ranks = "/".join(str(r) for r in self.ranks)
        return (f"slot packs: {self.nbytes / 2**20:.1f} MiB ({self.num_packs} of {self.num_layers} layers, "
                f"rank {ranks}, {self.slot_capacity} slots)")


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
    vocab: "VocabGeometry | None" = None  # the embedding and the head (mola.lora.embedding), where wrapped
    # Module path -> the base linear, whose weights never change once loaded: what a
    # DoRA adapter's g is computed from off the engine thread (None: a geometry made
    # from shapes alone; the slot write then computes g).
    bases: Mapping[str, Any] | None = field(default=None, compare=False, repr=False)

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
        return sum(self.max_rank * (t.input_dims + t.output_dims) * size
                   for t in self.targets.values() if t.num_experts is None)

    @property
    def expert_slot_bytes(self) -> int:
        """What one expert slot of every expert projection takes, at max_expert_rank."""
        size = self.dtype.size
        return sum(t.num_experts * self.max_expert_rank * (t.input_dims + t.output_dims) * size
                   for t in self.targets.values() if t.num_experts is not None)

    @property
    def max_pack_bytes(self) -> int:
        """Every pack of the model at the ceilings (what packs sized at start
        took): dense ones with the empty slot 0, expert ones without."""
        experts = self.expert_slots * self.expert_slot_bytes
        return self.num_slots * self.dense_slot_bytes + experts

    def pack_bytes(self, adapters: Sequence[tuple[int, Iterable[str]]]) -> int:
        """What the packs take with ``adapters`` ((rank, module paths) each)
        written into slots 1..n, as AdapterPacks sizes them: a pack for each
        module one targets, at the largest rank there in powers of two; the
        dense packs hold slots 0..n in powers of two."""
        ranks: dict[str, int] = {}
        for rank, paths in adapters:
            for path in paths:
                ranks[path] = max(ranks.get(path, 0), rank)
        slots = bucket(len(adapters) + 1, self.num_slots)
        total = 0
        for path, rank in ranks.items():
            t = self.targets[path]
            rows = t.num_experts * self.expert_slots if t.num_experts else slots
            ceiling = self.max_expert_rank if t.num_experts else self.max_rank
            total += rows * bucket(rank, ceiling) * (t.input_dims + t.output_dims) * self.dtype.size
        return total


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
        return SlotRows(modules, sum(r.nbytes for r in modules.values()))


def prepare_rows(weights: Adapter, geometry: SlotGeometry, scale: float = 1.0) -> SlotRows:
    """The slot rows of a validated adapter, its scales multiplied by
    ``scale``, evaluated. Pure: any thread (the reader thread does it, so that
    the engine thread only copies)."""
    modules = {}
    magnitudes = getattr(weights, "magnitudes", None) or {}  # a DoRA adapter's m [out] by path
    for path, m in weights.modules.items():
        target = geometry.targets[path]
        max_rank = geometry.max_expert_rank if target.num_experts else geometry.max_rank
        modules[path] = module_rows(target, max_rank, geometry.dtype, m.a, m.b, m.scale * scale,
                                    magnitudes.get(path))
        if path in magnitudes and geometry.bases is not None:  # DoRA: g, one layer at a time
            modules[path] = with_dora_scale(modules[path], geometry.bases[path], geometry.dtype)
            mx.eval(modules[path].dora_scale)
    mx.eval([(r.a, r.b, r.magnitude) for r in modules.values()])
    return SlotRows.of(modules)
