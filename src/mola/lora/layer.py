"""The multi-LoRA linear layer and the routing object every such layer reads.

One forward pass carries rows for many adapters at once. The runner tells all
layers which row uses which slot through one shared :class:`LoRARouting`; each
:class:`MultiLoRALinear` then adds

    scale[idx] * gather_mm(gather_mm(x, A, idx), B, idx)

to its base output, where ``A`` [S, in, r] and ``B`` [S, r, out] are the
slot-indexed packs and slot 0 means "no adapter" (all zeros).

Two storage choices keep that cheap. ``A`` is kept transposed, ``lora_a`` of
shape [S, r_max, in], so that the slice of the rank actually in use,
``lora_a[:, :r]``, stays contiguous per slot and ``gather_mm`` reads it in
place (slicing [S, in, r_max] on its last axis made MLX copy the pack on every
call). And each slot's scale is folded into its ``B`` when it is written
(``lora_b[s] = scale[s] * B_s``), which is the same product with one
multiplication fewer per layer; ``lora_scale`` keeps the scales for reading.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx
import mlx.nn as nn
import mlx.nn.layers.distributed as dist

# Batches with at least this many rows take the sorted gather_mm path.
SORT_THRESHOLD = 16


@dataclass
class LoRARouting:
    """Which slot each row of the next forward pass uses.

    Set by the runner before every model call (prefill and decode alike) with
    plain Python lists; read by every MultiLoRALinear during that call.
    """

    sort_threshold: int = SORT_THRESHOLD
    # Every row on this one slot (0: base model only); None when rows differ.
    single_slot: int | None = 0
    slots: frozenset[int] = field(default_factory=lambda: frozenset({0}))
    idx: mx.array | None = None  # [B] int32, row -> slot (mixed batches only)
    row_scale: mx.array | None = None  # [B, 1, 1] per-row multiplier, None: all 1
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

    def set(self, slots: list[int], scales: list[float] | None = None) -> None:
        """Route row i to ``slots[i]``, its delta multiplied by ``scales[i]``."""
        key = (tuple(slots), tuple(scales) if scales is not None else None, self.sort_threshold)
        if key == self._key:
            return  # the same rows as the last pass: reuse its arrays
        self._key = key
        self.slots = frozenset(slots)
        self.row_scale = None
        if scales is not None and any(s != 1.0 for s in scales):
            self.row_scale = mx.array(scales, dtype=mx.float32)[:, None, None]
        self.idx = self.order = self.inv_order = self.sorted_idx = None
        self._set_experts(slots, scales)
        if len(self.slots) == 1:
            self.single_slot = slots[0]
            return
        self.single_slot = None
        self.idx = mx.array(slots, dtype=mx.uint32)
        if len(slots) >= self.sort_threshold:
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


# Base layers mola can wrap: plain, quantized, and tensor-parallel shards
# (mlx.nn.layers.distributed, as mlx-lm's model.shard() makes them).
COLUMN_SHARDED = (dist.AllToShardedLinear, dist.QuantizedAllToShardedLinear)  # output split
ROW_SHARDED = (dist.ShardedToAllLinear, dist.QuantizedShardedToAllLinear)  # input split, all-sum
WRAPPABLE = (nn.Linear, nn.QuantizedLinear, *COLUMN_SHARDED, *ROW_SHARDED)


@dataclass(frozen=True)
class Sharding:
    """How a base linear is split across a tensor-parallel group."""

    kind: str = "none"  # "none", "column" (output split) or "row" (input split, then all-sum)
    rank: int = 0
    size: int = 1

    def part(self, n: int) -> slice:
        """This rank's part of a dimension of full size ``n``."""
        step = n // self.size
        return slice(self.rank * step, (self.rank + 1) * step)


def sharding_of(linear: nn.Module) -> Sharding:
    if isinstance(linear, COLUMN_SHARDED + ROW_SHARDED):
        group = linear.group
        kind = "column" if isinstance(linear, COLUMN_SHARDED) else "row"
        return Sharding(kind, group.rank(), group.size())
    return Sharding()


def linear_dims(linear: nn.Module) -> tuple[int, int]:
    """(input_dims, output_dims) of this rank's part of a linear."""
    output_dims, input_dims = linear.weight.shape
    if hasattr(linear, "bits"):  # quantized: packed input
        input_dims = input_dims * 32 // linear.bits
    return input_dims, output_dims


def full_dims(linear: nn.Module) -> tuple[int, int]:
    """(input_dims, output_dims) of the whole linear, across shards."""
    input_dims, output_dims = linear_dims(linear)
    sh = sharding_of(linear)
    if sh.kind == "column":
        output_dims *= sh.size
    elif sh.kind == "row":
        input_dims *= sh.size
    return input_dims, output_dims


@dataclass(frozen=True)
class TargetGeometry:
    """One linear that can carry LoRA: its whole dimensions and how this rank
    holds it."""

    input_dims: int  # of the whole linear, across shards
    output_dims: int
    sharding: Sharding = Sharding()
    num_experts: int | None = None  # E for the experts of a mixture of experts (a SwitchLinear)

    @property
    def dims(self) -> tuple[int, int]:
        return self.input_dims, self.output_dims


@dataclass(frozen=True)
class ModuleRows:
    """What one slot of one MultiLoRALinear stores for an adapter."""

    a: mx.array  # [r, in_part]: A^T at the adapter's own rank (the slot zero-pads it); experts [E, r, in]
    b: mx.array  # [r, out_part]: scale * B; experts [E, r, out]
    rank: int  # the adapter's own rank in this module, r
    scale: float  # the scale folded into b (kept for reading)


def module_rows(target: TargetGeometry, max_rank: int, dtype: mx.Dtype, a: mx.array, b: mx.array,
                scale: float) -> ModuleRows:
    """The rows a slot stores for factors a [in, r], b [r, out]: A^T and
    scale * B, cut to this rank's part, at rank r (not padded to ``max_rank``,
    so that rows kept in host memory take only what the adapter needs). For
    experts, a [E, in, r] and b [E, r, out] give A^T [E, r, in] and scale * B
    [E, r, out] (never sharded). Pure: any thread may compute them."""
    r = a.shape[-1]
    assert r <= max_rank, (r, max_rank)
    if target.num_experts is not None:
        E = target.num_experts
        assert a.shape == (E, target.input_dims, r) and b.shape == (E, r, target.output_dims)
        a_rows = mx.contiguous(a.swapaxes(1, 2).astype(dtype))  # [E, r, in]
        return ModuleRows(a_rows, (scale * b.astype(mx.float32)).astype(dtype), r, scale)
    assert a.shape == (target.input_dims, r) and b.shape == (r, target.output_dims)
    sh = target.sharding
    if sh.kind == "row":  # this rank sees part of the input: its rows of A
        a = a[sh.part(a.shape[0])]
    elif sh.kind == "column":  # this rank makes part of the output: its columns of B
        b = b[:, sh.part(b.shape[1])]
    a_row = mx.contiguous(a.T.astype(dtype))  # [r, in_part]
    b_row = (scale * b.astype(mx.float32)).astype(dtype)  # [r, out_part]
    return ModuleRows(a_row, b_row, r, scale)


def compute_dtype(linear: nn.Module) -> mx.Dtype:
    """The dtype the base layer computes in (scales' dtype when quantized)."""
    if hasattr(linear, "scales"):
        return linear.scales.dtype
    return linear.weight.dtype


class MultiLoRALinear(nn.Module):
    """A base linear plus slot-indexed LoRA packs, routed per row."""

    @staticmethod
    def from_base(
        linear: nn.Module, routing: LoRARouting, num_slots: int, max_rank: int
    ) -> "MultiLoRALinear":
        if not isinstance(linear, WRAPPABLE):
            raise TypeError(f"Cannot wrap {type(linear).__name__} with LoRA slots")
        input_dims, output_dims = linear_dims(linear)
        layer = MultiLoRALinear(
            linear, routing, input_dims, output_dims, num_slots, max_rank,
            compute_dtype(linear),
        )
        layer._sharding = sharding_of(linear)
        return layer

    def __init__(
        self,
        base: nn.Module,
        routing: LoRARouting,
        input_dims: int,
        output_dims: int,
        num_slots: int,
        max_rank: int,
        dtype: mx.Dtype = mx.float32,
    ):
        super().__init__()
        self.base = base
        self.input_dims = input_dims
        self.output_dims = output_dims
        self.max_rank = max_rank
        self.lora_a = mx.zeros((num_slots, max_rank, input_dims), dtype=dtype)  # [S, r, in]: A^T
        self.lora_b = mx.zeros((num_slots, max_rank, output_dims), dtype=dtype)  # [S, r, out]: scale * B
        self.lora_scale = mx.zeros((num_slots,), dtype=mx.float32)  # [S]
        self._routing = routing
        self._sharding = Sharding()  # this layer's part of a tensor-parallel base
        self._ranks: dict[int, int] = {}  # slot -> rank written in this layer
        self._rank = 0  # max rank over written slots: the part of r the forward uses
        # Views of the packs the forward reads, made once per write: with them
        # a decode step runs two matmuls per layer and adapter, no slicing ops.
        # Dropped before every write, so that the write can update in place.
        self._views: dict = {}

    @property
    def num_slots(self) -> int:
        return self.lora_a.shape[0]

    @property
    def dtype(self) -> mx.Dtype:
        return self.lora_a.dtype

    @property
    def active_slots(self) -> frozenset[int]:
        return frozenset(self._ranks)

    @property
    def full_dims(self) -> tuple[int, int]:
        """(input_dims, output_dims) of the whole linear: what an adapter's
        factors must fit, whatever this rank holds of them."""
        return full_dims(self.base)

    def factors(self, slot: int) -> tuple[mx.array, mx.array]:
        """The (A [in, r], scale * B [r, out]) stored in ``slot``."""
        r = self._ranks.get(slot, 0)
        return self.lora_a[slot, :r].T, self.lora_b[slot, :r]

    @property
    def geometry(self) -> "TargetGeometry":
        """What an adapter's factors for this linear must fit, and how this
        rank's part of them is cut (any thread may read it)."""
        input_dims, output_dims = self.full_dims
        return TargetGeometry(input_dims, output_dims, self._sharding)

    def set_factors(self, slot: int, a: mx.array, b: mx.array, scale: float) -> None:
        """Put one adapter's factors (a [in, r], b [r, out]) into ``slot``."""
        self.set_rows(slot, module_rows(self.geometry, self.max_rank, self.dtype, a, b, scale))

    def set_rows(self, slot: int, rows: "ModuleRows") -> None:
        """Write rows made by :func:`module_rows` into ``slot``: its first r
        rows; rows beyond r that an older adapter of higher rank wrote there
        are zeroed (the rest are zero already)."""
        assert 0 < slot < self.num_slots and rows.rank <= self.max_rank, (slot, rows.rank)
        r, stale = rows.rank, self._ranks.get(slot, 0)
        self._views.clear()  # no other reference: the writes below update in place
        self.lora_a[slot, :r] = rows.a
        self.lora_b[slot, :r] = rows.b
        if stale > r:
            self.lora_a[slot, r:stale] = 0.0
            self.lora_b[slot, r:stale] = 0.0
        self.lora_scale[slot] = rows.scale
        self._ranks[slot] = rows.rank
        self._rank = max(self._ranks.values())

    def zero_rows(self, slot: int) -> None:
        """Zero ``slot`` so that it adds nothing."""
        if slot not in self._ranks:
            return
        self._views.clear()
        self.lora_a[slot] = mx.zeros(self.lora_a.shape[1:], dtype=self.dtype)
        self.lora_b[slot] = mx.zeros(self.lora_b.shape[1:], dtype=self.dtype)
        self.lora_scale[slot] = 0.0
        del self._ranks[slot]
        self._rank = max(self._ranks.values(), default=0)

    def _slot_view(self, slot: int) -> tuple[mx.array, mx.array]:
        """(A [in, r], B [r, out]) of one slot, at its own rank."""
        view = self._views.get(slot)
        if view is None:
            r = self._ranks[slot]
            view = self._views[slot] = (self.lora_a[slot, :r].T, self.lora_b[slot, :r])
        return view

    def _pack_view(self) -> tuple[mx.array, mx.array]:
        """(A [S, in, r], B [S, r, out]) of every slot, at the largest rank."""
        view = self._views.get("all")
        if view is None:
            r = self._rank
            view = self._views["all"] = (self.lora_a[:, :r].swapaxes(1, 2), self.lora_b[:, :r])
        return view

    def __call__(self, x: mx.array) -> mx.array:
        route = self._routing
        if route.single_slot is not None:
            slot = route.single_slot
            if slot not in self._ranks:
                return self.base(x)  # base model only, or an adapter that skips this layer
            add = lambda y: self._add_single(y, x, slot, route.row_scale)  # noqa: E731
        elif self._ranks.keys().isdisjoint(route.slots):
            return self.base(x)
        else:
            add = lambda y: self._add_mixed(y, x, route)  # noqa: E731
        if self._sharding.kind != "row":
            return add(self.base(x))  # [B, L, out]
        # Row-sharded base: each rank adds its partial delta to its partial
        # product, so that one all-sum carries base and delta together.
        y = mx.distributed.all_sum(add(self._partial_base(x)), group=self.base.group)
        return y + self.base["bias"] if "bias" in self.base else y

    def _partial_base(self, x: mx.array) -> mx.array:
        """x @ W^T of this rank's input part, before the all-sum and the bias."""
        b = self.base
        if hasattr(b, "bits"):
            return mx.quantized_matmul(x, b["weight"], scales=b["scales"], biases=b.get("biases"),
                                       transpose=True, group_size=b.group_size, bits=b.bits, mode=b.mode)
        return x @ b["weight"].T

    def _add_single(self, y: mx.array, x: mx.array, slot: int, row_scale: mx.array | None) -> mx.array:
        a, b = self._slot_view(slot)
        z = _cast(x, a.dtype) @ a  # [B, L, r]
        if row_scale is not None:
            z = z * row_scale
        if y.dtype == b.dtype:
            return mx.addmm(y, z, b)  # y + z @ b in one op
        return y + (z @ b).astype(y.dtype)

    def _add_mixed(self, y: mx.array, x: mx.array, route: LoRARouting) -> mx.array:
        a, b = self._pack_view()
        x = _cast(x, a.dtype)
        if route.order is not None:
            xs = x[route.order]  # [B, L, in], rows grouped by slot
            idx = route.sorted_idx
            z = mx.gather_mm(xs, a, rhs_indices=idx, sorted_indices=True)  # [B, L, r]
            if route.row_scale is not None:
                z = z * route.row_scale[route.order]
            z = mx.gather_mm(z, b, rhs_indices=idx, sorted_indices=True)  # [B, L, out]
            z = z[route.inv_order]
        else:
            idx = route.idx
            z = mx.gather_mm(x, a, rhs_indices=idx)  # [B, L, r]
            if route.row_scale is not None:
                z = z * route.row_scale
            z = mx.gather_mm(z, b, rhs_indices=idx)  # [B, L, out]
        return y + _cast(z, y.dtype)


def _cast(x: mx.array, dtype: mx.Dtype) -> mx.array:
    return x if x.dtype == dtype else x.astype(dtype)
