"""Soak: minutes of mixed traffic over 8 adapters at concurrency 16, with hot
loads and unloads all along; every request must be answered, and memory must
not grow.

    python benchmarks/soak.py [--minutes 3] [--concurrency 16]

Uses the 88M bench model and adapters of benchmarks/serve.py (built once into
benchmarks/.cache). Prints requests, errors, memory at start and end (MLX
active memory and process RSS, from /metrics) and writes
benchmarks/results/soak.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from loadgen import prompt_for  # noqa: E402
from systems import HERE, ban_eos, bench_adapters, bench_model, eos_id, start_mola  # noqa: E402


def memory(url: str) -> dict:
    text = httpx.get(url + "/metrics", timeout=30).text
    out = {}
    for name in ("mola_memory_active_bytes", "mola_process_resident_bytes"):
        m = re.search(rf"^{name} ([0-9.e+]+)$", text, re.M)
        out[name] = float(m.group(1)) if m else None
    return out


def completion_usage(text: str, stream: bool) -> int | None:
    """completion_tokens of a whole response; a stream must end with [DONE]."""
    if not stream:
        return (json.loads(text).get("usage") or {}).get("completion_tokens")
    events = [line[len("data: "):] for line in text.splitlines() if line.startswith("data: ")]
    if not events or events[-1] != "[DONE]":
        return None
    for event in reversed(events[:-1]):
        usage = json.loads(event).get("usage")
        if usage:
            return usage["completion_tokens"]
    return None


async def soak(url: str, adapters: list[Path], minutes: float, concurrency: int, eos: int | list[int]) -> dict:
    stats = {"requests": 0, "ok": 0, "errors": 0, "tokens": 0, "loads": 0, "unloads": 0,
             "admin_errors": 0, "error_samples": []}
    stop_at = time.monotonic() + minutes * 60
    rng = random.Random(0)

    async def user(c: httpx.AsyncClient, k: int):
        i = 0
        while time.monotonic() < stop_at:
            model = rng.choice(["base"] + [f"a{j}" for j in range(8)] + ["hot"])
            body = {"model": model, "messages": [{"role": "user", "content": prompt_for(k * 100000 + i)}],
                    "max_tokens": rng.choice([8, 16, 32, 64]), "temperature": rng.choice([0, 0.8]),
                    "stream": rng.random() < 0.5, "logit_bias": ban_eos(eos)}
            if body["stream"]:
                body["stream_options"] = {"include_usage": True}
            i += 1
            stats["requests"] += 1
            try:
                r = await c.post("/v1/chat/completions", json=body)
                if r.status_code == 200:
                    usage = completion_usage(r.text, body["stream"])
                    if usage is None:  # a stream cut short, or a body without usage
                        stats["errors"] += 1
                        stats["error_samples"] = (stats["error_samples"] + [r.text[-200:]])[-5:]
                        continue
                    stats["ok"] += 1
                    stats["tokens"] += usage
                elif r.status_code == 404 and model == "hot":
                    stats["ok"] += 1  # the hot adapter is unloaded half the time: a 404 is right
                else:
                    stats["errors"] += 1
                    stats["error_samples"] = (stats["error_samples"] + [r.text[:200]])[-5:]
            except httpx.HTTPError as e:
                stats["errors"] += 1
                stats["error_samples"] = (stats["error_samples"] + [repr(e)])[-5:]

    async def admin(c: httpx.AsyncClient):
        while time.monotonic() < stop_at:
            await asyncio.sleep(2.0)
            r = await c.post("/v1/adapters", json={"name": "hot", "path": str(rng.choice(adapters[8:16]))})
            stats["loads"] += r.status_code == 200
            stats["admin_errors"] += r.status_code != 200
            await asyncio.sleep(2.0)
            r = await c.delete("/v1/adapters/hot")
            stats["unloads"] += r.status_code == 200
            stats["admin_errors"] += r.status_code != 200

    async def sample(c: httpx.AsyncClient):
        while time.monotonic() < stop_at:
            await asyncio.sleep(15)
            text = (await c.get("/metrics")).text
            m = re.search(r"^mola_process_resident_bytes ([0-9.e+]+)$", text, re.M)
            a = re.search(r"^mola_memory_active_bytes ([0-9.e+]+)$", text, re.M)
            stats["memory_series"].append((round(time.monotonic() - started, 1), float(m.group(1)),
                                           float(a.group(1))))

    started = time.monotonic()
    stats["memory_series"] = []  # (seconds, RSS bytes, MLX active bytes) every 15 s
    async with httpx.AsyncClient(base_url=url, timeout=300) as c:
        await asyncio.gather(admin(c), sample(c), *(user(c, k) for k in range(concurrency)))
    return stats


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--minutes", type=float, default=3.0)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--out", type=Path, default=HERE / "results" / "soak.json")
    a = p.parse_args()
    model = bench_model()
    adapters = bench_adapters(model, 16, 16)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    server = start_mola(model, adapters[:8], 10, 16, a.concurrency, a.out.with_suffix(".log"))
    try:
        before = memory(server.url)
        t0 = time.monotonic()
        stats = asyncio.run(soak(server.url, adapters, a.minutes, a.concurrency, eos_id(model)))
        stats["seconds"] = round(time.monotonic() - t0, 1)
        time.sleep(1)
        after = memory(server.url)
        healthy = httpx.get(server.url + "/health").status_code == 200
    finally:
        server.stop()
    result = {"stats": stats, "memory_at_start": before, "memory_at_end": after, "healthy_at_end": healthy}
    series = stats["memory_series"]
    if len(series) >= 3:  # growth after warm-up: the second sample against the last
        result["rss_growth_after_warmup"] = series[-1][1] / series[1][1] - 1
        result["mlx_active_growth_after_warmup"] = series[-1][2] / series[1][2] - 1
    print(json.dumps(result, indent=1))
    a.out.write_text(json.dumps(result, indent=1))
    return 0 if stats["errors"] == 0 and healthy else 1


if __name__ == "__main__":
    sys.exit(main())
