"""Where a mixed decode step's extra LoRA time goes (issue 43, "also found" item 4):
the eight adapters' bytes, or gather_mm's per-row products. SmolLM2-135M's 210
linears (30 blocks of q/k/v/o/gate/up/down, float32 as mola computes on a CPU;
--head adds the tied output head, 576 -> 49,152), 8 rows of one token, 66 slots
of rank R, every linear of the step in one mx.eval, as a decode step evaluates
them. The layer's own ops (mola.lora.layer), on four routings:

    base         x @ W^T
    one          + addmm(., x @ A_1, B_1): every row on one adapter (the single path)
    gather_same  + the gather_mm pair, every row on slot 1: one adapter's bytes,
                 the mixed path's per-row products
    gather8      + the gather_mm pair, rows on slots 1..8: eight adapters' bytes

gather_same - one is what the mixed path's structure costs; gather8 - gather_same
is what reading eight adapters' factors instead of one costs, and grows with R.
Times are CPU time (every thread of the process, MLX's worker included), which a
shared machine moves less than wall time; the wall times are in the JSON too.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 OPENBLAS_NUM_THREADS=1 \\
        python benchmarks/mixed_bytes.py [--ranks 8 16 32] [--rounds 7] [--head] [--out F.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx

BLOCK = [(576, 576), (576, 192), (576, 192), (576, 576), (576, 1536), (576, 1536), (1536, 576)]  # (in, out)
SLOTS, ROWS = 66, 8


def routings(rank: int, head: bool) -> dict:
    shapes = BLOCK * 30 + ([(576, 49152)] if head else [])
    mx.random.seed(0)
    w = [mx.random.normal((o, i)) * 0.02 for i, o in shapes]  # [out, in]
    a = [mx.random.normal((SLOTS, rank, i)) * 0.02 for i, o in shapes]  # [S, r, in]: A^T, as the packs hold it
    b = [mx.random.normal((SLOTS, rank, o)) * 0.02 for i, o in shapes]  # [S, r, out]
    x = {d: mx.random.normal((ROWS, 1, d)) for d in {i for i, _ in shapes}}  # [B, 1, in]
    mx.eval(w, a, b, x)
    a_view = [p.swapaxes(1, 2) for p in a]  # [S, in, r]: the layer's _pack_view
    a1, b1 = [p[1].T for p in a], [p[1] for p in b]  # [in, r], [r, out]: its _slot_view
    same = mx.array([1] * ROWS, dtype=mx.uint32)
    eight = mx.array(list(range(1, ROWS + 1)), dtype=mx.uint32)

    def gathered(idx):
        return lambda: [x[i] @ wi.T + mx.gather_mm(mx.gather_mm(x[i], ai, rhs_indices=idx), bi, rhs_indices=idx)
                        for (i, _), wi, ai, bi in zip(shapes, w, a_view, b)]

    return {
        "base": lambda: [x[i] @ wi.T for (i, _), wi in zip(shapes, w)],
        "one": lambda: [mx.addmm(x[i] @ wi.T, x[i] @ ai, bi) for (i, _), wi, ai, bi in zip(shapes, w, a1, b1)],
        "gather_same": gathered(same),
        "gather8": gathered(eight),
    }


def timed(fn, iters: int) -> tuple[float, float]:
    """(CPU ms, wall ms) per evaluation of ``fn``'s linears."""
    for _ in range(3):
        mx.eval(fn())
    c0, t0 = time.process_time(), time.perf_counter()
    for _ in range(iters):
        mx.eval(fn())
    return (time.process_time() - c0) / iters * 1e3, (time.perf_counter() - t0) / iters * 1e3


def bench(rank: int, rounds: int, iters: int, head: bool) -> dict:
    cases = routings(rank, head)
    ms, wall = {k: [] for k in cases}, {k: [] for k in cases}
    for r in range(rounds):  # interleaved, the order reversed every other round
        for k, fn in (cases.items() if r % 2 == 0 else reversed(cases.items())):
            cpu, w = timed(fn, iters)
            ms[k].append(cpu)
            wall[k].append(w)
    med = {k: statistics.median(v) for k, v in ms.items()}
    extra = {k: statistics.median(x - o for x, o in zip(ms[k], ms["one"])) for k in ("gather_same", "gather8")}
    return {"rank": rank, "cpu_ms": ms, "wall_ms": wall, "median_ms": med, "median_minus_one_ms": extra,
            "adapter_mib": sum((i + o) * rank * 4 for i, o in BLOCK * 30 + ([(576, 49152)] if head else [])) / 2**20}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, nargs="+", default=[8, 16, 32])
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--head", action="store_true", help="also the tied output head (576 -> 49,152)")
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "mixed_bytes.json")
    a = p.parse_args()
    rows = []
    for rank in a.ranks:
        load = os.getloadavg()[0]
        r = bench(rank, a.rounds, a.iters, a.head) | {"loadavg_before": load}
        rows.append(r)
        med, extra = r["median_ms"], r["median_minus_one_ms"]
        print(f"rank {rank:3d} (one adapter {r['adapter_mib']:.1f} MiB, load {load:.1f}): "
              + ", ".join(f"{k} {v:.1f}" for k, v in med.items())
              + f" CPU ms; minus one: gather_same {extra['gather_same']:+.1f}, gather8 {extra['gather8']:+.1f} ms",
              flush=True)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps({"args": vars(a) | {"out": str(a.out)}, "rows": rows}, indent=1) + "\n")
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
