"""Two base models in one mola (issue 27): the real SmolLM2-135M-Instruct and
the 88M bench model, each with 8 random rank-8 adapters: each base's
throughput while both take traffic against its throughput alone; the cold
load of a base; and memory over load/unload cycles.

    python benchmarks/bases.py [--requests 32] [--max-tokens 16] [--concurrency 8] [--repeats 3] [--cycles 10]
                               [--parts throughput cycles]

Runs, each on a fresh server on 127.0.0.1 (OpenBLAS preloaded, as `mola
serve` does by itself):

1. throughput: one mola declaring both bases ([[models]], the bench model the
   default, so the real model is cold). First the cold request: one request to
   the real model, whose TTFT is its load; then a warm one. Then --repeats
   interleaved rounds of: the real base alone (the bench base loaded and idle),
   the bench base alone, and both at once (the same requests of both bases
   interleaved: even real, odd bench), each at --concurrency, its requests
   round robin over the base's 8 adapters. In the mixed run each base's
   throughput is its tokens over the run's wall time; its ratio is that over
   its throughput alone (medians over rounds). Two bases sharing the CPU: 0.5
   is the ceiling when each alone already fills it;
2. cycles: --max-loaded-models 1, requests alternating between the bases, so
   every request swaps them: MLX's active memory and the process's RSS (from
   /metrics) after the first cycle and after --cycles of them.

EOS is banned (logit_bias), so every request decodes --max-tokens tokens.
Writes benchmarks/results/bases.json (the servers' logs: results/bases-*.log).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import statistics
import subprocess
import sys
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from loadgen import Request, RunResult, prompt_for, run_load  # noqa: E402
from systems import CACHE, HERE, Server, _wait, bench_adapters, bench_env, bench_model, eos_id, free_port, mola_body, \
    real_model  # noqa: E402

RESULTS = HERE / "results"
BASES = ("real", "bench")
PREFIX = {"real": "r", "bench": "b"}


def toml_list(adapters: list[Path], prefix: str) -> str:
    return "[" + ", ".join(f'{{ name = "{prefix}{i}", path = "{p}" }}' for i, p in enumerate(adapters)) + "]"


def start(name: str, models: list[tuple[str, Path, list[Path]]], log: Path, concurrency: int,
          extra: tuple[str, ...] = ()) -> Server:
    """A mola declaring ``models`` (name, model, adapters) in a config file, the first the default."""
    config = CACHE / f"{log.stem}.toml"
    config.write_text("".join(
        f'[[models]]\nname = "{n}"\nmodel = "{m}"\nadapters = {toml_list(a, PREFIX[n])}\n\n' for n, m, a in models))
    port = free_port()
    args = [sys.executable, "-m", "mola", "serve", "--config", str(config), "--host", "127.0.0.1",
            "--port", str(port), "--max-loras", "8", "--max-lora-rank", "8", "--max-num-seqs", str(concurrency),
            "--log-level", "info", "--allow-any-adapter-path", "--no-ui", *extra]
    proc = subprocess.Popen(args, env=bench_env(), stdout=log.open("w"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    _wait(url, proc, "/health")
    return Server(name, url, proc)


def bodies(bases: list[str], n: int, max_tokens: int, eos: dict) -> list[tuple[str, dict]]:
    """Request i goes to bases[i % len(bases)], round robin over its 8 adapters."""
    out = []
    for i in range(n):
        base = bases[i % len(bases)]
        adapter = f"{PREFIX[base]}{(i // len(bases)) % 8}"
        out.append((base, mola_body(adapter, prompt_for(i), max_tokens, eos[base])))
    return out


def load(url: str, jobs: list[tuple[str, dict]], concurrency: int) -> dict[str, RunResult]:
    """Run ``jobs`` at ``concurrency``; one RunResult per base (sharing the
    run's wall time; every request decodes its max_tokens, EOS being banned)."""
    per_base = {b: RunResult("mola", b, concurrency) for b in {b for b, _ in jobs}}
    everything = RunResult("mola", "all", concurrency)

    async def go():
        requests = [Request(body) for _, body in jobs]
        await run_load(url, requests, concurrency, everything, max_seconds=600)
        for (base, _), req in zip(jobs, requests):
            r = per_base[base]
            r.requests += 1
            if req.timeline and req.end:
                r.completed += 1
                r.output_tokens += req.body["max_tokens"]
                r.ttft.append(req.timeline[0] - req.start)

    asyncio.run(go())
    for r in per_base.values():
        r.wall_s = everything.wall_s
    if everything.errors:
        raise RuntimeError(f"{everything.errors} requests failed")
    return per_base


def one_request(url: str, body: dict) -> float:
    """TTFT of one streamed request, in seconds."""
    result = RunResult("mola", "one", 1)
    req = Request(body)
    asyncio.run(run_load(url, [req], 1, result, max_seconds=600))
    if result.errors or not req.timeline:
        raise RuntimeError("the request failed")
    return req.timeline[0] - req.start


def metric(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics", timeout=30).text
    return float(re.search(rf"^{name} (\S+)$", text, re.M).group(1))


def load_times(log: Path) -> dict[str, list[float]]:
    """Every "loaded base NAME in S s" line of a server's log."""
    out: dict[str, list[float]] = {}
    for name, seconds in re.findall(r"loaded base (\S+) in ([\d.]+) s", log.read_text()):
        out.setdefault(name, []).append(float(seconds))
    return out


def run_throughput(models, eos, n, c, t, repeats: int) -> dict:
    """One mola declaring both bases: the real one's cold first request, then
    ``repeats`` interleaved rounds of: each base alone (the other idle), both
    at once."""
    log = RESULTS / "bases-both.log"
    server = start("both", [("bench", *models["bench"]), ("real", *models["real"])], log, c)
    runs: dict[str, list[float]] = {"real alone": [], "bench alone": [], "real both": [], "bench both": []}
    try:
        cold = one_request(server.url, bodies(["real"], 1, t, eos)[0][1])
        warm = one_request(server.url, bodies(["real"], 2, t, eos)[1][1])
        load(server.url, bodies(["real", "bench"], min(2 * n, 16), t, eos), c)  # warm-up
        for r in range(repeats):
            for base in BASES:
                runs[f"{base} alone"].append(load(server.url, bodies([base], n, t, eos), c)[base].tok_s)
            both = load(server.url, bodies(["real", "bench"], 2 * n, t, eos), c)
            for base in BASES:
                runs[f"{base} both"].append(both[base].tok_s)
            print(f"round {r + 1}: " + ", ".join(f"{k} {v[-1]:.1f}" for k, v in runs.items()) + " tok/s", flush=True)
    finally:
        server.stop()
    median = {k: statistics.median(v) for k, v in runs.items()}
    out = {"runs_tok_s": runs, "alone_tok_s": {b: median[f"{b} alone"] for b in BASES},
           "both_tok_s": {b: median[f"{b} both"] for b in BASES},
           "ratio": {b: median[f"{b} both"] / median[f"{b} alone"] for b in BASES},
           "cold_real_ttft_s": cold, "warm_real_ttft_s": warm, "load_s": load_times(log)}
    print("both ÷ alone (medians): " + ", ".join(f"{b} {r:.2f}" for b, r in out["ratio"].items()))
    print(f"the real base cold: TTFT {cold:.2f} s (warm {warm:.2f} s); loads {out['load_s']}", flush=True)
    return out


def run_cycles(models, eos, c, cycles: int) -> dict:
    server = start("cycles", [("bench", *models["bench"]), ("real", *models["real"])], RESULTS / "bases-cycles.log",
                   c, extra=("--max-loaded-models", "1"))
    try:
        memory = []
        for i in range(2 * cycles + 1):  # request i loads the base request i - 1 did not use
            base = BASES[i % 2]
            one_request(server.url, bodies([base], 1, 2, eos)[0][1])
            memory.append({"base": base, "active_bytes": metric(server.url, "mola_memory_active_bytes"),
                           "rss_bytes": metric(server.url, "mola_process_resident_bytes")})
    finally:
        server.stop()
    first, last = memory[2], memory[-1]  # the real base loaded again after 1 cycle, and after `cycles`
    out = {"cycles": cycles, "memory": memory, "active_ratio": last["active_bytes"] / first["active_bytes"],
           "rss_ratio": last["rss_bytes"] / first["rss_bytes"]}
    print(f"memory, {first['base']} loaded after 1 cycle and after {cycles}: active × "
          f"{out['active_ratio']:.3f}, RSS × {out['rss_ratio']:.3f}")
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=32, help="requests per base in each run")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3, help="interleaved rounds of alone, alone, both")
    p.add_argument("--cycles", type=int, default=10, help="load/unload cycles of each base")
    p.add_argument("--parts", nargs="+", default=["throughput", "cycles"], choices=["throughput", "cycles"])
    p.add_argument("--out", type=Path, default=RESULTS / "bases.json")
    args = p.parse_args()
    RESULTS.mkdir(exist_ok=True)
    CACHE.mkdir(exist_ok=True)

    gguf, converted = real_model()
    bench = bench_model()
    models = {"real": (gguf, bench_adapters(converted, 8, 8, prefix="real-adapter")),
              "bench": (bench, bench_adapters(bench, 8, 8))}
    eos = {"real": eos_id(converted), "bench": eos_id(bench)}
    n, c, t = args.requests, args.concurrency, args.max_tokens
    out: dict = {"requests_per_base": n, "max_tokens": t, "concurrency": c, "load_before": _load_avg()}
    if "throughput" in args.parts:
        out.update(run_throughput(models, eos, n, c, t, args.repeats))
    if "cycles" in args.parts:
        out["cycles"] = run_cycles(models, eos, c, args.cycles)
    out["load_after"] = _load_avg()
    args.out.write_text(json.dumps(out, indent=1))
    print(f"wrote {args.out}")
    return 0


def _load_avg() -> float:
    return float(Path("/proc/loadavg").read_text().split()[0]) if Path("/proc/loadavg").exists() else float("nan")


if __name__ == "__main__":
    sys.exit(main())
