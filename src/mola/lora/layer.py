"""The multi-LoRA linear layer.

One forward pass carries rows for many adapters at once. The runner tells all
layers which row uses which slot through one shared
:class:`mola.lora.routing.LoRARouting`; each :class:`MultiLoRALinear` then adds

    scale[idx] * gather_mm(gather_mm(x, A, idx), B, idx)

to its base output, where ``A`` [S, in, r] and ``B`` [S, r, out] are the
slot-indexed packs and slot 0 means "no adapter" (all zeros).

Two storage choices keep that cheap. ``A`` is kept transposed, ``lora_a`` of
shape [S, r_max, in], so that the slice of the rank actually in use,
``lora_a[:, :r]``, stays contiguous per slot and ``gather_mm`` reads it in
place (slicing [S, in, r_max] on its last axis made MLX copy the pack on every
call). And each slot's scale is folded into its ``B`` when it is written
(``lora_b[s] = scale[s] * B_s``), which is the same product with one
multiplication fewer per layer; ``folded_scale`` keeps the scales for reading.

The packs are sized to what is loaded, not to the ceilings: their rank is the
largest rank written into this layer, rounded up to a power of two (at most
``max_rank``, --max-lora-rank), and it is 0 (no bytes) until an adapter
targeting this layer is written; their slot count is the one
mola.lora.pack.AdapterPacks gives every layer. A resize copies the slots
into zero-padded packs, which changes no sum (the forward reads ranks up to
the largest written either way).
How a base linear is cut across a tensor-parallel group, and the rows a slot
stores, are mola.lora.geometry. A slot written with a DoRA adapter also scales
its rows' outputs by its magnitude scale (mola.lora.dora).
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from .dora import MagnitudeScales, magnitude_scale
from .geometry import (WRAPPABLE, ModuleRows, Sharding, SizedPacks, TargetGeometry, bucket, compute_dtype,
                       full_dims, linear_dims, module_rows, resized, sharding_of)
from .routing import LoRARouting


class MultiLoRALinear(SizedPacks, nn.Module):
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
        self.max_rank = max_rank  # the ceiling (--max-lora-rank); the packs' own rank is rank_capacity
        self.max_slots = num_slots  # the ceiling, slot 0 included; the packs' own count is slot_capacity
        self.lora_a = mx.zeros((num_slots, 0, input_dims), dtype=dtype)  # [S, R, in]: A^T (R = 0: no pack)
        self.lora_b = mx.zeros((num_slots, 0, output_dims), dtype=dtype)  # [S, R, out]: scale * B
        self._routing = routing
        self._sharding = Sharding()  # this layer's part of a tensor-parallel base
        self._ranks: dict[int, int] = {}  # slot -> rank written in this layer
        self._scales: dict[int, float] = {}  # slot -> the scale folded into its B
        self._rank = 0  # max rank over written slots: the part of r the forward uses
        # Views of the packs the forward reads, made once per write: with them
        # a decode step runs two matmuls per layer and adapter, no slicing ops.
        # Dropped before every write, so that the write can update in place.
        self._views: dict = {}
        self.dora = MagnitudeScales(output_dims)  # g [S, out] of DoRA slots (none until one is written)

    @property
    def num_slots(self) -> int:
        return self.max_slots

    @property
    def slot_capacity(self) -> int:
        """Slots the packs hold now (every written slot is below it)."""
        return self.lora_a.shape[0]

    @property
    def nbytes(self) -> int:
        return self.lora_a.nbytes + self.lora_b.nbytes + self.dora.nbytes

    @property
    def folded_scale(self) -> dict[int, float]:
        """Slot -> the scale folded into its B (written slots only)."""
        return dict(self._scales)

    @property
    def full_dims(self) -> tuple[int, int]:
        """(input_dims, output_dims) of the whole linear: what an adapter's
        factors must fit, whatever this rank holds of them."""
        return full_dims(self.base)

    def resize(self, num_slots: int, rank: int) -> None:
        """Reallocate the packs as [num_slots, rank], keeping every written
        slot (which must fit). Engine thread, between two steps."""
        if (num_slots, rank) == self.lora_a.shape[:2]:
            return
        assert all(s < num_slots and r <= rank for s, r in self._ranks.items()), (num_slots, rank, self._ranks)
        self._views.clear()
        self.lora_a = resized(self.lora_a, num_slots, rank)
        self.lora_b = resized(self.lora_b, num_slots, rank)
        self.dora.resize(num_slots)

    def _resize_rank(self, rank: int) -> None:  # (SizedPacks.shrink)
        self.resize(self.slot_capacity, rank)

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
        rows, the packs' rank grown first if r exceeds it; rows beyond r that
        an older adapter of higher rank wrote there are zeroed (the rest are
        zero already)."""
        assert 0 < slot < self.slot_capacity and rows.rank <= self.max_rank, (slot, rows.rank)
        r, stale = rows.rank, self._ranks.get(slot, 0)
        if r > self.rank_capacity:
            self.resize(self.slot_capacity, bucket(r, self.max_rank))
        self._views.clear()  # no other reference: the writes below update in place
        self.lora_a[slot, :r] = rows.a
        self.lora_b[slot, :r] = rows.b
        if stale > r:
            self.lora_a[slot, r:stale] = 0.0
            self.lora_b[slot, r:stale] = 0.0
        if rows.magnitude is not None:  # DoRA: its g, made off this thread when the geometry had the bases
            assert self._sharding.kind == "none", "DoRA on a tensor-parallel base is refused when read"
            g = rows.dora_scale
            if g is None:
                g = magnitude_scale(self.base, rows.a, rows.b, rows.magnitude)  # [out]
            self.dora.write(slot, g, self.slot_capacity, self.dtype)
        else:
            self.dora.clear(slot)
        self._scales[slot] = rows.folded_scale
        self._ranks[slot] = rows.rank
        self._rank = max(self._ranks.values())

    def zero_rows(self, slot: int) -> None:
        """Zero ``slot`` so that it adds nothing (the packs keep their size:
        :meth:`shrink` gives memory back)."""
        if slot not in self._ranks:
            return
        self._views.clear()
        self.lora_a[slot] = 0.0
        self.lora_b[slot] = 0.0
        self.dora.clear(slot)
        del self._ranks[slot], self._scales[slot]
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
            y = add(self.base(x))  # [B, L, out]
            return self.dora.apply(y, route, self.base) if self.dora.is_used(route) else y
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
