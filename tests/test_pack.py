"""AdapterPacks on a real mlx-lm model (mola/lora/pack.py)."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx_lm import load

from mola.adapters.formats import read_adapter
from mola.lora.layer import MultiLoRALinear
from mola.lora.pack import AdapterPacks
from mola.adapters.weights import validate


def test_install_wraps_every_block_linear(tiny_model):
    model, _ = load(str(tiny_model))
    linears = [p for p, m in model.named_modules() if isinstance(m, nn.Linear) and ".layers." in p]
    packs = AdapterPacks.install(model, max_loras=3, max_rank=8)
    assert sorted(packs.layers) == sorted(linears)
    assert len(linears) == 7 * len(model.layers)
    modules = dict(model.named_modules())
    for path, layer in packs.layers.items():
        assert modules[path] is layer and isinstance(layer, MultiLoRALinear)
        assert layer.lora_a.shape == (4, 8, layer.input_dims)
        assert layer.lora_b.shape == (4, 8, layer.output_dims)
    # lm_head and embeddings stay as they are.
    assert isinstance(model.lm_head, nn.Linear)


def test_base_output_unchanged_by_install(tiny_model):
    model, _ = load(str(tiny_model))
    tokens = mx.array([[5, 9, 13, 2, 7]])
    before = model(tokens)
    AdapterPacks.install(model, max_loras=2, max_rank=4)
    assert mx.array_equal(model(tokens), before).item()


def test_write_zero_pads_and_leaves_untargeted_layers_zero(tiny_model, adapters):
    model, _ = load(str(tiny_model))
    packs = AdapterPacks.install(model, max_loras=2, max_rank=16)
    weights = read_adapter(adapters["b"])  # rank 8, q_proj + down_proj, last layer only
    validate(weights, packs.geometry.dims, 16)
    packs.fill_from(2, weights)
    for path, layer in packs.layers.items():
        m = weights.modules.get(path)
        if m is None:
            assert mx.all(layer.lora_a[2] == 0).item() and mx.all(layer.lora_b[2] == 0).item()
            assert 2 not in layer.active_slots
            continue
        a, b = layer.factors(2)
        assert mx.array_equal(a, m.a).item()
        assert mx.allclose(b, m.scale * m.b).item()
        assert mx.all(layer.lora_a[2, 8:] == 0).item()  # the rank is zero-padded
        assert mx.all(layer.lora_b[2, 8:] == 0).item()
        assert layer.folded_scale[2].item() == m.scale
    packs.empty(2)
    assert all(mx.all(l.lora_a == 0).item() and not l.active_slots for l in packs.layers.values())


def test_rewriting_a_slot_replaces_every_layer(tiny_model, adapters):
    """A slot reused by an adapter with other targets keeps nothing of the old one."""
    model, _ = load(str(tiny_model))
    packs = AdapterPacks.install(model, max_loras=1, max_rank=16)
    packs.fill_from(1, read_adapter(adapters["c"]))  # all modules, rank 16
    small = read_adapter(adapters["b"])
    packs.fill_from(1, small)
    for path, layer in packs.layers.items():
        if path not in small.modules:
            assert mx.all(layer.lora_a[1] == 0).item() and 1 not in layer.active_slots
