"""AdapterLoader over the real engine's slot port: read and checked on the
reader thread, rows prepared there, only the copy on the engine thread
(mola/adapters/loader.py, the SlotPort of mola/engine/async_engine.py)."""

from __future__ import annotations

import asyncio

import numpy as np

from mola.adapters.formats import read_adapter
from mola.adapters.loader import AdapterLoader
from mola.adapters.recipe import SlotRecipe
from mola.engine.async_engine import AsyncEngine


def test_place_and_remove_through_the_engine_port(engine, adapters):
    async def main():
        loader = AdapterLoader(AsyncEngine(engine), engine.loaded.config)
        try:
            recipe = SlotRecipe.single(str(adapters["b"]), slot_scale=0.5)
            prepared = await loader.prepare(recipe)
            assert (prepared.rank, prepared.format) == (8, "mlx-lm")
            await loader.port.write_slot(2, prepared.rows, recipe)
            layers = await AsyncEngine(engine).call(lambda: {  # copied out on the engine thread
                p: tuple(np.array(f) for f in l.factors(2))
                for p, l in engine.packs.layers.items() if 2 in l.active_slots})
            plain = read_adapter(adapters["b"])
            assert set(layers) == set(plain.modules)
            for path, (a, b) in layers.items():
                m = plain.modules[path]
                assert np.array_equal(a, np.array(m.a))
                assert np.allclose(b, 0.5 * m.scale * np.array(m.b), atol=1e-6)  # the recipe's scale folded into B
            await loader.port.clear_slot(2)
            assert await AsyncEngine(engine).call(
                lambda: not any(l.active_slots for l in engine.packs.layers.values()))
        finally:
            loader.close()

    asyncio.run(main())
