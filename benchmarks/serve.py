"""Serving benchmark: mola under mixed-adapter traffic, measured side by side.

Starts the server itself on 127.0.0.1, drives it with an async load generator
(httpx, streaming chat completions, fixed output length with EOS ignored), and
prints one table of medians over interleaved repeats, with JSON beside it.

    python benchmarks/serve.py [--model DIR] [--adapters 8] [--concurrency 8]
                               [--max-tokens 64] [--requests 32] [--repeats 3]

Without --model it builds (once, into benchmarks/.cache) a float32 llama of
~88M parameters with random weights, and K random rank-16 adapters.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent
CACHE = HERE / ".cache"
OPENBLAS = "/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3"
PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


# ---- fixtures -------------------------------------------------------------------


def bench_model(cache: Path = CACHE) -> Path:
    from mola.synthetic.model import TinyModelSpec, make_tiny_model

    path = cache / "model-88m"
    if not (path / "config.json").is_file():
        spec = TinyModelSpec(hidden_size=768, num_hidden_layers=12, intermediate_size=2048,
                             num_attention_heads=12, num_key_value_heads=4, vocab_size=8192,
                             max_position_embeddings=4096, weight_gain=1.0)
        make_tiny_model(path, spec)
    return path


def bench_adapters(model: Path, k: int, rank: int, cache: Path = CACHE) -> list[Path]:
    from mola.synthetic.adapter import make_random_adapter

    keys = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
            "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
    out = []
    for i in range(k):
        path = cache / f"adapter-r{rank}-{i}"
        if not (path / "adapters.safetensors").is_file():
            make_random_adapter(path, model, rank=rank, keys=keys, seed=100 + i, std=0.02)
        out.append(path)
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def bench_env() -> dict:
    env = dict(os.environ)
    if sys.platform == "linux" and Path(OPENBLAS).exists():
        env["LD_PRELOAD"] = OPENBLAS
    return env


# ---- servers --------------------------------------------------------------------


@dataclass
class Server:
    name: str
    url: str
    proc: subprocess.Popen

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def wait_healthy(url: str, proc: subprocess.Popen, path: str, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            if httpx.get(url + path, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError("server did not start")


def start_mola(model: Path, adapters: list[Path], max_loras: int, max_num_seqs: int, log: Path) -> Server:
    port = free_port()
    args = [sys.executable, "-m", "mola", "serve", "--model", str(model), "--host", "127.0.0.1",
            "--port", str(port), "--served-model-name", "base", "--max-loras", str(max_loras),
            "--max-lora-rank", "64", "--max-num-seqs", str(max_num_seqs), "--log-level", "warning"]
    for i, a in enumerate(adapters):
        args += ["--adapter", f"a{i}={a}"]
    proc = subprocess.Popen(args, env=bench_env(), stdout=log.open("w"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url, proc, "/health")
    return Server("mola", url, proc)


# ---- load generator -----------------------------------------------------------------


@dataclass
class RunResult:
    system: str
    workload: str
    concurrency: int
    requests: int
    output_tokens: int
    wall_s: float
    ttft: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)
    e2e: list[float] = field(default_factory=list)
    errors: int = 0

    @property
    def tok_s(self) -> float:
        return self.output_tokens / self.wall_s if self.wall_s else 0.0


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


async def one_request(client: httpx.AsyncClient, body: dict, result: RunResult) -> None:
    t0 = time.perf_counter()
    last = None
    tokens = 0
    try:
        async with client.stream("POST", "/v1/chat/completions", json=body) as resp:
            if resp.status_code != 200:
                await resp.aread()
                result.errors += 1
                return
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
                if not chunk.get("choices") or not chunk["choices"][0]["delta"].get("content"):
                    continue
                now = time.perf_counter()
                if last is None:
                    result.ttft.append(now - t0)
                else:
                    result.itl.append(now - last)
                last = now
    except httpx.HTTPError:
        result.errors += 1
        return
    result.e2e.append(time.perf_counter() - t0)
    result.output_tokens += tokens


async def run_load(url: str, system: str, workload: str, model_ids: list[str], concurrency: int,
                   max_tokens: int) -> RunResult:
    """Send len(model_ids) requests, request i for model_ids[i], at most
    ``concurrency`` in flight."""
    result = RunResult(system, workload, concurrency, len(model_ids), 0, 0.0)
    queue: asyncio.Queue = asyncio.Queue()
    for m in model_ids:
        queue.put_nowait(m)

    async def worker(client):
        while not queue.empty():
            model = queue.get_nowait()
            body = {"model": model, "messages": [{"role": "user", "content": PROMPT}],
                    "max_tokens": max_tokens, "temperature": 0, "stream": True,
                    "stream_options": {"include_usage": True}, "ignore_eos": True}
            await one_request(client, body, result)

    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        t0 = time.perf_counter()
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
        result.wall_s = time.perf_counter() - t0
    return result


def workload_ids(workload: str, n: int, k: int) -> list[str]:
    if workload == "base":
        return ["base"] * n
    if workload == "one":
        return ["a0"] * n
    if workload == "mixed":
        return [f"a{i % k}" for i in range(n)]
    raise ValueError(workload)


# ---- report -----------------------------------------------------------------------


def summarize(results: list[RunResult]) -> list[dict]:
    rows = {}
    for r in results:
        rows.setdefault((r.system, r.workload, r.concurrency), []).append(r)
    table = []
    for (system, workload, conc), runs in rows.items():
        table.append({
            "system": system, "workload": workload, "concurrency": conc, "repeats": len(runs),
            "tok_s": statistics.median(r.tok_s for r in runs),
            "tok_s_all": [round(r.tok_s, 1) for r in runs],
            "ttft_p50": statistics.median(pct(r.ttft, 0.5) for r in runs),
            "ttft_p95": statistics.median(pct(r.ttft, 0.95) for r in runs),
            "itl_p50": statistics.median(pct(r.itl, 0.5) for r in runs),
            "itl_p95": statistics.median(pct(r.itl, 0.95) for r in runs),
            "e2e_p50": statistics.median(pct(r.e2e, 0.5) for r in runs),
            "e2e_p95": statistics.median(pct(r.e2e, 0.95) for r in runs),
            "errors": sum(r.errors for r in runs),
        })
    return table


def print_table(table: list[dict]) -> None:
    head = f"{'system':<8} {'workload':<8} {'conc':>4} {'tok/s':>8} {'ttft p50/p95 ms':>17} " \
           f"{'itl p50/p95 ms':>16} {'e2e p50/p95 s':>15} {'err':>4}"
    print(head)
    print("-" * len(head))
    for r in table:
        print(f"{r['system']:<8} {r['workload']:<8} {r['concurrency']:>4} {r['tok_s']:>8.1f} "
              f"{r['ttft_p50'] * 1e3:>8.0f}/{r['ttft_p95'] * 1e3:<8.0f} "
              f"{r['itl_p50'] * 1e3:>7.1f}/{r['itl_p95'] * 1e3:<8.1f} "
              f"{r['e2e_p50']:>7.2f}/{r['e2e_p95']:<7.2f} {r['errors']:>4}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, help="model directory (default: build the 88M bench model)")
    p.add_argument("--adapters", type=int, default=8, help="K adapters for the mixed workload")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--concurrency", type=int, nargs="+", default=[8])
    p.add_argument("--workloads", nargs="+", default=["base", "one", "mixed"])
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--requests", type=int, default=32, help="requests per run")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", type=Path, default=HERE / "results" / "serve.json")
    a = p.parse_args()

    model = a.model or bench_model()
    adapters = bench_adapters(model, a.adapters, a.rank)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    server = start_mola(model, adapters, max_loras=max(a.adapters, 1),
                        max_num_seqs=max(a.concurrency), log=a.out.with_suffix(".mola.log"))
    results = []
    try:
        # Warm up (compilation, caches) before anything is measured.
        asyncio.run(run_load(server.url, "mola", "warmup", ["a0", "base"] * 4, 8, 8))
        for rep in range(a.repeats):
            for conc in a.concurrency:
                for wl in a.workloads:
                    ids = workload_ids(wl, a.requests, a.adapters)
                    r = asyncio.run(run_load(server.url, "mola", wl, ids, conc, a.max_tokens))
                    print(f"  rep {rep} {wl:<6} c={conc:<3} {r.tok_s:7.1f} tok/s", file=sys.stderr)
                    results.append(r)
    finally:
        server.stop()
    table = summarize(results)
    print_table(table)
    a.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(a).items()},
                                 "table": table, "runs": [asdict(r) for r in results]}, indent=1))
    print(f"\nwrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
