"""A thousand adapters through 16 slots: the host tier, prefetch and fair
admission under open-loop traffic, against the same traffic over 8 resident
adapters and with the host tier off.

    python benchmarks/scale.py [--seconds 180] [--warmup 20] [--adapters 1000] [--rate R]

It builds (once, into benchmarks/.cache) the 88M bench model of serve.py and
--adapters random adapters of rank 8 and 16 (alternating) on every linear.
For each workload (Zipf popularity with alpha 1.0 and 0.5, and uniform) and
each configuration it starts a fresh `mola serve --max-loras 16` on
127.0.0.1 and sends the same Poisson arrivals (seeded) for --seconds:

- tier:      --adapter-dir with every adapter, host tier --cpu-loras entries;
- no-tier:   the same without a host tier;
- resident8: 8 adapters named at start (all resident), the same popularity law over 8.

Streaming chat requests, greedy, --max-tokens tokens each (EOS banned). The
arrival rate, unless given, is 0.9 x what resident8 sustains closed-loop at
--max-num-seqs concurrency (a calibration run first). Reported per run,
counting requests that arrive after --warmup: output tok/s (tokens streamed
in the window after warm-up), TTFT p50/p99 overall and per popularity decile
of adapters, slot hit rate (requests whose adapter was in a slot), host-tier
hit rate (slot loads served from host memory), disk reads per second, RSS
at the end of warm-up and at the end (and less the host tier's own bytes,
which grow by design up to --cpu-loras entries), errors. Summary JSON and a plot go to
benchmarks/results/scale.{json,png}; every request to scale.runs.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from loadgen import Request, RunResult, pct, prompt_for, run_load, send  # noqa: E402
from systems import ADAPTER_KEYS, CACHE, HERE, Server, bench_model, eos_id, mola_body, start_mola  # noqa: E402

WORKLOADS = {"zipf1.0": 1.0, "zipf0.5": 0.5, "uniform": 0.0}  # Zipf exponent of popularity
CONFIGS = ("tier", "no-tier", "resident8")


def scale_adapters(model: Path, n: int) -> Path:
    """``n`` random adapters of rank 8 (even) and 16 (odd) in one directory, built once."""
    from mola.testing.adapter import make_random_adapter

    root = CACHE / f"scale-{n}"
    for i in range(n):
        path = root / f"s{i:04d}"
        if not (path / "adapters.safetensors").is_file():
            make_random_adapter(path, model, rank=8 if i % 2 == 0 else 16, keys=ADAPTER_KEYS,
                                seed=10_000 + i, std=0.02)
            if i % 100 == 99:
                print(f"  built {i + 1}/{n} adapters", file=sys.stderr, flush=True)
    return root


@dataclass
class Arrival:
    at: float  # seconds after the start
    adapter: int  # popularity rank: 0 is the most requested
    prompt: int


def arrivals(rate: float, seconds: float, num_adapters: int, alpha: float, seed: int = 1) -> list[Arrival]:
    """Poisson arrivals at ``rate`` per second; adapter ranks drawn with
    weight 1 / (k + 1) ** alpha (alpha 0: uniform)."""
    rng = random.Random(seed)
    weights = [1.0 / (k + 1) ** alpha for k in range(num_adapters)]
    out, t = [], rng.expovariate(rate)
    while t < seconds:
        out.append(Arrival(t, 0, 1_000_000 + len(out)))
        t += rng.expovariate(rate)
    for a, k in zip(out, rng.choices(range(num_adapters), weights=weights, k=len(out))):
        a.adapter = k
    return out


def read_metrics(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics", timeout=30).text
    out = {}
    for name in ("mola_process_resident_bytes", "mola_host_tier_bytes", "mola_host_tier_hits_total",
                 "mola_host_tier_misses_total",
                 "mola_adapter_reads_total", "mola_adapter_yields_total", "mola_adapter_loads_total"):
        m = re.search(rf"^{name} ([0-9.e+]+)$", text, re.M)
        out[name] = float(m.group(1)) if m else 0.0
    for found in ("resident", "loaded"):
        m = re.search(rf'^mola_adapter_leases_total{{found="{found}"}} ([0-9.e+]+)$', text, re.M)
        out[f"leases_{found}"] = float(m.group(1)) if m else 0.0
    return out


@dataclass
class Run:
    config: str
    workload: str
    planned: int = 0
    requests: list[dict] = field(default_factory=list)  # adapter, arrival, ttft, tokens, chunk times, ok
    metrics: list[tuple[float, dict]] = field(default_factory=list)  # (seconds, /metrics sample)


async def drive(url: str, plan: list[Arrival], names: list[str], max_tokens: int, eos: int,
                seconds: float, drain: float) -> Run:
    """Send ``plan`` open loop; sample /metrics every 2 s; wait up to
    ``drain`` s after the last arrival for the requests still running."""
    run = Run("", "", len(plan))
    limits = httpx.Limits(max_connections=1024, max_keepalive_connections=256)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        t0 = time.perf_counter()

        async def one(a: Arrival):
            await asyncio.sleep(max(0.0, a.at - (time.perf_counter() - t0)))
            req = Request(mola_body(names[a.adapter], prompt_for(a.prompt), max_tokens, eos))
            result = RunResult("mola", "", 0)
            await send(client, req, result)
            run.requests.append({"adapter": a.adapter, "arrival": req.start - t0, "ok": result.completed == 1,
                                 "ttft": (req.timeline[0] - req.start) if req.timeline else None,
                                 "tokens": result.output_tokens, "chunks": [t - t0 for t in req.timeline]})

        async def sample():
            while True:
                run.metrics.append((time.perf_counter() - t0, await asyncio.to_thread(read_metrics, url)))
                await asyncio.sleep(2.0)

        sampler = asyncio.ensure_future(sample())
        tasks = [asyncio.ensure_future(one(a)) for a in plan]
        await asyncio.sleep(seconds)
        done, pending = await asyncio.wait(tasks, timeout=drain)
        for task in pending:
            task.cancel()
        sampler.cancel()
        run.metrics.append((time.perf_counter() - t0, await asyncio.to_thread(read_metrics, url)))
    return run


def summarize(run: Run, num_adapters: int, seconds: float, warmup: float) -> dict:
    measured = [r for r in run.requests if r["arrival"] >= warmup]
    tokens = sum(1 for r in run.requests for t in r["chunks"] if warmup <= t < seconds)
    decile = max(1, num_adapters // 10)
    ttft_by = {}
    for d in range(10):
        vals = [r["ttft"] for r in measured if r["ok"] and r["ttft"] is not None and r["adapter"] // decile == d]
        ttft_by[d] = {"n": len(vals), "p50": pct(vals, 0.5), "p99": pct(vals, 0.99)}
    ttfts = [r["ttft"] for r in measured if r["ok"] and r["ttft"] is not None]
    start = next(m for t, m in run.metrics if t >= warmup) if any(t >= warmup for t, _ in run.metrics) \
        else run.metrics[0][1]
    first, end = run.metrics[0][1], run.metrics[-1][1]
    delta = {k: end[k] - start[k] for k in end}
    hits, misses = delta["mola_host_tier_hits_total"], delta["mola_host_tier_misses_total"]
    resident, loaded = delta["leases_resident"], delta["leases_loaded"]
    window = seconds - warmup
    return {
        "config": run.config, "workload": run.workload, "requests": len(run.requests),
        "measured_requests": len(measured), "tok_s": tokens / window,
        "ttft_p50": pct(ttfts, 0.5), "ttft_p99": pct(ttfts, 0.99), "ttft_by_decile": ttft_by,
        "slot_hit_rate": resident / (resident + loaded) if resident + loaded else None,
        "tier_hit_rate": hits / (hits + misses) if hits + misses else None,
        "disk_reads_per_s": delta["mola_adapter_reads_total"] / (run.metrics[-1][0] - warmup),
        "slot_loads_per_s": delta["mola_adapter_loads_total"] / (run.metrics[-1][0] - warmup),
        "yields": delta["mola_adapter_yields_total"],
        "rss_start_mb": start["mola_process_resident_bytes"] / 2**20,
        "rss_end_mb": end["mola_process_resident_bytes"] / 2**20,
        "rss_first_mb": first["mola_process_resident_bytes"] / 2**20,
        # the host tier grows by design up to its limit: RSS less what it holds
        "rss_less_tier_start_mb": (start["mola_process_resident_bytes"] - start["mola_host_tier_bytes"]) / 2**20,
        "rss_less_tier_end_mb": (end["mola_process_resident_bytes"] - end["mola_host_tier_bytes"]) / 2**20,
        "tier_mb_end": end["mola_host_tier_bytes"] / 2**20,
        "errors": sum(not r["ok"] for r in run.requests),
        "unfinished": run.planned - len(run.requests),  # still running when the drain ended
    }


def start(config: str, model: Path, root: Path, names: list[str], a) -> Server:
    """A fresh mola for ``config`` (16 slots, rank <= 16)."""
    log = a.out.with_suffix(f".{config}.log")
    if config == "resident8":
        return start_mola(model, [root / n for n in names[:8]], 16, 16, a.max_num_seqs, log,
                          extra=("--max-adapter-wait", str(a.max_adapter_wait)))
    extra = ["--adapter-dir", str(root), "--max-adapter-wait", str(a.max_adapter_wait)]
    if config == "tier":
        extra += ["--max-cpu-loras", str(a.cpu_loras)]
    return start_mola(model, [], 16, 16, a.max_num_seqs, log, extra=tuple(extra))


def calibrate(model: Path, root: Path, names: list[str], eos: int, a) -> float:
    """Requests per second resident8 sustains closed-loop, uniform over its 8
    adapters, at --max-num-seqs requests in flight."""
    server = start("resident8", model, root, names, a)
    try:
        n = a.max_num_seqs * 8
        reqs = [Request(mola_body(f"a{i % 8}", prompt_for(900_000 + i), a.max_tokens, eos)) for i in range(n)]
        warm = [Request(mola_body(f"a{i % 8}", prompt_for(800_000 + i), 4, eos)) for i in range(8)]
        asyncio.run(run_load(server.url, warm, 8, RunResult("mola", "warmup", 8), 60))
        result = asyncio.run(run_load(server.url, reqs, a.max_num_seqs, RunResult("mola", "cal", 0),
                                      a.calibrate_seconds))
    finally:
        server.stop()
    return result.completed / result.wall_s


def one_run(config: str, workload: str, rate: float, model: Path, root: Path, names: list[str],
            eos: int, a) -> tuple[Run, dict]:
    server = start(config, model, root, names, a)
    try:
        pool = 8 if config == "resident8" else len(names)
        served = [f"a{i}" for i in range(8)] if config == "resident8" else names
        plan = arrivals(rate, a.seconds, pool, WORKLOADS[workload])
        run = asyncio.run(drive(server.url, plan, served, a.max_tokens, eos, a.seconds, a.drain))
    finally:
        server.stop()
    run.config, run.workload = config, workload
    return run, summarize(run, pool, a.seconds, a.warmup)


def targets(table: list[dict]) -> list[dict]:
    def get(config, workload):
        return next((r for r in table if (r["config"], r["workload"]) == (config, workload)), None)

    out = []
    tier, base = get("tier", "zipf1.0"), get("resident8", "zipf1.0")
    if tier and base:
        out.append({"target": "Zipf 1.0 over the adapters, tok/s / 8 resident", "goal": ">= 0.85",
                    "value": round(tier["tok_s"] / base["tok_s"], 3), "met": tier["tok_s"] >= 0.85 * base["tok_s"]})
    if tier:
        by = tier["ttft_by_decile"]
        hot, cold = by[0]["p99"], by[9]["p99"]
        ratio = cold / hot if by[9]["n"] and by[0]["n"] and hot else float("nan")
        out.append({"target": "Zipf 1.0: p99 TTFT coldest decile / hottest", "goal": "<= 3",
                    "value": round(ratio, 2), "met": ratio <= 3, "samples": [by[0]["n"], by[9]["n"]]})
    for r in table:
        growth = r["rss_less_tier_end_mb"] / r["rss_less_tier_start_mb"] - 1
        raw = r["rss_end_mb"] / r["rss_start_mb"] - 1
        out.append({"target": f"RSS less host tier after warm-up, {r['config']} {r['workload']}",
                    "goal": "<= +5%", "value": f"{growth * 100:+.1f}%", "met": growth <= 0.05,
                    "raw_rss": f"{raw * 100:+.1f}%"})
    errors = sum(r["errors"] + r["unfinished"] for r in table)
    out.append({"target": "errors (and requests unfinished)", "goal": "0", "value": errors, "met": errors == 0})
    return out


def format_table(table: list[dict]) -> str:
    head = (f"{'config':<10} {'workload':<8} {'req':>5} {'tok/s':>7} {'ttft p50/p99 s':>15} {'slot hit':>8} "
            f"{'tier hit':>8} {'reads/s':>7} {'rss MB start/end':>17} {'tier MB':>7} {'err':>4}")
    lines = [head, "-" * len(head)]
    for r in table:
        f = lambda v: "-" if v is None else f"{v:.2f}"  # noqa: E731
        lines.append(f"{r['config']:<10} {r['workload']:<8} {r['requests']:>5} {r['tok_s']:>7.1f} "
                     f"{r['ttft_p50']:>7.2f}/{r['ttft_p99']:<7.2f} {f(r['slot_hit_rate']):>8} "
                     f"{f(r['tier_hit_rate']):>8} {r['disk_reads_per_s']:>7.2f} "
                     f"{r['rss_start_mb']:>8.0f}/{r['rss_end_mb']:<8.0f} {r['tier_mb_end']:>7.0f} "
            f"{r['errors'] + r['unfinished']:>4}")
    lines.append("\nTTFT p99 (s) by popularity decile (0: the most requested tenth of the adapters; n requests):")
    for r in table:
        cells = " ".join(f"{v['p99']:5.2f}({v['n']})" if v["n"] else "    -   " for v in r["ttft_by_decile"].values())
        lines.append(f"  {r['config']:<10} {r['workload']:<8} {cells}")
    return "\n".join(lines)


def plot(table: list[dict], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install -e '.[bench]')", file=sys.stderr)
        return False
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    workloads = [w for w in WORKLOADS if any(r["workload"] == w for r in table)]
    for i, config in enumerate(CONFIGS):
        rows = {r["workload"]: r for r in table if r["config"] == config}
        xs = [j + (i - 1) * 0.27 for j in range(len(workloads))]
        left.bar(xs, [rows[w]["tok_s"] if w in rows else 0 for w in workloads], width=0.27, label=config)
    left.set_xticks(range(len(workloads)), workloads)
    left.set_ylabel("output tokens / s")
    left.set_title("throughput at the same Poisson arrivals")
    left.legend(fontsize=8)
    for r in table:
        if r["config"] == "resident8":
            continue
        by = r["ttft_by_decile"]
        ds = [d for d in range(10) if by[d]["n"]]
        right.plot(ds, [by[d]["p99"] for d in ds], marker="o", label=f"{r['config']} {r['workload']}")
    right.set_xlabel("popularity decile of adapters (0: most requested)")
    right.set_ylabel("TTFT p99 (s)")
    right.set_title("time to first token by adapter popularity")
    right.legend(fontsize=8)
    for ax in (left, right):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=180, help="arrivals per run (default 180)")
    p.add_argument("--warmup", type=float, default=20, help="seconds of each run not measured (default 20)")
    p.add_argument("--drain", type=float, default=120, help="seconds to let requests finish after a run")
    p.add_argument("--adapters", type=int, default=1000)
    p.add_argument("--rate", type=float, help="requests per second (default: 0.9 x resident8's closed-loop rate)")
    p.add_argument("--calibrate-seconds", type=float, default=30)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--cpu-loras", type=int, default=256, help="--max-cpu-loras of the tier config (default 256)")
    p.add_argument("--max-adapter-wait", type=float, default=2.0)
    p.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    p.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    p.add_argument("--out", type=Path, default=HERE / "results" / "scale.json")
    a = p.parse_args()

    model = bench_model()
    root = scale_adapters(model, a.adapters)
    names = [f"s{i:04d}" for i in range(a.adapters)]
    eos = eos_id(model)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    rate = a.rate or 0.9 * calibrate(model, root, names, eos, a)
    print(f"arrival rate {rate:.2f} requests/s", file=sys.stderr, flush=True)
    table, runs = [], []
    for workload in a.workloads:
        for config in a.configs:
            run, row = one_run(config, workload, rate, model, root, names, eos, a)
            runs.append(run)
            table.append(row)
            print(f"  {config:<10} {workload:<8} {row['tok_s']:6.1f} tok/s  ttft p99 {row['ttft_p99']:.2f} s  "
                  f"errors {row['errors']} unfinished {row['unfinished']}", file=sys.stderr, flush=True)
    print(format_table(table))
    goals = targets(table)
    print("\nTargets:")
    for t in goals:
        raw = f"  (raw RSS {t['raw_rss']})" if "raw_rss" in t else ""
        print(f"  {t['target']:<58} {t['value']!s:>8}  (goal {t['goal']}) {'met' if t['met'] else 'MISSED'}{raw}")
    a.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(a).items()}, "rate": rate,
                                 "table": table, "targets": goals}, indent=1))
    a.out.with_suffix(".runs.json").write_text(json.dumps([asdict(r) for r in runs]))
    if plot(table, a.out.with_suffix(".png")):
        print(f"wrote {a.out} and {a.out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
