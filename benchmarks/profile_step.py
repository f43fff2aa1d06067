"""Where a decode step's LoRA time goes (issue 26): the multi-LoRA layers at a
model's exact shapes, then whole decode steps of the real model.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 \\
        python benchmarks/profile_step.py [--parts layers model] [--batch 8 32] [--ranks 8 64]
                                          [--layers 30] [--repeats 5]
                                          [--model real|qwen0.5b|llama1b]

layers: every linear of --layers blocks of SmolLM2-135M (q 576->576, k/v 576->192,
o 576->576, gate/up 576->1536, down 1536->576; 64 adapter slots + slot 0), fed
one decode token per row and evaluated together, as a step evaluates them.
Cumulative variants, each a superset of the one before, so that the difference
of two is what the added part costs:

    base    the base matmuls only
    +A      and x @ A (gather_mm over the rows' slots; a plain matmul for one)
    +B      and (x @ A) @ B, added to the base output
    +sort   and the gather of rows into slot order and back (mixed, sorted)
    layer   MultiLoRALinear itself (what the model runs)

model: decode steps of SmolLM2-135M-Instruct (the GGUF as mola loads it,
float32 on a CPU; --model qwen0.5b / llama1b: random float32 models in the
shapes of Qwen2.5-0.5B / Llama-3.2-1B, built once by systems.shaped_model)
with 64 random adapters written into every linear: steps
per second for the workloads base / one / mixed8 / mixed64, and the LoRA's
share of a step (1 - base / workload).

Workloads: one (every row on slot 1), mixed8 (rows round robin over 8 slots),
mixed64 (over 64), each routed as the routing's default has it. Where that
default never sorts (a CPU) and the batch has SORT_THRESHOLD rows or more, also
"mixed8 sorted" and "mixed64 sorted": the rows sorted by slot, as a GPU runs
them and as the CPU did before issue 26. Every figure is the median of
--repeats interleaved rounds; ratios are taken within a round. Results: benchmarks/results/profile_step.json.
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
from mlx import nn

from mola.lora.layer import MultiLoRALinear
from mola.lora.routing import SORT_THRESHOLD, LoRARouting, default_sort_threshold

SMOLLM = {"q": (576, 576), "k": (576, 192), "v": (576, 192), "o": (576, 576),
          "gate": (576, 1536), "up": (576, 1536), "down": (1536, 576)}
WORKLOADS = {"one": 1, "mixed8": 8, "mixed64": 64}
VARIANTS = ["base", "+A", "+B", "+sort", "layer"]


def slots_of(workload: str, batch: int) -> list[int]:
    if workload == "base":
        return [0] * batch
    k = WORKLOADS[workload]
    return [1 + i % k for i in range(batch)]


def timed(fn, iters: int) -> float:
    """Milliseconds per call of fn(), each call evaluated."""
    for _ in range(3):
        mx.eval(fn())
    t0 = time.perf_counter()
    for _ in range(iters):
        mx.eval(fn())
    return (time.perf_counter() - t0) / iters * 1e3


def make_layers(num_layers: int, rank: int, slots: int, routing: LoRARouting) -> list[tuple[MultiLoRALinear, mx.array]]:
    out = []
    for _ in range(num_layers):
        for din, dout in SMOLLM.values():
            layer = MultiLoRALinear.from_base(nn.Linear(din, dout, bias=False), routing, slots + 1, rank)
            for s in range(1, slots + 1):
                layer.set_factors(s, mx.random.normal((din, rank)) * 0.02, mx.random.normal((rank, dout)) * 0.02, 2.0)
            mx.eval(layer.parameters())
            out.append(layer)
    return out


def variant(name: str, layers, xs: dict, route: LoRARouting):
    """A function computing ``name`` for every layer (see the module doc)."""
    def one(layer: MultiLoRALinear):
        x = xs[layer.input_dims]
        y = layer.base(x)
        if name == "base" or route.single_slot == 0:
            return y
        if name == "layer":
            return layer(x)
        if route.single_slot is not None:
            a, b = layer._slot_view(route.single_slot)
            z = x @ a
            return (y, z) if name == "+A" else mx.addmm(y, z, b)
        a, b = layer._pack_view()
        sort = name == "+sort" and route.order is not None
        xx = x[route.order] if sort else x
        idx = route.sorted_idx if sort else route.idx
        z = mx.gather_mm(xx, a, rhs_indices=idx, sorted_indices=sort)
        if name == "+A":
            return y, z
        z = mx.gather_mm(z, b, rhs_indices=idx, sorted_indices=sort)
        return y + (z[route.inv_order] if sort else z)
    return lambda: [one(l) for l in layers]


def profile_layers(a) -> list[dict]:
    rows = []
    for rank in a.ranks:
        routing = LoRARouting()
        layers = make_layers(a.layers, rank, 64, routing)
        for batch in a.batch:
            xs = {d: mx.random.normal((batch, 1, d)) for d in (576, 1536)}
            mx.eval(xs)
            samples = {(w, v): [] for w in WORKLOADS for v in VARIANTS}
            for _ in range(a.repeats):
                for w in WORKLOADS:
                    routing.sort_threshold = SORT_THRESHOLD
                    routing.set(slots_of(w, batch))
                    for v in VARIANTS:
                        samples[(w, v)].append(timed(variant(v, layers, xs, routing), a.iters))
            for w in WORKLOADS:
                ms = {v: statistics.median(samples[(w, v)]) for v in VARIANTS}
                ratio = statistics.median(l / b for l, b in zip(samples[(w, "layer")], samples[(w, "base")]))
                rows.append({"model": a.model, "rank": rank, "batch": batch, "workload": w, "ms": ms, "layer_x_base": ratio})
                print(f"r={rank:<3} B={batch:<3} {w:8s} " + " ".join(f"{v}={ms[v]:6.2f}" for v in VARIANTS)
                      + f"  layer/base={ratio:.2f}  load={os.getloadavg()[0]:.1f}", flush=True)
        del layers
    return rows


def decode_step_rate(model, routing: LoRARouting, slots: list[int], steps: int, sort: bool = False) -> float:
    """Decode steps per second for one batch of rows on ``slots``, sorted by
    slot if ``sort``, else as the routing's default has it."""
    from mlx_lm.models.cache import make_prompt_cache

    batch = len(slots)
    routing.sort_threshold = SORT_THRESHOLD if sort else default_sort_threshold()
    routing.set(slots)
    cache = make_prompt_cache(model)
    prompt = mx.array([[(7 * i + 3 * r) % 1000 + 100 for i in range(16)] for r in range(batch)])  # [B, 16]
    token = model(prompt, cache=cache)[:, -1].argmax(-1)[:, None]  # [B, 1]
    for _ in range(2):
        token = model(token, cache=cache)[:, -1].argmax(-1)[:, None]
    mx.eval(token)
    t0 = time.perf_counter()
    for _ in range(steps):
        token = model(token, cache=cache)[:, -1].argmax(-1)[:, None]
        mx.eval(token)
    return steps / (time.perf_counter() - t0)


def profile_model(a) -> list[dict]:
    from mola.lora.pack import AdapterPacks
    from mola.lora.slot_rows import SlotRows, module_rows
    from mola.models.fetch import ensure_smollm
    from mola.models.loader import load_base_model

    if a.model == "real":
        path = str(ensure_smollm())
    else:
        sys.path.insert(0, str(Path(__file__).parent))
        from systems import shaped_model
        path = str(shaped_model(a.model))
    rows = []
    for rank in a.ranks:
        model = load_base_model(path, dtype=a.dtype).model
        packs = AdapterPacks.install(model, max_loras=64, max_rank=rank)
        for s in range(1, 65):  # one random pair per slot and shape: the packs' contents do not matter
            pairs, modules = {}, {}
            for path, layer in packs.layers.items():
                dims = layer.full_dims
                if dims not in pairs:
                    pairs[dims] = (mx.random.normal((dims[0], rank)) * 0.02, mx.random.normal((rank, dims[1])) * 0.02)
                modules[path] = module_rows(layer.geometry, layer.max_rank, layer.dtype, *pairs[dims], 2.0)
            packs.fill(s, SlotRows.of(modules))  # the packs grow to 65 slots of this rank, as loads grow them
            mx.eval(packs.arrays())
        for batch in a.batch:
            sorted_too = batch >= SORT_THRESHOLD and default_sort_threshold() is None
            names = ["base", *WORKLOADS, *(["mixed8 sorted", "mixed64 sorted"] if sorted_too else [])]
            samples = {w: [] for w in names}
            for _ in range(a.repeats):
                for w in names:
                    workload, _, sort = w.partition(" ")
                    samples[w].append(decode_step_rate(model, packs.routing, slots_of(workload, batch), a.steps,
                                                       sort=bool(sort)))
            med = {w: statistics.median(v) for w, v in samples.items()}
            pairs = [("one", "base"), ("mixed8", "one"), ("mixed64", "one")]
            if sorted_too:
                pairs += [(f"{w} sorted", "one") for w in ("mixed8", "mixed64")]
                pairs += [(w, f"{w} sorted") for w in ("mixed8", "mixed64")]
            ratio = {f"{w} / {d}": statistics.median(x / y for x, y in zip(samples[w], samples[d])) for w, d in pairs}
            rows.append({"model": a.model, "rank": rank, "batch": batch, "steps_per_s": med, "ratios": ratio,
                         "step_ms": {w: 1e3 / v for w, v in med.items()}})
            print(f"{a.model} r={rank:<3} B={batch:<3} " + " ".join(f"{w}={1e3 / med[w]:6.1f}ms" for w in names)
                  + "  " + " ".join(f"{k}={v:.2f}" for k, v in ratio.items())
                  + f"  load={os.getloadavg()[0]:.1f}", flush=True)
        del model, packs
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--parts", nargs="+", default=["layers", "model"], choices=["layers", "model"])
    p.add_argument("--model", default="real", choices=["real", "qwen0.5b", "llama1b"],
                   help="model part: SmolLM2-135M-Instruct (real) or a random model in those shapes")
    p.add_argument("--dtype", default="auto", help="model part: mola's --dtype (auto: float32 on a CPU)")
    p.add_argument("--batch", type=int, nargs="+", default=[8, 32])
    p.add_argument("--ranks", type=int, nargs="+", default=[8, 64])
    p.add_argument("--layers", type=int, default=30, help="blocks of SmolLM2's 7 linears (layers part)")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--steps", type=int, default=8, help="decode steps per timing (model part)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "profile_step.json")
    a = p.parse_args()
    maps = Path("/proc/self/maps")
    result = {"args": vars(a) | {"out": str(a.out)}, "mlx": mx.__version__, "device": str(mx.default_device()),
              "openblas": maps.exists() and "openblas" in maps.read_text(), "load_before": os.getloadavg()}
    if "layers" in a.parts:
        result["layers"] = profile_layers(a)
    if "model" in a.parts:
        result["model"] = profile_model(a)
    result["load_after"] = os.getloadavg()
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"milliseconds per evaluation of all the layers / per decode step; wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
