"""Decode speed of a GGUF model by --dtype: kept quantized (MLX's quantized matmul)
against dequantized float32 (and float16), at batch 1 and 8. This is what chose
`--dtype auto` on a CPU (see mola/models/loader.py).

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 \\
        python benchmarks/gguf_dtype.py [--model FILE.gguf] [--dtypes keep float32 float16]
                                        [--batch 1 8] [--steps 32] [--repeats 3]

The model defaults to the real one (SmolLM2-135M-Instruct Q4_1, fetched into mola's
cache). Each figure is the median over --repeats interleaved runs of --steps greedy
decode steps (after a 16-token prefill and two warm-up steps), through mlx-lm's model
and KV cache: tokens per second over all rows; the ratios are the medians of each
repeat's back-to-back ratio to the first dtype. Written to
benchmarks/results/gguf_dtype.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx


def openblas_loaded() -> bool:
    try:
        return "openblas" in Path("/proc/self/maps").read_text()
    except OSError:
        return False


def decode_rate(model, batch: int, steps: int, prompt_len: int = 16) -> float:
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    prompt = mx.array([[(7 * i + 3) % 1000 + 100 for i in range(prompt_len)]] * batch)  # [B, L]
    token = model(prompt, cache=cache)[:, -1].argmax(-1)[:, None]  # [B, 1]
    for _ in range(2):
        token = model(token, cache=cache)[:, -1].argmax(-1)[:, None]
    mx.eval(token)
    t0 = time.perf_counter()
    for _ in range(steps):
        token = model(token, cache=cache)[:, -1].argmax(-1)[:, None]
        mx.eval(token)
    return batch * steps / (time.perf_counter() - t0)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="a GGUF model file (default: SmolLM2-135M-Instruct Q4_1)")
    p.add_argument("--dtypes", nargs="+", default=["keep", "float32", "float16"])
    p.add_argument("--batch", nargs="+", type=int, default=[1, 8])
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "gguf_dtype.json"))
    a = p.parse_args()

    from mola.models.fetch import ensure_smollm
    from mola.models.loader import load_base_model

    path = a.model or str(ensure_smollm())
    models = {d: load_base_model(path, dtype=d).model for d in a.dtypes}
    runs: dict[str, dict[int, list[float]]] = {d: {b: [] for b in a.batch} for d in a.dtypes}
    for r in range(a.repeats):
        for b in a.batch:
            for d in a.dtypes:
                runs[d][b].append(decode_rate(models[d], b, a.steps))
                print(f"repeat {r + 1}: {d:8s} batch {b}: {runs[d][b][-1]:7.1f} tok/s", file=sys.stderr)
    table = {d: {str(b): round(statistics.median(v), 1) for b, v in by.items()} for d, by in runs.items()}
    base = a.dtypes[0]
    # On a shared machine the absolute rates move a lot between repeats; the ratio of
    # two runs made back to back moves less: the median of those paired ratios.
    ratios = {d: {str(b): round(statistics.median(x / y for x, y in zip(runs[d][b], runs[base][b])), 2)
                  for b in a.batch} for d in a.dtypes}
    print(f"\n{'dtype':8s} " + " ".join(f"batch {b:<3d} (x {base})" for b in a.batch))
    for d in a.dtypes:
        print(f"{d:8s} " + " ".join(f"{table[d][str(b)]:7.1f} ({ratios[d][str(b)]:4.1f}x)" for b in a.batch))
    result = {"model": Path(path).name, "device": str(mx.default_device()), "machine": platform.machine(),
              "openblas": openblas_loaded(), "mlx": mx.__version__, "steps": a.steps,
              "repeats": a.repeats, "tok_per_s_median": table, f"paired_ratio_to_{base}_median": ratios,
              "tok_per_s_runs": {d: {str(b): v for b, v in by.items()} for d, by in runs.items()}}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"written to {a.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
