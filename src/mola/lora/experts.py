"""LoRA on the experts of a mixture of experts: the multi-LoRA twin of
mlx-lm's SwitchGLU (``mlx_lm.models.switch_layers``).

A token of row i, on slot s, routed to expert e by the router, gets from each
expert projection (gate, up, down)

    scale[s] * (x @ A[s, e]) @ B[s, e]

on top of the base expert's output. All (slot, expert) pairs of a projection
live in one pack, ``lora_a`` [E * S, r, in] (A^T) and ``lora_b`` [E * S, r, out]
(scale * B), at index ``e * S + (s - 1)``: one ``gather_mm`` per factor serves the
whole batch with one combined index per (token, chosen expert), as mlx-lm's
LoRASwitchLinear does with the expert index alone. Expert-major order keeps
the combined index sorted whenever the tokens are sorted by it, which sorts
them by expert too: the base's ``sorted_indices`` path and the LoRA's are one
sort (mlx-lm sorts once 64 or more (token, expert) pairs come, and so do we).

Expert slots are fewer than dense ones (an expert slot weighs E times a dense
one): slots 1..S of the adapter slots can carry expert LoRA. There is no
empty expert slot (it would weigh as much as a full one): in a mixed batch a
row on another slot reads pack index 0 with a scale of 0. A batch in which no
row uses an expert slot that this layer has written runs the base SwitchGLU
alone.

Like the dense packs (mola.lora.layer), an expert pack's rank is the largest
rank written into it, rounded up to a power of two (at most the ceiling,
--max-expert-lora-rank), and 0 (no bytes) until an adapter with expert LoRA
on this projection is written; its slot count stays ``expert_slots`` (few,
and the combined index needs it fixed).
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.switch_layers import QuantizedSwitchLinear, SwitchGLU, SwitchLinear

from .geometry import SizedPacks, TargetGeometry, bucket, compute_dtype, resized

EXPERT_BASES = (SwitchLinear, QuantizedSwitchLinear)
SORT_PAIRS = 64  # mlx-lm's SwitchGLU sorts (token, expert) pairs from this many on


def expert_dims(linear: nn.Module) -> tuple[int, int, int]:
    """(num_experts, input_dims, output_dims) of a SwitchLinear, plain or quantized."""
    return linear.num_experts, linear.input_dims, linear.output_dims


@dataclass(frozen=True)
class ExpertRoute:
    """Where each (token, chosen expert) pair of one SwitchGLU call reads its
    LoRA, in the order the projections see the pairs."""

    idx: mx.array  # combined e * S + (s - 1), shaped as the projections' expert indices
    row_scale: mx.array | None  # per pair: its row's row_scale, 0 off the expert slots; None: all 1


class MultiLoRASwitchLinear(SizedPacks, nn.Module):
    """One SwitchLinear (plain or quantized) plus (expert, slot)-indexed LoRA packs."""

    def __init__(self, base: nn.Module, num_slots: int, max_rank: int, dtype: mx.Dtype):
        super().__init__()
        self.base = base
        self.num_experts, self.input_dims, self.output_dims = expert_dims(base)
        self.max_rank = max_rank  # the ceiling; the packs' own rank is rank_capacity
        n = self.num_experts * num_slots
        self.lora_a = mx.zeros((n, 0, self.input_dims), dtype=dtype)  # [E*S, R, in]: A^T (R = 0: no pack)
        self.lora_b = mx.zeros((n, 0, self.output_dims), dtype=dtype)  # [E*S, R, out]: scale*B
        self._num_slots = num_slots
        self._ranks: dict[int, int] = {}  # slot -> rank written here
        self._rank = 0  # max rank over written slots: the part of r the forward uses
        self._view: tuple[mx.array, mx.array] | None = None  # (A [E*S, in, r], B [E*S, r, out])

    @property
    def num_slots(self) -> int:
        return self._num_slots

    def resize(self, rank: int) -> None:
        """Reallocate the packs at ``rank``, keeping every written slot (which must fit)."""
        if rank == self.rank_capacity:
            return
        assert all(r <= rank for r in self._ranks.values()), (rank, self._ranks)
        self._view = None
        self.lora_a = resized(self.lora_a, self.lora_a.shape[0], rank)
        self.lora_b = resized(self.lora_b, self.lora_b.shape[0], rank)

    _resize_rank = resize  # (SizedPacks.shrink)

    @property
    def geometry(self) -> TargetGeometry:
        """What an adapter's expert factors for this projection must fit."""
        return TargetGeometry(self.input_dims, self.output_dims, num_experts=self.num_experts)

    def set_rows(self, slot: int, rows) -> None:
        """Write expert rows (a [E, r, in], b [E, r, out], see
        :func:`mola.lora.geometry.module_rows`) into ``slot``."""
        assert 0 < slot <= self.num_slots and rows.rank <= self.max_rank, (slot, rows.rank)
        r, stale, S, i = rows.rank, self._ranks.get(slot, 0), self.num_slots, slot - 1
        if r > self.rank_capacity:
            self.resize(bucket(r, self.max_rank))
        self._view = None  # no other reference: the writes below update in place
        self.lora_a[i::S, :r] = rows.a
        self.lora_b[i::S, :r] = rows.b
        if stale > r:
            self.lora_a[i::S, r:stale] = 0.0
            self.lora_b[i::S, r:stale] = 0.0
        self._ranks[slot] = r
        self._rank = max(self._ranks.values())

    def zero_rows(self, slot: int) -> None:
        if slot not in self._ranks:
            return
        self._view = None
        S = self.num_slots
        self.lora_a[slot - 1::S] = 0.0
        self.lora_b[slot - 1::S] = 0.0
        del self._ranks[slot]
        self._rank = max(self._ranks.values(), default=0)

    def factors(self, slot: int) -> tuple[mx.array, mx.array]:
        """(A [E, in, r], scale * B [E, r, out]) stored in ``slot``."""
        r, S = self._ranks.get(slot, 0), self.num_slots
        return self.lora_a[slot - 1::S, :r].swapaxes(1, 2), self.lora_b[slot - 1::S, :r]

    def _pack_view(self) -> tuple[mx.array, mx.array]:
        if self._view is None:
            r = self._rank
            self._view = (self.lora_a[:, :r].swapaxes(1, 2), self.lora_b[:, :r])
        return self._view

    def __call__(self, x: mx.array, indices: mx.array, sorted_indices: bool = False,
                 route: ExpertRoute | None = None) -> mx.array:
        y = self.base(x, indices, sorted_indices=sorted_indices)  # [..., 1, out]
        if route is None or self._rank == 0:
            return y
        a, b = self._pack_view()
        z = mx.gather_mm(_cast(x, a.dtype), a, rhs_indices=route.idx, sorted_indices=sorted_indices)  # [..., 1, r]
        if route.row_scale is not None:
            z = z * route.row_scale
        z = mx.gather_mm(z, b, rhs_indices=route.idx, sorted_indices=sorted_indices)  # [..., 1, out]
        return y + _cast(z, y.dtype)


class MultiLoRASwitchGLU(nn.Module):
    """mlx-lm's SwitchGLU with each expert projection wrapped, routed per row
    through the shared LoRARouting (its ``expert_slot`` / ``expert_idx`` and
    ``expert_scale``)."""

    @staticmethod
    def from_base(glu: SwitchGLU, routing, num_slots: int, max_rank: int) -> "MultiLoRASwitchGLU":
        dtype = compute_dtype(glu.gate_proj)
        layer = MultiLoRASwitchGLU(routing, glu.activation)
        for name in ("gate_proj", "up_proj", "down_proj"):
            setattr(layer, name, MultiLoRASwitchLinear(getattr(glu, name), num_slots, max_rank, dtype))
        return layer

    def __init__(self, routing, activation: nn.Module):
        super().__init__()
        self._routing = routing
        self.activation = activation

    def projections(self) -> list[tuple[str, MultiLoRASwitchLinear]]:
        return [("gate_proj", self.gate_proj), ("up_proj", self.up_proj), ("down_proj", self.down_proj)]

    def _is_used(self) -> bool:
        """Does any row of the coming pass use an expert slot written here?"""
        used = self._routing.expert_slots_used
        return any(not p.active_slots.isdisjoint(used) for _, p in self.projections())

    def __call__(self, x: mx.array, indices: mx.array) -> mx.array:
        x = mx.expand_dims(x, (-2, -3))  # [B, L, 1, 1, D]
        indices = mx.stop_gradient(indices)  # [B, L, k]
        do_sort = indices.size >= SORT_PAIRS
        route = self._route(indices) if self._is_used() else None
        idx, inv_order = indices, None
        if do_sort:
            # Sort by the combined index when there is LoRA (expert-major, so
            # by expert too), by expert alone otherwise, as mlx-lm does.
            key = (route.idx if route is not None else indices).flatten()
            order = mx.argsort(key)  # [B*L*k]
            inv_order = mx.argsort(order)
            x = x.flatten(0, -3)[order // indices.shape[-1]]  # [B*L*k, 1, D]
            idx = indices.flatten()[order]
            if route is not None:
                row_scale = route.row_scale
                if row_scale is not None:  # [B, 1, 1, 1, 1] -> one per pair, [N, 1, 1]
                    row_scale = mx.broadcast_to(row_scale[..., 0, 0], indices.shape).flatten()[order][:, None, None]
                route = ExpertRoute(key[order], row_scale)
        up = self.up_proj(x, idx, do_sort, route)
        gate = self.gate_proj(x, idx, do_sort, route)
        x = self.down_proj(self.activation(up, gate), idx, do_sort, route)
        if do_sort:
            x = mx.unflatten(x[inv_order], 0, indices.shape)
        return x.squeeze(-2)  # [B, L, k, D]

    def _route(self, indices: mx.array) -> ExpertRoute:
        """The combined index e * S + (s - 1) of every (token, expert) pair."""
        r = self._routing
        S = self.gate_proj.num_slots
        local = r.expert_slot if r.expert_slot is not None else r.expert_idx  # int, or [B, 1, 1]
        row_scale = r.expert_scale[..., None, None] if r.expert_scale is not None else None  # [B, 1, 1, 1, 1]
        return ExpertRoute(indices * S + local, row_scale)  # [B, L, k]


def _cast(x: mx.array, dtype: mx.Dtype) -> mx.array:
    return x if x.dtype == dtype else x.astype(dtype)
