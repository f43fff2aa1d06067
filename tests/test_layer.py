"""MultiLoRALinear against a naive per-row loop (mola/lora/layer.py)."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest

from mola.lora.layer import MultiLoRALinear
from mola.lora.routing import LoRARouting

IN, OUT = 64, 48


def make_layer(base, num_slots=5, max_rank=16, sort_threshold=1000):
    routing = LoRARouting(sort_threshold=sort_threshold)
    return MultiLoRALinear.from_base(base, routing, num_slots=num_slots, max_rank=max_rank), routing


def fill(layer, ranks: dict[int, int], seed=0):
    """Write random factors into the given slots; returns slot -> (a, b, scale)."""
    mx.random.seed(seed)
    written = {}
    for slot, r in ranks.items():
        a = mx.random.normal((layer.input_dims, r)) * 0.3
        b = mx.random.normal((r, layer.output_dims)) * 0.3
        scale = 0.5 + slot
        layer.set_factors(slot, a, b, scale)
        written[slot] = (a, b, scale)
    mx.eval(layer.parameters())
    return written


def naive(base, x, slots, written, row_scale=None):
    """Row by row: base(x_i) + scale * (x_i @ a) @ b for that row's slot."""
    rows = []
    for i, slot in enumerate(slots):
        y = base(x[i])
        if slot in written:
            a, b, scale = written[slot]
            s = scale * (1.0 if row_scale is None else row_scale[i])
            y = y + s * ((x[i] @ a) @ b)
        rows.append(y)
    return mx.stack(rows)


def close(a, b, tol=1e-4):
    return mx.allclose(a, b, atol=tol, rtol=tol).item()


@pytest.mark.parametrize("L", [1, 7], ids=["decode", "prefill"])
@pytest.mark.parametrize("sorted_path", [False, True], ids=["unsorted", "sorted"])
def test_mixed_slots_match_naive_loop(L, sorted_path):
    base = nn.Linear(IN, OUT)
    layer, routing = make_layer(base, sort_threshold=1 if sorted_path else 1000)
    written = fill(layer, {1: 4, 2: 16, 3: 2})  # ranks below max are zero-padded
    slots = [0, 3, 1, 2, 2, 0, 1, 3, 2]
    x = mx.random.normal((len(slots), L, IN))
    routing.set(slots)
    assert (routing.order is not None) == sorted_path
    assert close(layer(x), naive(base, x, slots, written))


def test_default_sorts_only_where_gather_mm_uses_the_order():
    """MLX's CPU gather_mm runs one GEMM per row whatever the order, so on the
    CPU a mixed batch is never sorted; on a GPU, from SORT_THRESHOLD rows."""
    routing = LoRARouting()
    routing.set([1 + i % 8 for i in range(64)])
    assert (routing.order is not None) == (mx.default_device() == mx.gpu)


def test_per_row_scales():
    base = nn.Linear(IN, OUT)
    layer, routing = make_layer(base)
    written = fill(layer, {1: 8, 2: 8})
    slots, scales = [1, 1, 2, 0], [0.0, 0.5, 2.0, 1.0]
    x = mx.random.normal((4, 3, IN))
    routing.set(slots, scales)
    assert close(layer(x), naive(base, x, slots, written, scales))
    # Same slot on every row, rows scaled differently: the single-slot path.
    routing.set([1, 1, 1], [0.0, 1.0, 3.0])
    assert routing.single_slot == 1
    assert close(layer(x[:3]), naive(base, x[:3], [1, 1, 1], written, [0.0, 1.0, 3.0]))


def test_fast_paths_equal_general_path():
    base = nn.Linear(IN, OUT)
    layer, routing = make_layer(base)
    written = fill(layer, {1: 8, 2: 4})
    x = mx.random.normal((6, 2, IN))
    # Every row on slot 0: exactly the base output.
    routing.set([0] * 6)
    assert routing.single_slot == 0
    assert mx.array_equal(layer(x), base(x)).item()
    # Every row on one slot: plain matmuls, equal to the gather_mm path.
    routing.set([2] * 6)
    single = layer(x)
    routing.single_slot = None  # force the general path on the same rows
    routing.idx = mx.array([2] * 6, dtype=mx.uint32)
    routing.slots = frozenset({2})
    general = layer(x)
    assert close(single, general)
    assert close(single, naive(base, x, [2] * 6, written))


def test_subset_layers_and_cleared_slots_add_nothing():
    base = nn.Linear(IN, OUT)
    layer, routing = make_layer(base)
    written = fill(layer, {1: 8, 2: 8})
    x = mx.random.normal((3, 1, IN))
    # A slot never written in this layer (an adapter that skips it): base only.
    routing.set([3, 3, 3])
    assert mx.array_equal(layer(x), base(x)).item()
    layer.zero_rows(2)
    assert mx.array_equal(layer.lora_a[2], mx.zeros_like(layer.lora_a[2])).item()
    assert mx.array_equal(layer.lora_b[2], mx.zeros_like(layer.lora_b[2])).item()
    routing.set([2, 1, 0])
    del written[2]
    assert close(layer(x), naive(base, x, [2, 1, 0], written))


def test_quantized_base():
    dense = nn.Linear(IN, OUT, bias=False)
    base = nn.QuantizedLinear.from_linear(dense, group_size=32, bits=4)
    layer, routing = make_layer(base)
    assert (layer.input_dims, layer.output_dims) == (IN, OUT)
    written = fill(layer, {1: 4, 4: 16})
    slots = [4, 0, 1, 4]
    x = mx.random.normal((4, 5, IN))
    routing.set(slots)
    assert close(layer(x), naive(base, x, slots, written))


def test_packs_take_the_base_compute_dtype():
    lin = nn.Linear(IN, OUT)
    lin.set_dtype(mx.bfloat16)
    layer, routing = make_layer(lin)
    assert layer.lora_a.dtype == mx.bfloat16
    layer.set_factors(1, mx.ones((IN, 2)), mx.ones((2, OUT)), 1.0)
    assert layer.lora_a.dtype == mx.bfloat16
    routing.set([1])
    assert layer(mx.ones((1, 1, IN), dtype=mx.bfloat16)).dtype == mx.bfloat16
