"""mola/lora/experts.py: the expert twin of the multi-LoRA layer, against a
naive loop over tokens and their chosen experts."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.switch_layers import SwitchGLU

from mola.lora.experts import MultiLoRASwitchGLU
from mola.lora.geometry import ModuleRows
from mola.lora.routing import LoRARouting

E, D, H, K = 6, 16, 12, 2  # experts, hidden, expert width, experts per token
SLOTS = 2  # adapter slots 1..2 carry expert LoRA


def glu(seed=0):
    mx.random.seed(seed)
    g = SwitchGLU(D, H, E)
    mx.eval(g.parameters())
    return g


def rows(rng, rank, in_dims, out_dims, scale):
    a = rng.normal(0, 0.3, (E, in_dims, rank)).astype(np.float32)  # [E, in, r]
    b = rng.normal(0, 0.3, (E, rank, out_dims)).astype(np.float32)  # [E, r, out]
    return (a, b, scale), ModuleRows(mx.array(a).swapaxes(1, 2), mx.array(scale * b), rank, scale)


def naive(base: SwitchGLU, x, idx, slot_of_row, row_scale, factors):
    """One token and expert at a time: base expert plus scale * x A B for the
    row's slot, in numpy."""
    w = {n: np.array(getattr(base, n).weight) for n in ("gate_proj", "up_proj", "down_proj")}  # [E, out, in]
    x, idx = np.array(x), np.array(idx)
    B, L, _ = x.shape
    out = np.zeros((B, L, K, D), np.float32)

    def proj(name, v, e, slot, rs):
        y = w[name][e] @ v
        f = factors.get((slot, name))
        if f is not None:
            a, b, scale = f
            y = y + rs * scale * (v @ a[e]) @ b[e]
        return y

    for i in range(B):
        for t in range(L):
            for j in range(K):
                e, s, rs = idx[i, t, j], slot_of_row[i], row_scale[i]
                up, gate = proj("up_proj", x[i, t], e, s, rs), proj("gate_proj", x[i, t], e, s, rs)
                act = gate / (1 + np.exp(-gate)) * up  # SwiGLU
                out[i, t, j] = proj("down_proj", act, e, s, rs)
    return out


@pytest.mark.parametrize("length", [1, 20])  # 20 tokens x 4 rows x 2 experts >= 64: the sorted path
@pytest.mark.parametrize("scaled", [False, True])
def test_mixed_slots_equal_a_naive_loop(length, scaled):
    rng = np.random.default_rng(0)
    base = glu()
    routing = LoRARouting(expert_slots=SLOTS)
    layer = MultiLoRASwitchGLU.from_base(base, routing, num_slots=SLOTS, max_rank=8)
    factors = {}
    # Slot 1: every projection at rank 8; slot 2: down_proj only at rank 3.
    for name in ("gate_proj", "up_proj", "down_proj"):
        p = getattr(layer, name)
        f, r = rows(rng, 8, p.input_dims, p.output_dims, 2.0)
        p.set_rows(1, r)
        factors[(1, name)] = f
    f, r = rows(rng, 3, H, D, 0.5)
    layer.down_proj.set_rows(2, r)
    factors[(2, "down_proj")] = f
    slots = [1, 0, 2, 5]  # slot 5 has no expert slot: base experts only
    scales = [0.5, 1.0, 2.0, 3.0] if scaled else None
    routing.set(slots, scales)
    x = mx.array(rng.normal(0, 1, (4, length, D)).astype(np.float32))
    idx = mx.array(rng.integers(0, E, (4, length, K)).astype(np.uint32))
    got = layer(x, idx)
    want = naive(base, x, idx, [s if s <= SLOTS else 0 for s in slots], scales or [1.0] * 4, factors)
    np.testing.assert_allclose(np.array(got), want, rtol=1e-4, atol=1e-4)


def test_unused_slots_run_the_base_alone_and_rewrites_clear_stale_rank():
    rng = np.random.default_rng(1)
    base = glu(1)
    routing = LoRARouting(expert_slots=SLOTS)
    layer = MultiLoRASwitchGLU.from_base(base, routing, num_slots=SLOTS, max_rank=8)
    x = mx.array(rng.normal(0, 1, (2, 3, D)).astype(np.float32))
    idx = mx.array(rng.integers(0, E, (2, 3, K)).astype(np.uint32))
    plain = np.array(base(x, idx))
    f8, r8 = rows(rng, 8, D, H, 1.0)
    layer.up_proj.set_rows(1, r8)
    routing.set([0, 3])  # neither row on slot 1 (slot 3 carries no expert LoRA)
    np.testing.assert_array_equal(np.array(layer(x, idx)), plain)
    f2, r2 = rows(rng, 2, D, H, 1.0)
    layer.up_proj.set_rows(1, r2)  # a lower rank over the rank-8 rows
    routing.set([1, 1])
    want = naive(base, x, idx, [1, 1], [1.0, 1.0], {(1, "up_proj"): f2})
    np.testing.assert_allclose(np.array(layer(x, idx)), want, rtol=1e-4, atol=1e-4)
    a, b = layer.up_proj.factors(1)
    assert a.shape == (E, D, 2) and b.shape == (E, 2, H)
    layer.up_proj.zero_rows(1)
    assert not np.array(layer.up_proj.lora_a).any() and layer.up_proj.active_slots == frozenset()
    np.testing.assert_array_equal(np.array(layer(x, idx)), plain)
