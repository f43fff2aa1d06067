"""Reading and checking adapters from a recipe, the one way rank 0 and the
other ranks of a group do it (mola/adapters/recipe.py)."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm import load

from mola.errors import AdapterRankTooHigh, InvalidAdapter
from mola.adapters.formats import read_adapter
from mola.lora.pack import AdapterPacks
from mola.adapters.recipe import SlotRecipe, read_checked, read_recipe


@pytest.fixture(scope="module")
def geometry(tiny_model):
    model, _ = load(str(tiny_model))
    return AdapterPacks.install(model, max_loras=2, max_rank=16).geometry


def test_a_single_recipe_is_the_adapter_as_read(adapters, geometry, tiny_model):
    weights = read_recipe(SlotRecipe.single(str(adapters["b"]), slot_scale=0.5), geometry, None)
    plain = read_adapter(adapters["b"])
    assert set(weights.modules) == set(plain.modules)
    for path, m in weights.modules.items():
        assert mx.array_equal(m.a, plain.modules[path].a).item() and m.scale == plain.modules[path].scale


def test_a_stacked_recipe_is_the_sum_of_its_parts(adapters, geometry):
    recipe = SlotRecipe(((str(adapters["a"]), 0.5), (str(adapters["b"]), 2.0)))
    stacked = read_recipe(recipe, geometry, None)
    a, b = read_adapter(adapters["a"]), read_adapter(adapters["b"])
    for path, m in stacked.modules.items():
        x = mx.random.normal((3, m.a.shape[0]))
        want = mx.zeros((3, m.b.shape[1]))
        for part, s in ((a, 0.5), (b, 2.0)):
            if path in part.modules:
                p = part.modules[path]
                want = want + s * p.scale * (x @ p.a) @ p.b
        assert mx.allclose(m.scale * (x @ m.a) @ m.b, want, atol=1e-4).item(), path


def test_checks_name_the_problem(adapters, geometry, tmp_path):
    small = type(geometry)(targets=geometry.targets, max_rank=4, num_slots=3, dtype=geometry.dtype)
    with pytest.raises(InvalidAdapter, match="above the server's --max-lora-rank 4"):
        read_checked(str(adapters["b"]), small, None)
    with pytest.raises(AdapterRankTooHigh, match="4 \\+ 16 = 20"):
        read_recipe(SlotRecipe(((str(adapters["a"]), 1.0), (str(adapters["c"]), 1.0))), geometry, None)
