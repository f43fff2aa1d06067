"""The geometry of a linear that can carry LoRA: which base layers mola wraps,
their whole dimensions and how a tensor-parallel rank holds them (sharding),
and the rows one slot of one layer stores for an adapter (cut to this rank's
part). Pure functions of shapes and arrays: any thread may call them.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
import mlx.nn.layers.distributed as dist
import numpy as np

# Base layers mola can wrap: plain, quantized, and tensor-parallel shards
# (mlx.nn.layers.distributed, as mlx-lm's model.shard() makes them).
COLUMN_SHARDED = (dist.AllToShardedLinear, dist.QuantizedAllToShardedLinear)  # output split
ROW_SHARDED = (dist.ShardedToAllLinear, dist.QuantizedShardedToAllLinear)  # input split, all-sum
WRAPPABLE = (nn.Linear, nn.QuantizedLinear, *COLUMN_SHARDED, *ROW_SHARDED)
_HOST = {mx.float32: np.float32, mx.float16: np.float16}  # dtypes module_rows computes with numpy


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
    folded_scale: float  # the scale folded into b (kept for reading)
    magnitude: mx.array | None = None  # [out_part] float32: a DoRA adapter's m (mola.lora.dora); None: LoRA
    dora_scale: mx.array | None = None  # [out_part] its g = m / ||W + s B A||, when computed before the write

    @property
    def nbytes(self) -> int:
        return sum(x.nbytes for x in (self.a, self.b, self.magnitude, self.dora_scale) if x is not None)


def module_rows(target: TargetGeometry, max_rank: int, dtype: mx.Dtype, a: mx.array, b: mx.array,
                scale: float, magnitude: mx.array | None = None) -> ModuleRows:
    """The rows a slot stores for factors a [in, r], b [r, out]: A^T and
    scale * B, cut to this rank's part, at rank r (not padded to ``max_rank``,
    so that rows kept in host memory take only what the adapter needs). For
    experts, a [E, in, r] and b [E, r, out] give A^T [E, r, in] and scale * B
    [E, r, out] (never sharded). Pure: any thread may compute them.

    Float32 and float16 are computed with numpy and handed back evaluated, so
    that the reader thread queues no MLX task behind the engine's steps;
    bfloat16, which numpy lacks, with MLX (the same values either way).
    A DoRA adapter's ``magnitude`` [out] is kept in float32, cut like B's columns."""
    r = a.shape[-1]
    assert r <= max_rank, (r, max_rank)
    if target.num_experts is not None:
        E = target.num_experts
        assert a.shape == (E, target.input_dims, r) and b.shape == (E, r, target.output_dims)
    else:
        assert a.shape == (target.input_dims, r) and b.shape == (r, target.output_dims)
    host = _HOST.get(dtype)
    if host is not None and a.dtype in _HOST and b.dtype in _HOST:
        a, b = np.asarray(a), np.asarray(b)  # evaluated already: views, no copy
    sh = target.sharding
    if sh.kind == "row":  # this rank sees part of the input: its rows of A
        a = a[sh.part(a.shape[0])]
    elif sh.kind == "column":  # this rank makes part of the output: its columns of B
        b = b[:, sh.part(b.shape[1])]
    if magnitude is not None:
        magnitude = mx.array(magnitude, dtype=mx.float32)
        magnitude = magnitude[sh.part(magnitude.shape[0])] if sh.kind == "column" else magnitude  # [out_part]
    if isinstance(a, np.ndarray):
        a_row = np.ascontiguousarray(np.swapaxes(a, -1, -2).astype(host))  # [r, in_part] / [E, r, in]
        b_row = (np.float32(scale) * b.astype(np.float32)).astype(host)  # [r, out_part] / [E, r, out]
        return ModuleRows(mx.array(a_row), mx.array(b_row), r, scale, magnitude)
    a_row = mx.contiguous(a.swapaxes(-1, -2).astype(dtype))  # [r, in_part] / [E, r, in]
    b_row = (scale * b.astype(mx.float32)).astype(dtype)  # [r, out_part] / [E, r, out]
    return ModuleRows(a_row, b_row, r, scale, magnitude)


def bucket(n: int, ceiling: int) -> int:
    """The size a pack dimension takes for a need of ``n``: 0 for 0, else the
    next power of two, never above ``ceiling`` (packs grow and shrink by
    these steps, so that most loads and unloads reallocate nothing)."""
    if n <= 0:
        return 0
    return min(ceiling, 1 << (n - 1).bit_length())


def resized(pack: mx.array, rows: int, rank: int) -> mx.array:
    """``pack`` [N, R, D] reallocated as [rows, rank, D]: what the rows and
    ranks in common hold is kept, the rest is zero. A fresh buffer, never a
    view of the old one (which is freed once nothing reads it)."""
    n, r = min(rows, pack.shape[0]), min(rank, pack.shape[1])
    if (n, r) == pack.shape[:2]:  # growing: one pad writes the new buffer
        return mx.pad(pack, [(0, rows - n), (0, rank - r), (0, 0)])
    out = mx.zeros((rows, rank, pack.shape[2]), dtype=pack.dtype)
    if n and r:
        out[:n, :r] = pack[:n, :r]
    return out



class SizedPacks:
    """What a layer with slot packs sized to what is loaded (MultiLoRALinear,
    MultiLoRASwitchLinear) says of them, and its one rule for giving rank
    back. The layer has ``lora_a``/``lora_b`` [N, R, D], ``max_rank``,
    ``_ranks`` (slot -> rank written) and ``_rank`` (their max), and
    reallocates through ``_resize_rank``."""

    @property
    def rank_needed(self) -> int:
        """The rank the written slots need, in the packs' steps (0: none written)."""
        return bucket(self._rank, self.max_rank)

    @property
    def rank_capacity(self) -> int:
        """The packs' rank now: a power of two (or max_rank) >= every written rank; 0: no pack."""
        return self.lora_a.shape[1]

    @property
    def nbytes(self) -> int:
        return self.lora_a.nbytes + self.lora_b.nbytes

    @property
    def dtype(self) -> mx.Dtype:
        return self.lora_a.dtype

    @property
    def active_slots(self) -> frozenset[int]:
        return frozenset(self._ranks)

    def shrink(self, lazy: bool) -> None:
        """Give back rank no written slot uses: all of it when none does;
        otherwise, when ``lazy``, only once the need fell to a quarter of the
        capacity (so that loads and unloads around one size do not copy the
        packs back and forth), else down to the need's power of two."""
        need, cap = self.rank_needed, self.rank_capacity
        if need < cap and (need == 0 or not lazy or 4 * need <= cap):
            self._resize_rank(need)

    def _resize_rank(self, rank: int) -> None:
        raise NotImplementedError

def compute_dtype(linear: nn.Module) -> mx.Dtype:
    """The dtype the base layer computes in (scales' dtype when quantized)."""
    if hasattr(linear, "scales"):
        return linear.scales.dtype
    return linear.weight.dtype

