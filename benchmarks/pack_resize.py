"""What a slot-pack resize costs a running batch, against a hot load that resizes nothing.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 python benchmarks/pack_resize.py

On the 88M bench model (adapters on every linear of every block), with 8
slots of rank up to 16 and five rank-8 adapters resident, a batch of 8 rows
on them decodes; between two of its steps, with one step in flight as in the
engine, comes in turn (interleaved, so that a busy machine slows all alike):

- nothing (the plain step);
- a hot load: a rank-8 adapter written into slot 6, which the packs hold already;
- a growing load: a rank-16 adapter written into slot 6 (every pack doubles its
  rank).

Each is cleared after, and the packs compacted back (outside the timing).
Reported, in ms (medians): the queued write itself (what the engine thread
spends), and the time from the write to the next step's token (the step in
flight, the copies, the next step), whose excess over "nothing" is what the
write cost the running rows; and the packs' sizes.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from systems import bench_adapters, bench_model  # noqa: E402

REPEATS = 15


def main() -> int:
    from mlx_lm import load
    from mlx_lm.models.cache import make_prompt_cache

    from mola.adapters.recipe import SlotRecipe, read_recipe
    from mola.lora.pack import AdapterPacks, prepare_rows

    model_dir = bench_model()
    model, _ = load(str(model_dir))
    packs = AdapterPacks.install(model, max_loras=8, max_rank=16)
    geometry = packs.geometry

    def rows_of(paths):
        return [prepare_rows(read_recipe(SlotRecipe.single(str(p)), geometry, None), geometry) for p in paths]

    small, big = rows_of(bench_adapters(model_dir, 6, 8)), rows_of(bench_adapters(model_dir, 1, 16))[0]
    for i in range(5):  # slots 0..5: the packs hold 8 slots
        packs.fill(i + 1, small[i])
    mx.eval(packs.arrays())
    resident = packs.nbytes
    cache = make_prompt_cache(model)
    packs.routing.set([1, 2, 3, 4, 5, 1, 2, 3])
    mx.eval(model(mx.array([[1, 2, 3, 4, 5, 6, 7, 8]] * 8), cache=cache))
    tokens = mx.array([[5]] * 8)

    def step():
        return model(tokens, cache=cache)[:, -1].argmax(-1)

    def timed(write):
        """(the queued write, from it to the next step's token) in ms, a step in flight during the write."""
        s = step()
        mx.async_eval(s)
        t0 = time.perf_counter()
        write()
        t1 = time.perf_counter()
        nxt = step()
        mx.eval(s, nxt)
        t2 = time.perf_counter()
        return (t1 - t0) * 1e3, (t2 - t0) * 1e3

    grown = {}

    def grow():
        packs.fill(6, big)
        grown.setdefault("bytes", packs.nbytes)

    kinds = {"nothing": lambda: None, "hot_load": lambda: packs.fill(6, small[5]), "growing_load": grow}
    times = {k: ([], []) for k in kinds}
    for _ in range(REPEATS):
        for kind, write in kinds.items():
            w, s = timed(write)
            times[kind][0].append(w)
            times[kind][1].append(s)
            packs.empty(6)
            packs.compact()  # a growing load's packs shrink back to rank 8 (its slot was their only need)
            assert packs.nbytes == resident
            mx.eval(packs.arrays())
    out = {"packs_mb_resident": round(resident / 1e6, 1), "packs_mb_grown": round(grown["bytes"] / 1e6, 1)}
    for kind, (w, s) in times.items():
        out[f"{kind}_write_ms"] = round(statistics.median(w), 2)
        out[f"{kind}_to_next_token_ms"] = round(statistics.median(s), 2)
    for k, v in out.items():
        print(f"  {k:<28} {v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
