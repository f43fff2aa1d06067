"""Two base models in one mola (issue 27): the real SmolLM2-135M-Instruct and
the 88M bench model, each with 8 random rank-8 adapters: each base's
throughput while both take traffic against its throughput alone; the cold
load of a base; and memory over load/unload cycles.

    python benchmarks/bases.py [--requests 64] [--seconds 20] [--max-tokens 16] [--concurrency 8] [--repeats 3]
                               [--cycles 10]
                               [--parts throughput cycles]

Runs, each on a fresh server on 127.0.0.1 (OpenBLAS preloaded, as `mola
serve` does by itself):

1. throughput: one mola declaring both bases ([[models]], the bench model the
   default, so the real model is cold). First the cold request: one request to
   the real model, whose TTFT is its load; then a warm one. Then --repeats
   interleaved rounds of: each base alone at --concurrency c (the other base
   loaded and idle), each alone at c/2, and both at once with c/2 clients each
   (c in all), every run's requests round robin over its base's 8 adapters,
   no new request after --seconds. A base's throughput is its tokens over its
   own wall time; its ratio is that, both at once, over its throughput alone
   at c (the issue's), and alone at c/2 (the same clients: the CPU's share
   alone, without the smaller batch). Medians over rounds. Two bases sharing
   the CPU: 0.5 is the ceiling when each alone already fills it;
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


def streams(url: str, per_base: dict[str, tuple[list[dict], int]], seconds: float) -> dict[str, RunResult]:
    """Each base's requests from clients of its own (base -> (bodies, clients)),
    all bases at once, no new request after ``seconds``: each base's tokens
    over its own wall time (every request decodes its max_tokens, EOS being banned)."""
    results = {b: RunResult("mola", b, c) for b, (_, c) in per_base.items()}
    requests = {b: [Request(body) for _, body in jobs] for b, (jobs, _) in per_base.items()}

    async def go():
        await asyncio.gather(*(run_load(url, requests[b], per_base[b][1], results[b], max_seconds=seconds)
                               for b in per_base))

    asyncio.run(go())
    for b, r in results.items():
        done = [q for q in requests[b] if q.timeline and q.end]
        r.output_tokens = sum(q.body["max_tokens"] for q in done)
        if r.errors:
            raise RuntimeError(f"{r.errors} requests to {b} failed")
    return results


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


def run_throughput(models, eos, n, c, t, seconds: float, repeats: int) -> dict:
    """One mola declaring both bases: the real one's cold first request, then
    ``repeats`` interleaved rounds of: each base alone at c (the other loaded
    and idle), each alone at c/2, and both at once, c/2 clients each."""
    log = RESULTS / "bases-both.log"
    server = start("both", [("bench", *models["bench"]), ("real", *models["real"])], log, c)
    half = max(1, c // 2)
    runs: dict[str, list[float]] = {f"{b} {k}": [] for k in ("alone", "alone c/2", "both") for b in BASES}
    try:
        cold = one_request(server.url, bodies(["real"], 1, t, eos)[0][1])
        warm = one_request(server.url, bodies(["real"], 2, t, eos)[1][1])
        streams(server.url, {b: (bodies([b], c, t, eos), c) for b in BASES}, seconds)  # warm-up
        for r in range(repeats):
            for base in BASES:
                for kind, clients in (("alone", c), ("alone c/2", half)):
                    run = streams(server.url, {base: (bodies([base], n, t, eos), clients)}, seconds)
                    runs[f"{base} {kind}"].append(run[base].tok_s)
            both = streams(server.url, {b: (bodies([b], n, t, eos), half) for b in BASES}, seconds)
            for base in BASES:
                runs[f"{base} both"].append(both[base].tok_s)
            print(f"round {r + 1}: " + ", ".join(f"{k} {v[-1]:.1f}" for k, v in runs.items()) + " tok/s", flush=True)
    finally:
        server.stop()
    median = {k: statistics.median(v) for k, v in runs.items()}
    out = {"runs_tok_s": runs, "median_tok_s": median,
           "ratio": {b: median[f"{b} both"] / median[f"{b} alone"] for b in BASES},
           "ratio_same_clients": {b: median[f"{b} both"] / median[f"{b} alone c/2"] for b in BASES},
           "cold_real_ttft_s": cold, "warm_real_ttft_s": warm, "load_s": load_times(log)}
    print("both ÷ alone at c (medians): " + ", ".join(f"{b} {r:.2f}" for b, r in out["ratio"].items()))
    print("both ÷ alone at c/2: " + ", ".join(f"{b} {r:.2f}" for b, r in out["ratio_same_clients"].items()))
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
    p.add_argument("--requests", type=int, default=64, help="at most this many requests per base in a run")
    p.add_argument("--seconds", type=float, default=20, help="no new request after this, per run")
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
        out.update(run_throughput(models, eos, n, c, t, args.seconds, args.repeats))
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
