"""Structured-output benchmark: decode tok/s of mola with 0%, 50% and 100% of
the rows under a json_schema, at each concurrency, side by side in one run,
and the time to compile a schema.

    python benchmarks/structured.py [--concurrency 8 32] [--repeats 3] [--max-tokens 32]

The model and adapters are serve.py's (88M float32 llama, random rank-16
adapters, built once into benchmarks/.cache); requests go round robin over
the base and 3 adapters, greedy, EOS banned with logit_bias so that every
request decodes exactly --max-tokens tokens. The schema (a title and at
least 64 rows of id / name / tags / ok) cannot close within that budget, so
constrained rows decode as many tokens as free ones, through object,
string, number, enum and array states. Fractions are interleaved inside each
repeat; figures are medians over repeats; the target is >= 0.9x of the
unconstrained tok/s at 50%. Compile time is measured in-process on the same
tokenizer (cold: distinct schemas, so the cache never answers).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from loadgen import Request, RunResult, format_table, prompt_for, run_load, summarize  # noqa: E402
from systems import HERE, bench_adapters, bench_model, eos_id, mola_body, start_mola  # noqa: E402

ROW = {"type": "object", "additionalProperties": False, "required": ["id", "name", "tags", "ok"],
       "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 9999},
                      "name": {"type": "string", "maxLength": 12},
                      "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
                      "ok": {"type": "boolean"}}}


def schema(title_len: int = 24) -> dict:
    return {"type": "object", "additionalProperties": False, "required": ["title", "rows"],
            "properties": {"title": {"type": "string", "maxLength": title_len},
                           "rows": {"type": "array", "items": ROW, "minItems": 64}}}


def response_format(title_len: int = 24) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "rows", "schema": schema(title_len), "strict": True}}


FRACTIONS = (0.0, 0.5, 1.0)
MODELS = ("base", "a0", "a1", "a2")


def requests_for(fraction: float, n: int, max_tokens: int, eos: int, offset: int) -> list[Request]:
    out = []
    for i in range(n):
        body = mola_body(MODELS[i % len(MODELS)], prompt_for(offset + i), max_tokens, eos)
        # the first round(fraction * n) of every 2: 0 -> none, 0.5 -> every other, 1 -> all
        if (i % 2) < round(fraction * 2):
            body["response_format"] = response_format()
        out.append(Request(body))
    return out


def mask_times(structured, rows: int = 32, steps: int = 50) -> dict:
    """What a step of ``rows`` constrained rows costs the engine thread
    beside the forward pass: filling the bitmask (llguidance's threads) and
    applying it (one where over [B, V]); the rows walk the schema at random."""
    import mlx.core as mx
    import numpy as np

    from mola.engine.constraint import MaskFiller
    from mola.engine.logits import apply_bitmask

    rng = np.random.default_rng(0)
    compiled = structured.for_request(response_format=response_format())
    constraints = [compiled.new_constraint() for _ in range(rows)]
    filler, fill, apply = MaskFiller(), [], []
    logits = mx.random.normal((rows, structured.vocab_size))
    for _ in range(steps):
        t0 = time.perf_counter()
        bitmask = filler.fill(constraints)
        t1 = time.perf_counter()
        mx.eval(apply_bitmask(logits, bitmask))
        apply.append(time.perf_counter() - t1)
        fill.append(t1 - t0)
        bits = np.unpackbits(bitmask.view(np.uint8), axis=1, bitorder="little")
        for i, c in enumerate(constraints):
            c.advance(int(rng.choice(np.nonzero(bits[i, : structured.vocab_size])[0])))
    return {"rows": rows, "fill_ms_median": round(statistics.median(fill) * 1e3, 2),
            "apply_ms_median": round(statistics.median(apply) * 1e3, 2)}


def compile_times(model: Path, num: int = 5) -> dict:
    """Seconds to build llguidance's tokenizer (once per server) and to
    compile distinct schemas (each a cache miss); and the masks' cost."""
    from mlx_lm.utils import load_tokenizer

    from mola.structured import StructuredOutputs

    tokenizer = load_tokenizer(model)
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    structured = StructuredOutputs(tokenizer, vocab)
    t0 = time.perf_counter()
    structured.ll_tokenizer
    setup = time.perf_counter() - t0
    times = []
    for i in range(num):
        t0 = time.perf_counter()
        structured.for_request(response_format=response_format(20 + i))
        times.append(time.perf_counter() - t0)
    return {"tokenizer_s": round(setup, 4), "compile_ms_median": round(statistics.median(times) * 1e3, 2),
            "compile_ms_max": round(max(times) * 1e3, 2), "vocab": vocab, "masks": mask_times(structured)}


def ratios(table: list[dict]) -> list[dict]:
    tok = {(r["workload"], r["concurrency"]): r["tok_s"] for r in table}
    out = []
    for conc in sorted({r["concurrency"] for r in table}):
        free = tok.get(("0%", conc))
        for frac in ("50%", "100%"):
            if free and (frac, conc) in tok:
                value = tok[frac, conc] / free
                out.append({"target": f"c={conc}: {frac} constrained / unconstrained", "value": round(value, 3),
                            "goal": ">= 0.9" if frac == "50%" else "-",
                            "met": value >= 0.9 if frac == "50%" else None})
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, help="model directory (default: the 88M bench model)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[8, 32])
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--requests-per-slot", type=int, default=2, help="requests per run = this x concurrency")
    p.add_argument("--max-seconds", type=float, default=45, help="no new request after this, per run")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--no-openblas", action="store_true", help="the reference BLAS of MLX's wheel")
    p.add_argument("--out", type=Path, default=HERE / "results" / "structured.json")
    a = p.parse_args()

    model = a.model or bench_model()
    adapters = bench_adapters(model, len(MODELS) - 1, 16)
    eos = eos_id(model)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    compile_ = compile_times(model)
    print(f"schema compile: {compile_}", file=sys.stderr, flush=True)
    server = start_mola(model, adapters, len(adapters), 16, max(a.concurrency), a.out.with_suffix(".mola.log"),
                        not a.no_openblas)
    results: list[RunResult] = []
    try:  # warm-up (compiles the schema once; the cache serves it after), not measured
        asyncio.run(run_load(server.url, requests_for(0.5, 8, 8, eos, 90_000), 8, RunResult("mola", "warmup", 8), 120))
        offset = 0
        for rep in range(a.repeats):
            for conc in a.concurrency:
                n = max(4, a.requests_per_slot * conc)
                for frac in FRACTIONS:
                    label = f"{frac:.0%}"
                    reqs = requests_for(frac, n, a.max_tokens, eos, offset)
                    offset += n
                    r = asyncio.run(run_load(server.url, reqs, conc, RunResult("mola", label, conc), a.max_seconds))
                    results.append(r)
                    print(f"  rep {rep} c={conc:<3} {label:>4} constrained {r.tok_s:7.1f} tok/s "
                          f"({r.completed}/{r.requests} requests, {r.errors} errors)", file=sys.stderr, flush=True)
    finally:
        server.stop()

    table = summarize(results)
    print(format_table(table).replace("workload", "constrained"))
    targets = ratios(table)
    print("\nRatios of medians from this run:")
    for t in targets:
        print(f"  {t['target']:<40} {t['value']:>6}  (goal {t['goal']})"
              + ("" if t["met"] is None else " met" if t["met"] else " MISSED"))
    print(f"\nSchema compile (in-process, vocabulary {compile_['vocab']}): llguidance tokenizer "
          f"{compile_['tokenizer_s'] * 1e3:.0f} ms once, then {compile_['compile_ms_median']} ms per new schema "
          f"(max {compile_['compile_ms_max']} ms)")
    masks = compile_["masks"]
    print(f"Masks of {masks['rows']} constrained rows per step: fill {masks['fill_ms_median']} ms, "
          f"apply {masks['apply_ms_median']} ms (medians; overlapped with the forward pass)")
    a.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(a).items()}, "table": table,
                                 "targets": targets, "compile": compile_}, indent=1))
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
