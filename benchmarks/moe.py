"""Mixed adapters on a mixture of experts: what LoRA on the experts costs when
requests for different adapters share one batch, measured side by side in
one run on one mola server.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 \
        python benchmarks/moe.py [--concurrency 8 32] [--repeats 2] [--max-tokens 32] [--requests 2] [--steps 30]

The model is random, in Qwen3-30B-A3B's proportions scaled to this machine:
128 experts, 8 of them per token, expert width / hidden width = 768 / 2048,
8 query heads per KV head, in 4 layers of width 512 (Qwen3-30B-A3B: 48
layers of width 2048), float32. Adapters: 8 of rank 8 on attention (q, k, v,
o) and the experts (gate, up, down) in every layer, and 8 of rank 8 on
attention alone; all resident (--max-loras 16, --max-expert-loras 8).

Workloads: base (every request on the base model), one (every request on
expert adapter e0), mixed8 (round robin over e0..e7), one_attn and
mixed8_attn (the attention-only adapters). It prints the median tok/s over
repeats, the ratios of benchmarks/README.md's MoE targets, and the bytes of
one slot, and writes the summary to benchmarks/results/moe.json.

Then, in this process, the time of one decode step (B rows of one token,
the same adapters in slots, the workloads interleaved, --steps of each): the
same ratios without HTTP, tokenizing or scheduling, which a shared machine's
noise moves less.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from loadgen import Request, RunResult, prompt_for, run_load  # noqa: E402
from systems import CACHE, HERE, eos_id, mola_body, start_mola  # noqa: E402

HIDDEN, EXPERTS, TOP_K, EXPERT_WIDTH = 512, 128, 8, 192  # 192 / 512 = 768 / 2048
LAYERS, HEADS, KV_HEADS, RANK = 4, 8, 1, 8
WORKLOADS = ("base", "one", "mixed8", "one_attn", "mixed8_attn")


def moe_model(cache: Path = CACHE) -> Path:
    from mola.testing.model import TinyModelSpec, make_tiny_model

    path = cache / "moe-qwen3-30b-a3b-proportions"
    if not (path / "config.json").is_file():
        spec = TinyModelSpec(model_type="qwen3_moe", hidden_size=HIDDEN, num_hidden_layers=LAYERS,
                             intermediate_size=4 * HIDDEN, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                             vocab_size=8192, max_position_embeddings=4096, weight_gain=1.0,
                             num_experts=EXPERTS, num_experts_per_tok=TOP_K, moe_intermediate_size=EXPERT_WIDTH)
        make_tiny_model(path, spec)
    return path


def moe_adapters(model: Path, cache: Path = CACHE) -> tuple[list[Path], list[Path]]:
    """8 adapters on attention + experts, 8 on attention alone (rank 8, every layer)."""
    from mola.testing.adapter import make_mlx_lm_loras

    attention = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")
    experts = tuple(f"mlp.switch_mlp.{p}" for p in ("gate_proj", "up_proj", "down_proj"))
    out = []
    for prefix, keys in (("moe-experts", attention + experts), ("moe-attn", attention)):
        paths = [cache / f"{prefix}-r{RANK}-{i}" for i in range(8)]
        todo = [(p, 200 + i) for i, p in enumerate(paths) if not (p / "adapters.safetensors").is_file()]
        if todo:
            make_mlx_lm_loras(todo, model, rank=RANK, keys=keys, std=0.02)
        out.append(paths)
    return out[0], out[1]


def model_ids(workload: str, n: int) -> list[str]:
    if workload == "base":
        return ["base"] * n
    kind = "b" if workload.endswith("_attn") else "a"  # a0..a7 expert adapters, a8..a15 attention-only
    first = 8 if kind == "b" else 0
    if workload.startswith("one"):
        return [f"a{first}"] * n
    return [f"a{first + i % 8}" for i in range(n)]


async def measure(url: str, workload: str, concurrency: int, n: int, max_tokens: int, eos: int,
                  offset: int) -> RunResult:
    requests = [Request(mola_body(m, prompt_for(offset + i), max_tokens, eos))
                for i, m in enumerate(model_ids(workload, n))]
    result = RunResult("mola", workload, concurrency)
    return await run_load(url, requests, concurrency, result, max_seconds=600)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[8, 32])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--requests", type=int, default=2, help="requests per concurrency slot and setting")
    ap.add_argument("--steps", type=int, default=30, help="in-process decode steps per workload and batch size")
    ap.add_argument("--steps-only", action="store_true", help="only the in-process step times")
    args = ap.parse_args()
    CACHE.mkdir(parents=True, exist_ok=True)
    (HERE / "results").mkdir(exist_ok=True)
    model = moe_model()
    expert_adapters, attention_adapters = moe_adapters(model)
    if args.steps_only:  # into the last run's summary, if any
        out = HERE / "results" / "moe.json"
        summary = json.loads(out.read_text()) if out.is_file() else {}
        summary["step_ms"] = step_times(model, expert_adapters + attention_adapters, args.concurrency, args.steps)
        out.write_text(json.dumps(summary, indent=2))
        return 0
    eos = eos_id(model)
    server = start_mola(model, expert_adapters + attention_adapters, max_loras=16, max_rank=RANK,
                        max_num_seqs=max(args.concurrency), log=HERE / "results" / "moe-mola.log",
                        extra=("--max-expert-loras", "8", "--max-expert-lora-rank", str(RANK),
                               "--prompt-cache-bytes", "0"))
    rates: dict[tuple[str, int], list[float]] = {}
    try:
        adapters = {a["id"]: a for a in __import__("httpx").get(server.url + "/v1/adapters").json()["data"]}
        offset = 0
        for rep in range(args.repeats):
            for c in args.concurrency:
                for w in WORKLOADS:  # interleaved within each repeat
                    r = asyncio.run(measure(server.url, w, c, c * args.requests, args.max_tokens, eos, offset))
                    offset += c * args.requests
                    assert r.errors == 0, f"{w} c={c}: {r.errors} errors"
                    rates.setdefault((w, c), []).append(r.tok_s)
                    print(f"[repeat {rep + 1}] {w:12s} c={c:<3d} {r.tok_s:7.1f} tok/s", flush=True)
        metrics = __import__("httpx").get(server.url + "/metrics").text
    finally:
        server.stop()
    median = {k: statistics.median(v) for k, v in rates.items()}
    summary = {"model": str(model), "args": vars(args), "tok_s": {f"{w}@{c}": v for (w, c), v in median.items()},
               "ratios": {}, "bytes": {}}
    print(f"\n{'workload':12s} " + " ".join(f"c={c:<8d}" for c in args.concurrency))
    for w in WORKLOADS:
        print(f"{w:12s} " + " ".join(f"{median[(w, c)]:<10.1f}" for c in args.concurrency))
    print()
    for c in args.concurrency:
        ratios = {"mixed8 / one": median[("mixed8", c)] / median[("one", c)],
                  "one / base": median[("one", c)] / median[("base", c)],
                  "mixed8_attn / one_attn": median[("mixed8_attn", c)] / median[("one_attn", c)]}
        summary["ratios"][c] = ratios
        print(f"c={c}: " + ", ".join(f"{k} {v:.2f}" for k, v in ratios.items()))
    packs = {line.split("{")[1].split('"')[1]: float(line.split()[-1]) for line in metrics.splitlines()
             if line.startswith("mola_lora_pack_bytes{")}
    summary["bytes"] = {
        "expert adapter (factors as read)": adapters["a0"]["nbytes"],
        "of which experts": adapters["a0"]["expert_nbytes"],
        "attention-only adapter": adapters["a8"]["nbytes"],
        "dense packs (17 slots)": packs["dense"], "expert packs (8 slots)": packs["experts"],
        "one expert slot on the device": packs["experts"] / 8, "one dense slot on the device": packs["dense"] / 17,
    }
    for k, v in summary["bytes"].items():
        print(f"{k}: {v / 2**20:.2f} MiB")
    summary["step_ms"] = step_times(model, expert_adapters + attention_adapters, args.concurrency, args.steps)
    (HERE / "results" / "moe.json").write_text(json.dumps(summary, indent=2))
    return 0


def step_times(model: Path, adapters: list[Path], batches: list[int], steps: int) -> dict:
    """Median decode step time (ms) of each workload at each batch size, in
    process, interleaved; and the ratios of tok/s (the inverse of time)."""
    import time

    import mlx.core as mx
    from mlx_lm import load

    from mola.blas import find_openblas
    from mola.lora.pack import AdapterPacks
    from mola.adapters.recipe import read_checked

    lib = find_openblas()
    if lib and lib not in os.environ.get("LD_PRELOAD", ""):
        print(f"warning: the in-process steps run on MLX's reference BLAS; run with LD_PRELOAD={lib}")
    net, _ = load(str(model))
    packs = AdapterPacks.install(net, max_loras=16, max_rank=RANK, expert_slots=8, max_expert_rank=RANK)
    for slot, path in enumerate(adapters, start=1):  # experts e0..e7 in 1..8, attention-only in 9..16
        packs.fill_from(slot, read_checked(str(path), packs.geometry, None))
    mx.eval(packs.arrays())
    out = {}
    for b in batches:
        # A different token in each row: identical rows would pick the same
        # experts, and a workload whose adapters make rows differ would pay
        # for more distinct experts in the base itself.
        x = mx.array([[11 + 37 * i] for i in range(b)])
        cases = {"base": [0] * b, "one": [1] * b, "mixed8": [1 + i % 8 for i in range(b)],
                 "one_attn": [9] * b, "mixed8_attn": [9 + i % 8 for i in range(b)]}
        times: dict[str, list[float]] = {w: [] for w in cases}
        for i in range(steps + 3):
            for w, slots in cases.items():
                packs.routing.set(slots)
                t = time.perf_counter()
                mx.eval(net(x))
                if i >= 3:  # warm-up steps not counted
                    times[w].append(time.perf_counter() - t)
        ms = {w: statistics.median(v) * 1e3 for w, v in times.items()}
        ratios = {"mixed8 / one": ms["one"] / ms["mixed8"], "one / base": ms["base"] / ms["one"],
                  "mixed8_attn / one_attn": ms["one_attn"] / ms["mixed8_attn"]}
        out[b] = {"ms": ms, "ratios": ratios}
        print(f"in-process B={b}: " + ", ".join(f"{w} {v:.1f} ms" for w, v in ms.items()))
        print(f"in-process B={b}: " + ", ".join(f"{k} {v:.2f}" for k, v in ratios.items()))
    return out


if __name__ == "__main__":
    sys.exit(main())
