"""AdapterPacks on a real mlx-lm model (mola/lora/pack.py)."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx_lm import load

from mola.adapters.formats import read_adapter
from mola.lora.layer import MultiLoRALinear
from mola.lora.pack import AdapterPacks
from mola.adapters.weights import validate

from helpers.engines import hold_packs_at_ceilings


def test_install_wraps_every_block_linear(tiny_model):
    model, _ = load(str(tiny_model))
    linears = [p for p, m in model.named_modules() if isinstance(m, nn.Linear) and ".layers." in p]
    packs = AdapterPacks.install(model, max_loras=3, max_rank=8)
    # the blocks' linears, the token embedding and the head (mola/lora/embedding.py)
    assert sorted(packs.layers) == sorted([*linears, "model.embed_tokens", "lm_head"])
    assert len(linears) == 7 * len(model.layers)
    modules = dict(model.named_modules())
    for path, layer in packs.layers.items():
        assert modules[path] is layer and isinstance(layer, MultiLoRALinear)
        # No adapter loaded: no pack memory (slot 0 alone, rank 0).
        assert layer.lora_a.shape == (1, 0, layer.input_dims)
        assert layer.lora_b.shape == (1, 0, layer.output_dims)
    assert packs.nbytes == 0 and packs.stats().num_packs == 0
    assert packs.geometry.max_rank == 8 and packs.geometry.num_slots == 4  # the ceilings stay
    # lm_head and the embedding are wrapped around the base's own layers.
    assert isinstance(model.lm_head.base, nn.Linear) and isinstance(model.model.embed_tokens.base, nn.Embedding)


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
        assert layer.folded_scale[2] == m.scale
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


# ---- packs sized to what is loaded ----------------------------------------------


def _mixed_logits(model, packs, slots, tokens):
    packs.routing.set(slots, [1.0, 0.5, 2.0, 1.0][:len(slots)])
    out = model(tokens)
    packs.routing.clear()
    return out


def test_only_targeted_modules_take_memory_at_their_rank(tiny_model, adapters):
    model, _ = load(str(tiny_model))
    packs = AdapterPacks.install(model, max_loras=4, max_rank=64)
    b = read_adapter(adapters["b"])  # rank 8, q_proj + down_proj, last layer only
    packs.fill_from(1, b)
    for path, layer in packs.layers.items():
        if path in b.modules:
            assert layer.lora_a.shape == (2, 8, layer.input_dims)  # slots 0..1, rank 8 (not 64)
        else:
            assert layer.nbytes == 0, path
    assert packs.nbytes == packs.geometry.pack_bytes([(8, b.modules)])
    assert packs.nbytes == sum(2 * 8 * (l.input_dims + l.output_dims) * 4 for p, l in packs.layers.items()
                               if p in b.modules)
    assert packs.stats().num_packs == len(b.modules) and packs.stats().ranks == (8,)


def test_growth_and_shrinkage_keep_every_slot_and_the_outputs(tiny_model, adapters):
    """Packs grow (slots and rank) when a larger adapter loads and shrink after
    unloads; at every size, a mixed batch gives the same logits as packs held
    at the ceilings (computed on a second model)."""
    model, _ = load(str(tiny_model))
    ref_model, _ = load(str(tiny_model))
    packs = AdapterPacks.install(model, max_loras=4, max_rank=32)
    ref = AdapterPacks.install(ref_model, max_loras=4, max_rank=32)
    hold_packs_at_ceilings(ref)
    a, c = read_adapter(adapters["a"]), read_adapter(adapters["c"])  # rank 4 on q, v; rank 16 everywhere
    tokens = mx.array([[5, 9, 13, 2, 7]] * 3)

    def same(slots):
        got, want = _mixed_logits(model, packs, slots, tokens), _mixed_logits(ref_model, ref, slots, tokens)
        assert mx.array_equal(got, want).item(), slots

    for p in (packs, ref):
        p.fill_from(1, a)
    q = "model.layers.0.self_attn.q_proj"
    assert packs.layers[q].lora_a.shape[:2] == (2, 4) and packs.slot_capacity == 2
    same([0, 1, 1])
    for p in (packs, ref):
        p.fill_from(3, c)  # grows: slots 0..3, rank 16, every module
    assert packs.slot_capacity == 4 and packs.layers[q].rank_capacity == 16
    assert all(l.rank_capacity == 16 for p, l in packs.layers.items() if ".layers." in p)  # c's modules
    assert packs.layers["lm_head"].rank_capacity == 0  # no adapter targets the head: no pack
    assert mx.array_equal(packs.layers[q].factors(1)[0], ref.layers[q].factors(1)[0]).item()  # slot 1 kept
    same([1, 3, 0])
    for p in (packs, ref):
        p.empty(3)  # lazily: modules only c targeted free at once; q, v back to rank 4 (a quarter of 16)
    assert packs.layers[q].rank_capacity == 4
    assert packs.layers["model.layers.0.mlp.up_proj"].nbytes == 0
    assert packs.slot_capacity == 4  # slots 0..1 need 2, not a quarter of 4: kept until compacted
    same([1, 0, 1])
    assert packs.compact() and packs.slot_capacity == 2
    assert packs.nbytes == packs.geometry.pack_bytes([(4, a.modules)])
    same([1, 0, 1])
    for p in (packs, ref):
        p.empty(1)
    assert packs.nbytes == 0
    same([0, 0, 0])


def test_a_resized_pack_frees_the_old_buffer(tiny_model, adapters):
    model, _ = load(str(tiny_model))
    packs = AdapterPacks.install(model, max_loras=8, max_rank=64)
    c = read_adapter(adapters["c"])
    mx.eval(model.parameters())
    base = mx.get_active_memory()
    packs.fill_from(8, c)
    mx.eval(packs.arrays())
    grown = mx.get_active_memory() - base
    assert grown >= packs.nbytes > 0
    packs.empty(8)
    del c
    mx.eval(packs.arrays())
    mx.clear_cache()
    assert mx.get_active_memory() - base < packs.geometry.dense_slot_bytes // 8  # the packs' buffers are gone


def test_growth_bytes_is_what_the_packs_grow_by(tiny_model, adapters):
    """engine.memory.growth_bytes (what a load is checked against) from the
    published stats alone equals the packs' own growth, load after load."""
    from mola.engine.memory import growth_bytes
    from mola.lora.pack import prepare_rows

    model, _ = load(str(tiny_model))
    packs = AdapterPacks.install(model, max_loras=6, max_rank=32)
    for slot, name in ((1, "b"), (2, "a"), (5, "c"), (3, "a")):
        rows = prepare_rows(read_adapter(adapters[name]), packs.geometry)
        before = packs.nbytes
        predicted = growth_bytes(packs.stats(), packs.geometry, slot, rows)
        packs.fill(slot, rows)
        assert packs.nbytes - before == predicted, (slot, name)


def test_the_ceilings_stay_what_admission_checks(tiny_model, adapters):
    """Packs that grew still refuse what the ceilings refuse, by name."""
    import pytest

    from mola.errors import InvalidAdapter

    model, _ = load(str(tiny_model))
    packs = AdapterPacks.install(model, max_loras=2, max_rank=8)
    packs.fill_from(1, read_adapter(adapters["b"]))  # rank 8
    assert packs.geometry.max_rank == 8 and packs.geometry.num_slots == 3
    with pytest.raises(InvalidAdapter, match="--max-lora-rank 8"):
        validate(read_adapter(adapters["c"]), packs.geometry.targets, packs.geometry.max_rank)
    with pytest.raises(ValueError, match="outside 1..2"):
        packs.fill_from(3, read_adapter(adapters["a"]))
