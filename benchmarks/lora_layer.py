"""The multi-LoRA layer's paths against a plain linear, across batch sizes and
ranks (decode shapes: one token per row).

    python benchmarks/lora_layer.py [--in-dims 768] [--out-dims 2048] [--slots 9]
                                    [--batch 1 8 32 64] [--ranks 8 16 64] [--repeats 5]

Paths: base (plain nn.Linear), slot0 (every row on the empty slot: the base
fast path), single (every row on one adapter: plain matmuls), mixed (rows over
all slots, gather_mm, unsorted), sorted (the same rows sorted by slot). Each
figure is the median of --repeats interleaved timings, in microseconds per
call; "x base" is the ratio to the plain linear measured in the same round.
With OpenBLAS (Linux CPU), run it preloaded, as mola serve does:
    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 python benchmarks/lora_layer.py
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

from mola.lora.layer import MultiLoRALinear
from mola.lora.routing import LoRARouting


def time_call(fn, iters: int) -> float:
    for _ in range(5):
        mx.eval(fn())
    t0 = time.perf_counter()
    for _ in range(iters):
        mx.eval(fn())
    return (time.perf_counter() - t0) / iters * 1e6


def bench(in_dims, out_dims, slots, batch, rank, max_rank, iters, repeats) -> dict:
    base = nn.Linear(in_dims, out_dims, bias=False)
    routing = LoRARouting()
    layer = MultiLoRALinear.from_base(base, routing, num_slots=slots, max_rank=max_rank)
    for s in range(1, slots):
        layer.set_factors(s, mx.random.normal((in_dims, rank)) * 0.02,
                         mx.random.normal((rank, out_dims)) * 0.02, 2.0)
    mx.eval(layer.parameters())
    x = mx.random.normal((batch, 1, in_dims))
    mx.eval(x)
    mixed = [1 + i % (slots - 1) for i in range(batch)]

    def path(name):
        if name == "base":
            return lambda: base(x)
        if name == "slot0":
            return lambda: (routing.set([0] * batch), layer(x))[1]
        if name == "single":
            return lambda: (routing.set([1] * batch), layer(x))[1]
        routing_sorted = name == "sorted"

        def run():
            routing.sort_threshold = 1 if routing_sorted else 10 ** 9
            routing.set(mixed)
            return layer(x)
        return run

    names = ["base", "slot0", "single", "mixed", "sorted"]
    samples = {n: [] for n in names}
    for _ in range(repeats):  # interleaved rounds against machine noise
        for n in names:
            samples[n].append(time_call(path(n), iters))
    med = {n: statistics.median(v) for n, v in samples.items()}
    return {"in": in_dims, "out": out_dims, "batch": batch, "rank": rank, "us": med,
            "x_base": {n: med[n] / med["base"] for n in names}}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--in-dims", type=int, default=768)
    p.add_argument("--out-dims", type=int, default=2048)
    p.add_argument("--slots", type=int, default=9, help="slots including the empty slot 0")
    p.add_argument("--max-rank", type=int, default=64)
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32, 64])
    p.add_argument("--ranks", type=int, nargs="+", default=[8, 16, 64])
    p.add_argument("--iters", type=int, default=100)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "lora_layer.json")
    a = p.parse_args()
    rows = []
    print(f"{'B':>3} {'r':>3} " + " ".join(f"{n:>14}" for n in ["base", "slot0", "single", "mixed", "sorted"]))
    for rank in a.ranks:
        for batch in a.batch:
            r = bench(a.in_dims, a.out_dims, a.slots, batch, rank, max(a.max_rank, rank), a.iters, a.repeats)
            rows.append(r)
            cells = " ".join(f"{r['us'][n]:7.0f} ({r['x_base'][n]:.2f})" for n in r["us"])
            print(f"{batch:>3} {rank:>3} {cells}")
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps({"args": vars(a) | {"out": str(a.out)}, "rows": rows}, indent=1))
    print(f"\nmicroseconds per call (ratio to the plain linear); wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
