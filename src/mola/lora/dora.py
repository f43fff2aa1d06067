"""DoRA in the mixed batch: one magnitude scale per output per slot.

DoRA (mlx-lm's DoRALinear, PEFT's DoRA layer) computes

    y = g * (W x + s B A x) + bias,   g = m / ||W + s B A||  (row-wise: one norm per output)

where m [out] is the adapter's trained magnitude. g depends on the base
weight, the factors and the scale only, never on x: it is computed once per
slot, from the dequantized base weight one layer at a time
(:func:`magnitude_scale`), when the adapter's rows are prepared on the reader
thread (:func:`with_dora_scale`; the slot write computes it only when the
rows come without it), and kept in a pack ``g`` [S, out] beside the layer's
LoRA packs. A mixed batch then multiplies each row by its slot's
``g[idx]``: rows of slot 0, plain LoRA and activated LoRA read g = 1.

The bias stays outside the scale: the base layer adds it before the delta, so
a DoRA row gets ``g * (base(x) + delta) + (1 - g) * bias``. A row with g = 1
gets ``(base(x) + delta) * 1 + 0 * bias``, the same bits as without the
scale; and a batch with no DoRA row does not touch the scale at all.

The pack exists only on layers a written DoRA adapter targets; it has the
slot count of the layer's LoRA packs and is dropped when its last DoRA slot
is cleared (it is [S, out], a sliver beside [S, r, in + out]).
"""

from __future__ import annotations

import dataclasses

import mlx.core as mx
import mlx.nn as nn

from .routing import LoRARouting


def dequantized_weight(base: nn.Module) -> mx.array:
    """The base linear's weight [out, in] as float32 (dequantized when quantized)."""
    w = base["weight"]
    if hasattr(base, "bits"):
        w = mx.dequantize(w, base["scales"], base.get("biases"), group_size=base.group_size, bits=base.bits,
                          mode=base.mode)
    return w.astype(mx.float32)


def magnitude_scale(base: nn.Module, a_t: mx.array, b: mx.array, magnitude: mx.array) -> mx.array:
    """g = m / ||W + s B A|| over each output row, float32 [out]. ``a_t`` [r, in]
    is A^T and ``b`` [r, out] is s * B, as a slot stores them; ``magnitude`` [out].
    (Expanding the squared norm, so as not to make the merged [out, in] weight,
    was no faster on a CPU: both are bound by reading W.)"""
    w = dequantized_weight(base)  # [out, in]
    adapted = w + b.astype(mx.float32).T @ a_t.astype(mx.float32)  # [out, in]
    return magnitude.astype(mx.float32) / mx.linalg.norm(adapted, axis=1)  # [out]


def with_dora_scale(rows, base: nn.Module, dtype: mx.Dtype):
    """ModuleRows (mola.lora.geometry) of a DoRA module with its g [out] in
    ``dtype``, from ``base``, the linear it will be written over (any thread:
    the base's weights never change once loaded)."""
    g = magnitude_scale(base, rows.a, rows.b, rows.magnitude).astype(dtype)
    return dataclasses.replace(rows, dora_scale=g)


class MagnitudeScales:
    """The DoRA scales of one MultiLoRALinear: ``g`` [S, out] (1 on slots
    without DoRA), or None while no DoRA adapter is written in the layer."""

    def __init__(self, output_dims: int):
        self.output_dims = output_dims
        self.g: mx.array | None = None  # [S, out] in the packs' dtype
        self.slots: set[int] = set()  # slots holding DoRA in this layer
        # The rows' g of the last pass, and what it was gathered by (the routing's
        # slot or its idx array, which the runner reuses while the rows stay the
        # same): a decode step then spends one multiply per layer, no gather.
        self._rows: tuple[object, mx.array] | None = None

    @property
    def nbytes(self) -> int:
        return 0 if self.g is None else self.g.nbytes

    def resize(self, num_slots: int) -> None:
        """Follow the LoRA packs' slot count (written slots always fit)."""
        if self.g is None or self.g.shape[0] == num_slots:
            return
        n = min(num_slots, self.g.shape[0])
        g = mx.ones((num_slots, self.output_dims), dtype=self.g.dtype)
        g[:n] = self.g[:n]
        self.g, self._rows = g, None

    def write(self, slot: int, g: mx.array, num_slots: int, dtype: mx.Dtype) -> None:
        """Put ``g`` [out] into ``slot``, making the pack [num_slots, out] first if there is none."""
        if self.g is None:
            self.g = mx.ones((num_slots, self.output_dims), dtype=dtype)
        self.g[slot] = g.astype(dtype)
        self.slots.add(slot)
        self._rows = None

    def clear(self, slot: int) -> None:
        """``slot`` back to g = 1; the pack goes with the last DoRA slot."""
        if slot not in self.slots:
            return
        self.slots.discard(slot)
        self._rows = None
        if self.slots:
            self.g[slot] = 1.0
        else:
            self.g = None

    def is_used(self, route: LoRARouting) -> bool:
        """Does the pass routed by ``route`` have a DoRA row in this layer?"""
        if not self.slots:
            return False
        if route.single_slot is not None:
            return route.single_slot in self.slots
        return not self.slots.isdisjoint(route.slots)

    def apply(self, y: mx.array, route: LoRARouting, base: nn.Module) -> mx.array:
        """``y`` [B, L, out] = base(x) + delta, each row scaled by its slot's g
        with the base's bias kept out of the scale."""
        key = route.single_slot if route.single_slot is not None else route.idx
        if self._rows is None or self._rows[0] is not key:
            if route.single_slot is not None:
                g = self.g[route.single_slot]  # [out]
            else:
                g = self.g[route.idx][:, None, :]  # [B, 1, out]
            self._rows = (key, g)
        g = self._rows[1]
        g = g if g.dtype == y.dtype else g.astype(y.dtype)
        out = y * g
        if "bias" in base:
            out = out + (1 - g) * base["bias"].astype(y.dtype)
        return out
