"""DoRA beside LoRA (issue 45): what DoRA's per-row magnitude scale costs a
mixed decode step, and what its norm computation costs a load.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 OPENBLAS_NUM_THREADS=1 \\
        python benchmarks/dora.py [ROUNDS] [load|decode|step|both]

decode: serve.py's 88M float32 llama (systems.bench_model()) in the in-process
Engine (scheduler, runner, layers: the whole step but HTTP), 8 LoRA adapters
in slots 1-8 and 8 DoRA adapters (the same kind of random factors, plus
magnitudes) in slots 9-16, rank 16 on every linear. A workload sends C
requests of 24 random tokens and 40 new tokens at once, spread evenly over
the 8 adapters of one kind; the figure is C over the median gap between two
steps' outputs while all C rows decode. LoRA and DoRA workloads alternate
within a round (the order flips each round), and ratios are taken within a
round, so that a neighbour's load on the machine falls on both alike.

step: the same model, adapters and rows, the decode step alone (the model's
forward over one KV cache, no scheduler or sampling), LoRA rows and DoRA
rows alternating step by step (20 x ROUNDS steps each): on a shared machine
this pairs each DoRA step with a LoRA step taken a few milliseconds away.

load: a Qwen2-0.5B-shaped float32 model (systems.shaped_model("qwen0.5b"),
random weights, vocabulary 8192), one rank-8 adapter on all 168 linears, as
LoRA and as DoRA (the same factors): its rows prepared as the reader thread
prepares them (for DoRA, g = m / ||W + s B A|| computed layer by layer from the
base weights), then written into a slot on the engine thread and evaluated.
Median of ROUNDS loads each, alternating.
"""

from __future__ import annotations

import random
import statistics
import sys
import threading
import time

import mlx.core as mx
import numpy as np

from systems import bench_model, shaped_model

ROUNDS = int(sys.argv[1]) if len(sys.argv) > 1 else 3
WHAT = sys.argv[2] if len(sys.argv) > 2 else "both"
MAXTOK = 40


def random_adapter(packs, rank: int, seed: int, dora: bool):
    """LoRAWeights on every dense linear of ``packs``; with ``dora``, magnitudes
    near the base's row norms (as a trained DoRA's are)."""
    from mola.adapters.weights import LoRAWeights, ModuleLoRA
    from mola.lora.dora import dequantized_weight

    rng = np.random.default_rng(seed)
    modules, magnitudes = {}, {}
    for path, layer in packs.layers.items():
        din, dout = layer.full_dims
        a = mx.array(rng.normal(0, 1 / np.sqrt(din), (din, rank)).astype(np.float32))
        b = mx.array(rng.normal(0, 0.02, (rank, dout)).astype(np.float32))
        modules[path] = ModuleLoRA(a=a, b=b, scale=2.0)
        if dora:
            norms = mx.linalg.norm(dequantized_weight(layer.base), axis=1)
            magnitudes[path] = norms * mx.array(rng.uniform(0.8, 1.2, dout).astype(np.float32))
    mx.eval(modules, magnitudes)
    return LoRAWeights(source=f"random-{seed}", format="mlx-lm", modules=modules, magnitudes=magnitudes or None)


def bench_load() -> None:
    from mola.engine.config import EngineConfig
    from mola.engine.engine import Engine
    from mola.lora.pack import prepare_rows
    from mola.models.loader import load_base_model

    model = shaped_model("qwen0.5b")
    eng = Engine(lambda: load_base_model(str(model)), EngineConfig(max_loras=2, max_lora_rank=8), lambda outs: None)
    eng.start()
    try:
        packs = eng.packs
        weights = {k: eng.call(lambda k=k: random_adapter(packs, 8, 0, k == "dora")).result() for k in ("lora", "dora")}

        def prepare(kind):  # the reader thread's part: read rows, and for DoRA g layer by layer
            t0 = time.perf_counter()
            rows = prepare_rows(weights[kind], eng.geometry)
            return rows, time.perf_counter() - t0

        def write(rows):  # the engine thread's part: the copies into the packs
            t0 = time.perf_counter()
            packs.fill(1, rows)
            mx.eval(packs.arrays())
            return time.perf_counter() - t0

        times = {(k, part): [] for k in ("lora", "dora") for part in ("prepare", "write")}
        for r in range(ROUNDS + 1):
            for kind in (("lora", "dora") if r % 2 == 0 else ("dora", "lora")):
                rows, t_prep = prepare(kind)
                t_write = eng.call(lambda: write(rows)).result()
                if r:  # the first round warms up
                    times[kind, "prepare"].append(t_prep)
                    times[kind, "write"].append(t_write)
        ms = {key: statistics.median(v) * 1e3 for key, v in times.items()}
        print(f"load, qwen0.5b-shaped, {len(packs.layers)} linears, rank 8, median of {ROUNDS}: prepare (reader "
              f"thread) LoRA {ms['lora', 'prepare']:.0f} ms, DoRA {ms['dora', 'prepare']:.0f} ms (g's norms: "
              f"{ms['dora', 'prepare'] - ms['lora', 'prepare']:.0f} ms); slot write (engine thread) LoRA "
              f"{ms['lora', 'write']:.1f} ms, DoRA {ms['dora', 'write']:.1f} ms; DoRA prepares each: "
              f"{[round(t * 1e3) for t in times['dora', 'prepare']]}", flush=True)
    finally:
        eng.stop()


def bench_decode() -> None:
    from mola.engine.config import EngineConfig
    from mola.engine.engine import Engine
    from mola.engine.sequence import SamplingParams, Sequence
    from mola.models.loader import load_base_model

    stamps, cond = [], threading.Condition()

    def on_out(outs):
        now = time.perf_counter()
        with cond:
            if any(o.tokens for o in outs):
                stamps.append((now, sum(o.finish_reason is not None for o in outs)))
            cond.notify_all()

    eng = Engine(lambda: load_base_model(str(bench_model())),
                 EngineConfig(max_loras=16, max_lora_rank=16, max_num_seqs=32), on_out)
    eng.start()
    packs = eng.packs
    for slot in range(1, 17):
        weights = eng.call(lambda s=slot: random_adapter(packs, 16, s, s > 8)).result()
        eng.call(lambda w=weights, s=slot: packs.fill_from(s, w)).result()
    rng = random.Random(1)

    def run(kind: str, c: int) -> float:
        first = 1 if kind == "lora" else 9
        stamps.clear()
        seqs = [Sequence(prompt=[rng.randrange(100, 8000) for _ in range(24)],
                         params=SamplingParams(max_tokens=MAXTOK, temperature=0.0), slot=first + i % 8)
                for i in range(c)]
        for s in seqs:
            eng.add(s)
        with cond:
            cond.wait_for(lambda: sum(f for _, f in stamps) >= c, 1200)
        t = [s for s, _ in stamps]
        gaps = [b - a for a, b in zip(t[5:-3], t[6:-2])]  # steady: all rows decoding
        return c / statistics.median(gaps)  # tokens per second

    try:
        for c in (8, 32):
            run("lora", c), run("dora", c)  # warm-up
            res = {"lora": [], "dora": []}
            for r in range(ROUNDS):
                for kind in (("lora", "dora") if r % 2 == 0 else ("dora", "lora")):
                    res[kind].append(run(kind, c))
            ratios = [d / l for d, l in zip(res["dora"], res["lora"])]
            print(f"decode c={c}: LoRA mixed8 {statistics.median(res['lora']):.1f} tok/s, DoRA mixed8 "
                  f"{statistics.median(res['dora']):.1f} tok/s, DoRA/LoRA {statistics.median(ratios):.3f} "
                  f"(each round: {[round(x, 3) for x in ratios]})", flush=True)
    finally:
        eng.stop()


def bench_step() -> None:
    """The model's decode step alone (no scheduler), LoRA and DoRA rows
    alternating step by step over one KV cache, so that neighbours on the
    machine fall on both alike: tok/s = rows / median step."""
    from mlx_lm.models.cache import make_prompt_cache

    from mola.lora.pack import AdapterPacks
    from mola.models.loader import load_base_model

    model = load_base_model(str(bench_model())).model
    packs = AdapterPacks.install(model, max_loras=16, max_rank=16)
    for slot in range(1, 17):
        packs.fill_from(slot, random_adapter(packs, 16, slot, slot > 8))
    mx.eval(packs.arrays())
    rng = random.Random(2)
    for c in (8, 32):
        cache = make_prompt_cache(model)
        slots = {"lora": [1 + i % 8 for i in range(c)], "dora": [9 + i % 8 for i in range(c)]}
        packs.routing.set([0] * c)
        mx.eval(model(mx.array([[rng.randrange(100, 8000) for _ in range(24)] for _ in range(c)]), cache=cache))
        x = mx.array([[rng.randrange(100, 8000)] for _ in range(c)])
        times = {"lora": [], "dora": []}
        for step in range(2 * (ROUNDS * 20 + 4)):
            kind = ("lora", "dora")[(step + step // 2) % 2]  # LD DL LD ...: neither always goes first
            packs.routing.set(slots[kind])
            t0 = time.perf_counter()
            mx.eval(model(x, cache=cache))
            if step >= 8:  # warm-up
                times[kind].append(time.perf_counter() - t0)
        lora, dora = (statistics.median(times[k]) for k in ("lora", "dora"))
        paired = statistics.median(l / d for l, d in zip(times["lora"], times["dora"]))  # adjacent steps
        print(f"decode step c={c}: LoRA mixed8 {c / lora:.1f} tok/s ({lora * 1e3:.1f} ms), DoRA mixed8 "
              f"{c / dora:.1f} tok/s ({dora * 1e3:.1f} ms), DoRA/LoRA {lora / dora:.3f} (median of "
              f"{len(times['dora'])} adjacent pairs: {paired:.3f})", flush=True)


if __name__ == "__main__":
    if WHAT in ("load", "both"):
        bench_load()
    if WHAT in ("decode", "both"):
        bench_decode()
    if WHAT in ("step", "both"):
        bench_step()
