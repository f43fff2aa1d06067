"""Steady decode steps of 8 rows through the in-process Engine (scheduler, KV
budget, runner, layers: the whole per-step path but HTTP), base / one / mixed8
interleaved (issue 43, "also found" item 4). Each workload sends 8 requests of
24 random tokens and 48 new tokens at once; the figure is the median gap
between two steps' outputs while all 8 rows decode, so that prefill and
admission do not enter it. Ratios are taken within a round.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 OPENBLAS_NUM_THREADS=1 \\
        python benchmarks/decode_ab.py MODEL_DIR ROUNDS [RANK] [attn|linears|all] [OUT.json]

MODEL_DIR: e.g. serve.py's 88M model (systems.bench_model()). 64 random
adapters of RANK (16) on q/k/v/o (attn, serve.py's targets), on the seven
linears of every block (linears: q/k/v/o and gate/up/down, PEFT's
"all-linear"), or on every layer mola can wrap (all: those, the token
embedding and the output head) are written straight into the layers' packs, so that the same script
runs on a checkout from before the packs were sized to what is loaded (run it
with that tree's src on PYTHONPATH to compare per-step paths side by side).
"""
import json
import os
import random
import statistics
import sys
import threading
import time

import mlx.core as mx
from mola.engine.config import EngineConfig
from mola.engine.engine import Engine
from mola.engine.sequence import SamplingParams, Sequence
from mola.models.loader import load_base_model

model_dir, rounds = sys.argv[1], int(sys.argv[2])
RANK = int(sys.argv[3]) if len(sys.argv) > 3 else 16
TARGETS = {"attn": ("q_proj", "k_proj", "v_proj", "o_proj"), "all": None,
           "linears": ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")}[
    sys.argv[4] if len(sys.argv) > 4 else "attn"]
MAXTOK = 48  # new tokens per request
stamps, cond = [], threading.Condition()  # (when, process CPU time, rows finished) of each step's outputs


def on_out(outs):
    now, cpu = time.perf_counter(), time.process_time()
    with cond:
        if any(o.tokens for o in outs):
            stamps.append((now, cpu, sum(o.finish_reason is not None for o in outs)))
        cond.notify_all()


eng = Engine(lambda: load_base_model(model_dir), EngineConfig(max_loras=64, max_lora_rank=16, max_num_seqs=10), on_out)
eng.start()


def fill():
    packs = eng.packs
    if hasattr(packs, "_set_slot_capacity"):
        from mola.lora.geometry import bucket
        packs._held.update(range(1, 65))
        packs._set_slot_capacity(bucket(65, packs.num_slots))
    mx.random.seed(0)
    for path, layer in packs.layers.items():
        if TARGETS is not None and not path.endswith(TARGETS):
            continue
        din, dout = layer.full_dims
        a, b = mx.random.normal((din, RANK)) * 0.02, mx.random.normal((RANK, dout)) * 0.02
        for s in range(1, 65):
            layer.set_factors(s, a, b, 2.0)
    mx.eval(packs.arrays())


eng.call(fill).result()
rng = random.Random(1)


def run(workload):
    slots = {"base": lambda i: 0, "one": lambda i: 1, "mixed8": lambda i: 1 + i % 8}[workload]
    stamps.clear()
    seqs = [Sequence(prompt=[rng.randrange(100, 8000) for _ in range(24)],
                     params=SamplingParams(max_tokens=MAXTOK, temperature=0.0), slot=slots(i)) for i in range(8)]
    for s in seqs:
        eng.add(s)
    with cond:
        cond.wait_for(lambda: sum(f for _, _, f in stamps) >= 8, 600)
    wall, cpu = [s[0] for s in stamps], [s[1] for s in stamps]
    gaps = [b - a for a, b in zip(wall[5:-3], wall[6:-2])]  # steady: all rows decoding
    cpu_steps[workload].append((cpu[-3] - cpu[5]) / (len(cpu) - 8))  # CPU seconds a steady step
    return 1.0 / statistics.median(gaps)  # steps per second


cpu_steps = {w: [] for w in ("base", "one", "mixed8")}
run("one")  # warm-up
run("mixed8")
for v in cpu_steps.values():
    v.clear()
res = {w: [] for w in ("base", "one", "mixed8")}
for r in range(rounds):
    order = ["base", "one", "mixed8"] if r % 2 == 0 else ["mixed8", "one", "base"]
    for w in order:
        res[w].append(run(w))
ratios = {"one/base": statistics.median(o / b for o, b in zip(res["one"], res["base"])),
          "mixed8/one": statistics.median(m / o for m, o in zip(res["mixed8"], res["one"])),
          # the same in CPU time a step (every thread of the process): what a busy machine moves least
          "mixed8/one (CPU)": statistics.median(o / m for m, o in zip(cpu_steps["mixed8"], cpu_steps["one"]))}
print({w: round(1e3 / statistics.median(v), 2) for w, v in res.items()}, "ms/step", {k: round(v, 3) for k, v in ratios.items()},
      "mixed8/one each:", [round(m / o, 3) for m, o in zip(res["mixed8"], res["one"])], flush=True)
print({w: round(1e3 * statistics.median(v), 2) for w, v in cpu_steps.items()}, "CPU ms/step; mixed8/one (CPU) each:",
      [round(o / m, 3) for m, o in zip(cpu_steps["mixed8"], cpu_steps["one"])], flush=True)
if len(sys.argv) > 5:  # the rounds' steps per second, the ratios, and the machine's load after the run
    with open(sys.argv[5], "w") as f:
        json.dump({"model": model_dir, "rank": RANK, "targets": sys.argv[4], "rounds": rounds,
                   "steps_per_second": res, "cpu_seconds_per_step": cpu_steps, "ratios": ratios, "loadavg_after": os.getloadavg()}, f, indent=2)
eng.stop()
