"""Which slot each row of a forward pass uses: the one routing object that the
runner sets before every model call and every multi-LoRA layer reads.

Rows on one slot take the single-slot path (two matmuls); mixed rows take one
``gather_mm`` per factor fed the row -> slot index, sorted by slot once a batch
has ``sort_threshold`` rows where sorting pays (see
:func:`default_sort_threshold`). Each row's ``row_scale`` (its request's
``lora_scale``) multiplies its delta. Expert LoRA (mola.lora.experts) reads
its own index and scale from here too.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx

# On a GPU, batches with at least this many rows take the sorted gather_mm path.
SORT_THRESHOLD = 16


def default_sort_threshold() -> int | None:
    """The rows from which a mixed batch is sorted by slot; None: never.

    Sorting costs two row gathers per linear and pays only where ``gather_mm``
    uses the order: MLX's GPU kernels run the rows of one slot as one segment.
    Its CPU kernel runs one GEMM per row whatever the order
    (``GatherMM::eval_cpu``), so there the gathers buy nothing: SmolLM2's
    mixed decode steps at batch 32 ran 1.09 x faster unsorted
    (benchmarks/README.md, "Where the LoRA time goes"). Both paths give the
    same sums (tests/test_layer.py)."""
    return SORT_THRESHOLD if mx.default_device() == mx.gpu else None


@dataclass
class LoRARouting:
    """Which slot each row of the next forward pass uses.

    Set by the runner before every model call (prefill and decode alike) with
    plain Python lists; read by every MultiLoRALinear during that call.
    """

    sort_threshold: int | None = field(default_factory=default_sort_threshold)
    # Every row on this one slot (0: base model only); None when rows differ.
    single_slot: int | None = 0
    slots: frozenset[int] = field(default_factory=lambda: frozenset({0}))
    idx: mx.array | None = None  # [B] int32, row -> slot (mixed batches only)
    row_scale: mx.array | None = None  # [B, 1, 1] per-row multiplier ([B, L, 1] with a mask), None: all 1
    order: mx.array | None = None  # [B] rows sorted by slot (sorted path only)
    inv_order: mx.array | None = None  # [B] inverse permutation of ``order``
    sorted_idx: mx.array | None = None  # [B] idx[order]
    # Expert LoRA (mola.lora.experts): slots 1..expert_slots can carry it, at
    # index slot - 1 of the expert packs (which have no empty slot 0: a row
    # on another slot reads index 0 with a scale of 0).
    expert_slots: int = 0
    expert_slots_used: frozenset[int] = frozenset()  # slots of this pass that can carry expert LoRA
    expert_slot: int | None = None  # pack index of every row, when all rows are on one expert slot
    expert_idx: mx.array | None = None  # [B, 1, 1] uint32, row -> pack index (otherwise)
    expert_scale: mx.array | None = None  # [B, 1, 1] row_scale, 0 for rows off the expert slots; None: all 1
    _key: tuple | None = None  # the arguments of the last set()

    def set(self, slots: list[int], scales: list[float] | None = None, active: mx.array | None = None) -> None:
        """Route row i to ``slots[i]``, its delta multiplied by ``scales[i]``;
        ``active`` [B, L] (0 or 1): at which positions of this pass each row's
        delta applies (activated LoRA: from its invocation on), None: all."""
        key = (tuple(slots), tuple(scales) if scales is not None else None, self.sort_threshold)
        if key == self._key and active is None:
            return  # the same rows as the last pass: reuse its arrays
        self._key = key if active is None else None
        self.slots = frozenset(slots)
        self.row_scale = None
        if scales is not None and any(s != 1.0 for s in scales):
            self.row_scale = mx.array(scales, dtype=mx.float32)[:, None, None]
        if active is not None:  # [B, L, 1]: the per-row scale, per position
            ones = mx.ones((len(slots), 1, 1), dtype=mx.float32)
            self.row_scale = (self.row_scale if self.row_scale is not None else ones) * active[:, :, None]
        self.idx = self.order = self.inv_order = self.sorted_idx = None
        # (an activated LoRA has no expert LoRA, which weights.with_invocation refuses: its expert
        # slot rows are zero, and other rows' masks are all ones, so the experts need no mask)
        self._set_experts(slots, scales)
        if len(self.slots) == 1:
            self.single_slot = slots[0]
            return
        self.single_slot = None
        self.idx = mx.array(slots, dtype=mx.uint32)
        if self.sort_threshold is not None and len(slots) >= self.sort_threshold:
            order = sorted(range(len(slots)), key=slots.__getitem__)
            inv = [0] * len(order)
            for pos, row in enumerate(order):
                inv[row] = pos
            self.order = mx.array(order, dtype=mx.uint32)
            self.inv_order = mx.array(inv, dtype=mx.uint32)
            self.sorted_idx = mx.array([slots[r] for r in order], dtype=mx.uint32)

    def _set_experts(self, slots: list[int], scales: list[float] | None) -> None:
        on = [1 <= s <= self.expert_slots for s in slots]
        self.expert_slots_used = frozenset(s for s, o in zip(slots, on) if o)
        self.expert_slot = self.expert_idx = self.expert_scale = None
        if not self.expert_slots_used:
            return  # the experts run as the base has them
        if all(on) and len(self.expert_slots_used) == 1:
            self.expert_slot = slots[0] - 1
        else:
            self.expert_idx = mx.array([s - 1 if o else 0 for s, o in zip(slots, on)], dtype=mx.uint32)[:, None, None]
        row = scales if scales is not None else [1.0] * len(slots)
        factors = [sc if o else 0.0 for sc, o in zip(row, on)]
        if any(f != 1.0 for f in factors):
            self.expert_scale = mx.array(factors, dtype=mx.float32)[:, None, None]

    def clear(self) -> None:
        self._key = None
        self.set([0])
