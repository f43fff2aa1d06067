"""The DoRA scale of MultiLoRALinear (mola/lora/dora.py): a DoRA slot's rows
are the formula y = m / ||W + s B A|| * (W x + s B A x) + bias computed with
numpy on the merged weight, alone and in a mixed batch; the other rows of the
batch are the same bits as when no DoRA adapter is written; and the g pack
exists only while a DoRA slot is written in the layer, following the slots."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from mola.lora.dora import magnitude_scale
from mola.lora.layer import MultiLoRALinear
from mola.lora.routing import LoRARouting

IN, OUT, R = 64, 40, 4


def factors(seed: int, rank: int = R):
    rng = np.random.default_rng(seed)
    a = rng.normal(0, 1 / np.sqrt(IN), (IN, rank)).astype(np.float32)
    b = rng.normal(0, 0.3, (rank, OUT)).astype(np.float32)
    return a, b


def base_linear(kind: str) -> nn.Module:
    mx.random.seed(7)
    lin = nn.Linear(IN, OUT, bias=kind == "bias")
    if kind == "bias":
        lin.bias = mx.random.normal((OUT,))
    if kind == "q4":
        lin = nn.QuantizedLinear.from_linear(lin, group_size=32, bits=4)
    return lin


def weight_of(lin: nn.Module) -> np.ndarray:
    if isinstance(lin, nn.QuantizedLinear):
        return np.array(mx.dequantize(lin.weight, lin.scales, lin.biases, group_size=32, bits=4))
    return np.array(lin.weight)


def dora_reference(lin, x: np.ndarray, a, b, scale: float, m: np.ndarray) -> np.ndarray:
    """y = (m / ||W'|| row-wise) * x W'^T + bias, W' = W + s (A B)^T merged with numpy (float64)."""
    w = weight_of(lin).astype(np.float64) + scale * (a.astype(np.float64) @ b).T  # [out, in]
    g = m / np.linalg.norm(w, axis=1)
    y = g * (x.astype(np.float64) @ w.T)
    return y + np.array(lin.bias) if "bias" in lin else y


def layer_with(kind: str, dora_slots=(2,), sort_threshold=None):
    """Slot 1: plain LoRA; slot 2: DoRA (or plain LoRA with the same factors when not in ``dora_slots``);
    mixed batches sorted by slot from ``sort_threshold`` rows (the GPU's path), None: never."""
    from mola.lora.geometry import module_rows

    lin = base_linear(kind)
    routing = LoRARouting(sort_threshold=sort_threshold)
    layer = MultiLoRALinear.from_base(lin, routing, num_slots=4, max_rank=8)
    layer.resize(4, 8)
    m = np.linalg.norm(weight_of(lin), axis=1) * np.random.default_rng(3).uniform(0.6, 1.4, OUT)
    for slot, seed in ((1, 1), (2, 2)):
        a, b = factors(seed)
        mag = mx.array(m.astype(np.float32)) if slot in dora_slots else None
        layer.set_rows(slot, module_rows(layer.geometry, 8, mx.float32, mx.array(a), mx.array(b), 1.5, mag))
    return layer, routing, m


@pytest.mark.parametrize("sort_threshold", [None, 1])
@pytest.mark.parametrize("kind", ["plain", "bias", "q4"])
def test_dora_rows_are_the_formula_merged_with_numpy(kind, sort_threshold):
    layer, routing, m = layer_with(kind, sort_threshold=sort_threshold)
    x = np.random.default_rng(0).normal(size=(3, 5, IN)).astype(np.float32)
    a, b = factors(2)
    want = dora_reference(layer.base, x, a, b, 1.5, m)
    routing.set([2, 2, 2])  # one slot: the single-slot path
    np.testing.assert_allclose(np.array(layer(mx.array(x))), want, rtol=1e-4, atol=1e-4)
    routing.set([2, 0, 1])  # mixed: gathered g (sorted by slot from the threshold on)
    np.testing.assert_allclose(np.array(layer(mx.array(x)))[0], want[0], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("sort_threshold", [None, 1])
@pytest.mark.parametrize("kind", ["plain", "bias", "q4"])
@pytest.mark.parametrize("rows", [[0, 2, 1], [1, 2, 0, 1], [0, 0, 2]])
def test_other_rows_are_the_same_bits_beside_a_dora_row(kind, rows, sort_threshold):
    """The base and LoRA rows of a batch with a DoRA row equal, bit for bit,
    those of the same batch with that slot holding plain LoRA (no g path)."""
    with_dora, routing, _ = layer_with(kind, sort_threshold=sort_threshold)
    plain, plain_routing, _ = layer_with(kind, dora_slots=(), sort_threshold=sort_threshold)
    x = mx.array(np.random.default_rng(1).normal(size=(len(rows), 3, IN)).astype(np.float32))
    routing.set(rows)
    plain_routing.set(rows)
    got, want = np.array(with_dora(x)), np.array(plain(x))
    others = [i for i, s in enumerate(rows) if s != 2]
    assert np.array_equal(got[others], want[others])
    assert not np.allclose(got[rows.index(2)], want[rows.index(2)], atol=1e-3)  # the DoRA row does differ


def test_the_g_pack_lives_only_while_a_dora_slot_is_written():
    layer, routing, m = layer_with("plain", dora_slots=())
    assert layer.dora.g is None and layer.nbytes == layer.lora_a.nbytes + layer.lora_b.nbytes
    layer, routing, m = layer_with("plain")
    assert layer.dora.g.shape == (4, OUT) and layer.nbytes == layer.lora_a.nbytes + layer.lora_b.nbytes + 4 * OUT * 4
    assert np.array_equal(np.array(layer.dora.g[[0, 1, 3]]), np.ones((3, OUT), np.float32))
    layer.resize(8, 8)  # more slots: g follows, the written one kept
    g2 = np.array(layer.dora.g[2])
    assert layer.dora.g.shape == (8, OUT) and np.array_equal(np.array(layer.dora.g[4:]), np.ones((4, OUT)))
    a, b = factors(2)
    want = m / np.linalg.norm(weight_of(layer.base) + 1.5 * (a @ b).T, axis=1)
    np.testing.assert_allclose(g2, want, rtol=1e-5)
    layer.zero_rows(2)  # the last DoRA slot cleared: no pack
    assert layer.dora.g is None and not layer.dora.slots


def test_magnitude_scale_reads_a_quantized_base_dequantized():
    lin = base_linear("q4")
    a, b = factors(4)
    m = mx.ones((OUT,))
    g = magnitude_scale(lin, mx.array(a.T), mx.array(2.0 * b), m)
    want = 1 / np.linalg.norm(weight_of(lin) + 2.0 * (a @ b).T, axis=1)
    np.testing.assert_allclose(np.array(g), want, rtol=1e-5)


@pytest.mark.parametrize("rows", [[2, 2], [0, 2]])
def test_a_rewritten_slot_is_read_afresh_by_the_same_rows(rows):
    """The rows' g is kept while the routing stays the same; a write into the
    slot (a new adapter there) is read by the next pass all the same."""
    from mola.lora.geometry import module_rows

    layer, routing, m = layer_with("plain")
    x = mx.array(np.random.default_rng(2).normal(size=(2, 1, IN)).astype(np.float32))
    routing.set(rows)
    before = np.array(layer(x))
    a, b = factors(5)
    m2 = (0.5 * m).astype(np.float32)
    layer.set_rows(2, module_rows(layer.geometry, 8, mx.float32, mx.array(a), mx.array(b), 1.5, mx.array(m2)))
    routing.set(rows)  # the same rows: the routing keeps its arrays
    after = np.array(layer(x))
    i = rows.index(2)
    want = dora_reference(layer.base, np.array(x), a, b, 1.5, m2)
    np.testing.assert_allclose(after[i], want[i], rtol=1e-4, atol=1e-4)
    assert not np.allclose(before[i], after[i], atol=1e-3)
