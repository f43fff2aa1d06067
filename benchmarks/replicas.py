"""Two replicas of one mola configuration under a Zipf load over many adapters:
cold adapter loads and TTFT when requests are routed round-robin, by adapter
affinity read from the gateway gauges (vllm:lora_requests_info, as the
Kubernetes endpoint picker reads them), and by Ray Serve's multiplexing.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 \\
        python benchmarks/replicas.py --requests 300 --concurrency 4 [--ray] [--feasibility 3]

Round-robin and affinity run over two plain `mola serve` processes on
127.0.0.1; --ray runs the same load through mola.ray's ingress over two Ray
Serve replicas. --feasibility N starts and stops Ray with the two replicas N
times and reports ray.init and deploy times and the memory of the cluster.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from mola.testing.adapter import make_random_adapter
from mola.testing.model import TinyModelSpec, make_tiny_model

MSG = "Write a short story about a lighthouse keeper."


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def assets(root: Path, num_adapters: int) -> tuple[Path, dict[str, Path]]:
    model = make_tiny_model(root / "tiny", TinyModelSpec()) if not (root / "tiny").exists() else root / "tiny"
    adapters = {}
    for i in range(num_adapters):
        path = root / f"ad{i}"
        adapters[f"ad{i}"] = path if path.exists() else make_random_adapter(path, model, rank=8, seed=500 + i)
    return model, adapters


def zipf(n: int, names: list[str], s: float, seed: int) -> list[str]:
    rng = random.Random(seed)
    return rng.choices(names, weights=[1 / (k + 1) ** s for k in range(len(names))], k=n)


def gauges(text: str) -> dict:
    """What the endpoint picker reads of one server's /metrics."""
    out = {"running": [], "waiting": [], "queue": 0.0, "max_lora": 0, "loads": 0.0}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if family.name == "vllm:lora_requests_info":
                out["max_lora"] = int(sample.labels["max_lora"])
                for side in ("running", "waiting"):
                    value = sample.labels[f"{side}_lora_adapters"]
                    out[side] = value.split(",") if value else []
            elif family.name in ("vllm:num_requests_waiting", "vllm:num_requests_running"):
                out["queue"] += sample.value
            elif sample.name == "mola_adapter_loads_total":
                out["loads"] = sample.value
    return out


REFRESH_S = 0.05  # how often the router scrapes each server's gauges (the endpoint picker's default: 50 ms)


async def watch(c: httpx.AsyncClient, urls: list[str], seen: list[dict], stop: asyncio.Event) -> None:
    """Keep ``seen`` (one dict per server) current, as the endpoint picker's scrapers do."""
    while not stop.is_set():
        for k, u in enumerate(urls):
            seen[k] = gauges((await c.get(u + "/metrics")).text)
        try:
            await asyncio.wait_for(stop.wait(), REFRESH_S)
        except asyncio.TimeoutError:
            pass


def pick_by_affinity(seen: list[dict], model: str, turn: int) -> int:
    """The gateway's LoRA-affinity choice, from the last scrape: a server
    holding (or waiting for) the adapter, else one with a free slot, else the
    least queued; ties by turn."""
    order = [(turn + k) % len(seen) for k in range(len(seen))]
    for test in (lambda g: model in g["running"] or model in g["waiting"],
                 lambda g: len(g["running"]) + len(g["waiting"]) < g["max_lora"]):
        hits = [i for i in order if test(seen[i])]
        if hits:
            return min(hits, key=lambda i: seen[i]["queue"])
    return min(order, key=lambda i: seen[i]["queue"])


async def one(c: httpx.AsyncClient, url: str, model: str, max_tokens: int) -> float:
    """TTFT of one streamed chat request."""
    body = {"model": model, "messages": [{"role": "user", "content": MSG}], "max_tokens": max_tokens,
            "ignore_eos": True, "stream": True}
    t0 = time.perf_counter()
    ttft = None
    async with c.stream("POST", url + "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if ttft is None and line.startswith("data: {") and '"content":"' in line and '"content":""' not in line:
                ttft = time.perf_counter() - t0
    return ttft if ttft is not None else time.perf_counter() - t0


async def run_load(urls: list[str], sequence: list[str], concurrency: int, max_tokens: int, route: str) -> dict:
    ttfts: list[float] = []
    queue = list(enumerate(sequence))
    stop = asyncio.Event()
    async with httpx.AsyncClient(timeout=300) as c:
        seen = [gauges((await c.get(u + "/metrics")).text) for u in urls] if route == "affinity" else []
        async def worker():
            while queue:
                i, model = queue.pop(0)
                url = urls[i % len(urls)] if route == "round-robin" else (
                    urls[pick_by_affinity(seen, model, i)] if route == "affinity" else urls[0])
                ttfts.append(await one(c, url, model, max_tokens))

        scraper = asyncio.ensure_future(watch(c, urls, seen, stop)) if route == "affinity" else None
        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - t0
        stop.set()
        if scraper is not None:
            await scraper
    ttfts.sort()
    return {"route": route, "requests": len(sequence), "wall_s": round(wall, 1),
            "ttft_p50_ms": round(1e3 * statistics.median(ttfts), 1),
            "ttft_p99_ms": round(1e3 * ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))], 1)}


def start_plain(model: Path, adapters: dict[str, Path], slots: int) -> tuple[subprocess.Popen, str]:
    port = free_port()
    args = [sys.executable, "-m", "mola", "serve", "--host", "127.0.0.1", "--port", str(port), "--model", str(model),
            "--served-model-name", "tiny", "--max-loras", str(slots), "--max-lora-rank", "8", "--log-level", "warning"]
    for name, path in adapters.items():
        args += ["--adapter", f"{name}={path}"]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            break
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"mola serve did not start ({url})")


def plain_runs(model, adapters, slots, sequence, args) -> list[dict]:
    """Each routing on two fresh `mola serve` processes (the same start for both)."""
    rows = []
    for route in ("round-robin", "affinity"):
        servers = [start_plain(model, adapters, slots) for _ in range(2)]
        urls = [u for _, u in servers]
        try:
            before = sum(gauges(httpx.get(u + "/metrics").text)["loads"] for u in urls)
            row = asyncio.run(run_load(urls, sequence, args.concurrency, args.max_tokens, route))
            row["cold_loads"] = int(sum(gauges(httpx.get(u + "/metrics").text)["loads"] for u in urls) - before)
            rows.append(row)
            print(json.dumps(row), flush=True)
        finally:
            for proc, _ in servers:
                proc.terminate()
                proc.wait(timeout=60)
    return rows


def tree_rss_mib(pid: int) -> float:
    """Resident memory of ``pid`` and every process below it."""
    parents = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            parents[int(stat.parent.name)] = int(fields[1])
        except (OSError, ValueError, IndexError):
            continue
    tree, grew = {pid}, True
    while grew:
        more = {p for p, parent in parents.items() if parent in tree} - tree
        tree |= more
        grew = bool(more)
    total = 0
    for p in tree:
        try:
            total += int(Path(f"/proc/{p}/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except OSError:
            continue
    return total / 2**20


def ray_config(model, adapters, slots):
    from mola.config import AdapterSpec, ServeConfig

    return ServeConfig.from_settings(model=str(model), served_model_name="tiny", max_loras=slots, max_lora_rank=8,
                                     log_level="warning",
                                     adapters=tuple(AdapterSpec(n, str(p)) for n, p in adapters.items()))


def ray_loads(url: str) -> float:
    seen = {}
    for _ in range(60):
        r = httpx.get(url + "/metrics", timeout=60)
        seen[r.headers["x-mola-replica"]] = gauges(r.text)["loads"]
        if len(seen) == 2:
            return sum(seen.values())
    raise RuntimeError("one replica never answered /metrics")


def ray_run(model, adapters, slots, sequence, args) -> dict:
    import ray
    from mola.ray.launch import RayStart, run_app, start_ray

    start_ray(RayStart(num_cpus=4, env={"PYTHONPATH": os.environ.get("PYTHONPATH", "")}))
    try:
        url = run_app(ray_config(model, adapters, slots), 2, port=free_port())
        before = ray_loads(url)
        row = asyncio.run(run_load([url], sequence, args.concurrency, args.max_tokens, "ray-multiplexed"))
        row["cold_loads"] = int(ray_loads(url) - before)
        print(json.dumps(row), flush=True)
        return row
    finally:
        ray.shutdown()


def feasibility(model, adapters, slots, times: int) -> list[dict]:
    import ray
    from mola.ray.launch import RayStart, RayStartFailed, run_app, start_ray

    rows = []
    for k in range(times):
        row = {"try": k}
        try:
            row["ray_init_s"] = round(start_ray(RayStart(num_cpus=4, env={
                "PYTHONPATH": os.environ.get("PYTHONPATH", "")})), 1)
            t0 = time.perf_counter()
            url = run_app(ray_config(model, adapters, slots), 2, port=free_port())
            row["deploy_s"] = round(time.perf_counter() - t0, 1)
            httpx.post(url + "/v1/chat/completions", json={"model": "ad0", "max_tokens": 2, "messages": [
                {"role": "user", "content": "hi"}]}, timeout=60).raise_for_status()
            row["rss_mib"] = round(tree_rss_mib(os.getpid()))
        except RayStartFailed as e:
            row["failed"] = str(e)
        finally:
            t0 = time.perf_counter()
            ray.shutdown()
            row["shutdown_s"] = round(time.perf_counter() - t0, 1)
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--adapters", type=int, default=64)
    p.add_argument("--slots", type=int, default=4, help="--max-loras of each replica")
    p.add_argument("--requests", type=int, default=300)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--zipf", type=float, default=1.1)
    p.add_argument("--ray", action="store_true", help="also through two Ray Serve replicas")
    p.add_argument("--no-plain", action="store_true", help="skip the two plain mola serve processes")
    p.add_argument("--feasibility", type=int, default=0, metavar="N", help="start and stop Ray N times")
    p.add_argument("--dir", default=os.path.join(tempfile.gettempdir(), "mola-bench-replicas"))
    args = p.parse_args()
    model, adapters = assets(Path(args.dir), args.adapters)
    sequence = zipf(args.requests, sorted(adapters), args.zipf, seed=47)
    print(f"# {args.requests} requests, Zipf s={args.zipf} over {args.adapters} adapters, {args.slots} slots a "
          f"replica, concurrency {args.concurrency}, {args.max_tokens} tokens; load {os.getloadavg()}", flush=True)
    if args.feasibility:
        feasibility(model, adapters, args.slots, args.feasibility)
    if not args.no_plain:
        plain_runs(model, adapters, args.slots, sequence, args)
    if args.ray:
        ray_run(model, adapters, args.slots, sequence, args)


if __name__ == "__main__":
    main()
