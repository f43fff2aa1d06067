"""What a slot write costs, and the pointer swap it could be instead.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 python benchmarks/slot_write.py [--slots 16]

On the 88M bench model with --slots slots of rank 16, for a rank-16 adapter
whose rows are already prepared (as the host tier keeps them), in ms (median):

- copy, waited (mx.eval) and queued (mx.async_eval, what the engine does),
  on an idle engine and with a decode step (batch 8) in flight;
- a decode step, and a queued copy followed by a decode step (interleaved);
- a pointer swap: each layer's slot taken from the prepared arrays as they
  are, which for gather_mm (one pack per layer holding every slot) means
  stacking the pack again around them.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from systems import bench_adapters, bench_model  # noqa: E402


def ms(fn, n: int = 15) -> float:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return round(statistics.median(times), 2)


def main() -> int:
    from mlx_lm import load
    from mlx_lm.models.cache import make_prompt_cache

    from mola.lora.pack import AdapterPacks, prepare_rows
    from mola.adapters.recipe import SlotRecipe, read_recipe

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--slots", type=int, default=16)
    a = p.parse_args()
    model_dir = bench_model()
    paths = bench_adapters(model_dir, 4, 16)
    model, _ = load(str(model_dir))
    packs = AdapterPacks.install(model, max_loras=a.slots, max_rank=16)
    geometry = packs.geometry
    rows = [prepare_rows(read_recipe(SlotRecipe.single(str(x)), geometry, None), geometry) for x in paths]
    for i in range(3):
        packs.fill(i + 1, rows[i])
    cache = make_prompt_cache(model)
    packs.routing.set([1, 2, 3, 1, 2, 3, 1, 2])
    mx.eval(model(mx.array([[1, 2, 3, 4, 5, 6, 7, 8]] * 8), cache=cache))
    tokens = mx.array([[5]] * 8)

    def step():
        return model(tokens, cache=cache)[:, -1].argmax(-1)

    def waited():
        packs.fill(4, rows[3])
        mx.eval(packs.arrays())

    def in_flight(write):
        def run():
            s = step()
            mx.async_eval(s)
            t0 = time.perf_counter()
            write()
            dt = time.perf_counter() - t0
            mx.eval(s)
            return dt
        return lambda: statistics.median(run() * 1e3 for _ in range(15))

    def step_with_and_without_copy(n: int = 15) -> tuple[float, float]:
        """Interleaved, so that a busy machine slows both alike."""
        plain, after = [], []
        for _ in range(n):
            t0 = time.perf_counter()
            mx.eval(step())
            t1 = time.perf_counter()
            packs.fill(4, rows[3])
            mx.eval(step())
            plain.append(t1 - t0)
            after.append(time.perf_counter() - t1)
        return round(statistics.median(plain) * 1e3, 2), round(statistics.median(after) * 1e3, 2)

    plain, after = step_with_and_without_copy()
    out = {
        "pack_mb": round(packs.nbytes / 1e6, 1), "rows_mb": round(rows[3].nbytes / 1e6, 1),
        "decode_step": plain, "queued_copy_then_decode_step": after,
        "copy_waited_idle": ms(waited),
        "copy_queued_idle": ms(lambda: packs.fill(4, rows[3])),
        "copy_waited_step_in_flight": round(in_flight(waited)(), 2),
        "copy_queued_step_in_flight": round(in_flight(lambda: packs.fill(4, rows[3]))(), 2),
    }
    mx.eval(packs.arrays())

    def swap():  # slot 4 of every layer from the prepared arrays: the packs stacked again around them
        for path, layer in packs.layers.items():
            r = rows[3].modules[path]
            pad = mx.zeros((layer.max_rank - r.rank, layer.input_dims), dtype=layer.dtype)
            slot_a = mx.concatenate([r.a, pad]) if r.rank < layer.max_rank else r.a
            layer.lora_a = mx.stack([slot_a if s == 4 else layer.lora_a[s] for s in range(layer.num_slots)])
        mx.eval(packs.arrays())

    out["pointer_swap_a_only"] = ms(swap, 5)
    for k, v in out.items():
        print(f"  {k:<32} {v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
