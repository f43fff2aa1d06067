"""mola's multi-LoRA layer on a diffusion transformer.

:class:`DiffusionLoRALinear` is mola.lora.layer's MultiLoRALinear (same packs,
same slot writes, same LoRARouting, same ``gather_mm`` per row) with two
differences, each for a reason the text layer does not have:

* Inputs of two dimensions. FLUX.2 feeds its timestep embedding, [B, C], to six
  target linears (time_guidance_embed.linear_1/2, the three modulations,
  norm_out.linear); MultiLoRALinear takes [B, L, in] (its ``gather_mm`` maps rows
  by the leading axis, its row scale is [B, 1, 1]). Such an input runs as
  [B, 1, in] and comes back as [B, out].
* Where the row scale multiplies. MultiLoRALinear scales the rank-r activations
  between its two matmuls, ``((x @ A) * s) @ B``; mflux's LoRALinear scales the
  product, ``s * ((x @ A) @ B)``. In exact arithmetic they agree; in floating
  point only when s is a power of two. An image must be what mflux makes with
  that LoRA (docs/images.md, "Exactness"), so here the scale comes last, as in
  mflux 0.24.0's ``LoRALinear.__call__``, and a row's delta is added to its base
  output bit for bit as mflux adds it.

Images never shard the base and batch few rows, so the tensor-parallel and
sorted-row paths of the text layer are not used: the routing is made with
``sort_threshold=None``.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from ..lora.geometry import compute_dtype, linear_dims
from ..lora.layer import MultiLoRALinear
from ..lora.routing import LoRARouting


class DiffusionLoRALinear(MultiLoRALinear):
    """A base linear plus slot-indexed LoRA packs, routed per row, scaled as mflux scales."""

    @staticmethod
    def wrap(linear: nn.Linear, routing: LoRARouting, num_slots: int, max_rank: int) -> DiffusionLoRALinear:
        if type(linear) is not nn.Linear:  # what every FLUX.2 target is (quantized bases: not yet)
            raise TypeError(f"Cannot wrap {type(linear).__name__}: an image LoRA target must be an nn.Linear")
        input_dims, output_dims = linear_dims(linear)
        return DiffusionLoRALinear(linear, routing, input_dims, output_dims, num_slots, max_rank,
                                   compute_dtype(linear))

    def __call__(self, x: mx.array) -> mx.array:
        if x.ndim == 2:  # [B, in]: a timestep embedding
            return self(x[:, None, :])[:, 0, :]
        route = self._routing
        if route.single_slot is not None:
            if route.single_slot not in self._ranks:
                return self.base(x)  # base only, or an adapter that skips this layer
            a, b = self._slot_view(route.single_slot)  # [in, r], [r, out]
            delta = (x @ a) @ b  # [B, L, out]
        elif self._ranks.keys().isdisjoint(route.slots):
            return self.base(x)
        else:
            a, b = self._pack_view()  # [S, in, r], [S, r, out]
            z = mx.gather_mm(x, a, rhs_indices=route.idx)  # [B, L, r]
            delta = mx.gather_mm(z, b, rhs_indices=route.idx)  # [B, L, out]
        if route.row_scale is not None:  # [B, 1, 1], cast as mflux's Python-float scale is
            delta = route.row_scale.astype(delta.dtype) * delta
        return self.base(x) + delta
