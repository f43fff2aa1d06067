"""An async load generator for OpenAI-compatible chat servers on 127.0.0.1,
bounded in requests and in time, with per-request timing of every chunk."""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
from dataclasses import dataclass, field

import httpx

WORDS = ("river mountain lantern harbor meadow signal copper violet summer engine garden "
         "window ladder planet orchard candle marble thunder pocket silver").split()


def prompt_for(i: int) -> str:
    """Distinct prompts, so that no server serves one from a prefix cache."""
    rng = random.Random(i)
    head = " ".join(rng.choice(WORDS) for _ in range(6))
    return f"{head}. Write a short story about a lighthouse keeper who finds a message in a bottle."


@dataclass
class RunResult:
    system: str
    workload: str
    concurrency: int
    requests: int = 0
    completed: int = 0
    output_tokens: int = 0
    wall_s: float = 0.0
    ttft: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)
    e2e: list[float] = field(default_factory=list)
    errors: int = 0
    retries: int = 0  # requests sent again on a fresh connection (see send)

    @property
    def tok_s(self) -> float:
        return self.output_tokens / self.wall_s if self.wall_s else 0.0


@dataclass
class Request:
    """What one request sends: the server-specific body fields."""

    body: dict
    timeline: list[float] = field(default_factory=list)  # arrival time of each content chunk
    start: float = 0.0
    end: float = 0.0


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


async def send(client: httpx.AsyncClient, req: Request, result: RunResult) -> None:
    req.start = time.perf_counter()
    tokens = 0
    for attempt in range(2):
        answered = False
        try:
            async with client.stream("POST", "/v1/chat/completions", json=req.body) as resp:
                answered = True
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
                    choices = chunk.get("choices") or []
                    if choices and choices[0].get("delta", {}).get("content"):
                        req.timeline.append(time.perf_counter())
            break
        except httpx.HTTPError as e:
            # a pooled keep-alive connection the server had closed (llama-server
            # closes one after a few requests): nothing was sent, so send again, once
            if attempt == 0 and not answered and isinstance(e, (httpx.RemoteProtocolError, httpx.ConnectError)):
                result.retries += 1
                continue
            result.errors += 1
            return
    req.end = time.perf_counter()
    result.completed += 1
    result.output_tokens += tokens
    if req.timeline:
        result.ttft.append(req.timeline[0] - req.start)
        result.itl += [b - a for a, b in zip(req.timeline, req.timeline[1:])]
    result.e2e.append(req.end - req.start)


async def run_load(url: str, requests: list[Request], concurrency: int, result: RunResult,
                   max_seconds: float) -> RunResult:
    """At most ``concurrency`` requests in flight; no new request starts after
    ``max_seconds``."""
    queue = list(reversed(requests))
    result.requests = len(requests)
    deadline = time.perf_counter() + max_seconds

    async def worker(client):
        while queue and time.perf_counter() < deadline:
            await send(client, queue.pop(), result)

    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        t0 = time.perf_counter()
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
        result.wall_s = time.perf_counter() - t0
    return result


def summarize(results: list[RunResult]) -> list[dict]:
    rows: dict[tuple, list[RunResult]] = {}
    for r in results:
        rows.setdefault((r.system, r.workload, r.concurrency), []).append(r)
    table = []
    for (system, workload, conc), runs in rows.items():
        med = statistics.median
        table.append({
            "system": system, "workload": workload, "concurrency": conc, "repeats": len(runs),
            "tok_s": med(r.tok_s for r in runs),
            "tok_s_runs": [round(r.tok_s, 1) for r in runs],
            "ttft_p50": med(pct(r.ttft, 0.5) for r in runs),
            "ttft_p90": med(pct(r.ttft, 0.9) for r in runs),
            "ttft_p95": med(pct(r.ttft, 0.95) for r in runs),
            "itl_p50": med(pct(r.itl, 0.5) for r in runs),
            "itl_p95": med(pct(r.itl, 0.95) for r in runs),
            "e2e_p50": med(pct(r.e2e, 0.5) for r in runs),
            "e2e_p95": med(pct(r.e2e, 0.95) for r in runs),
            "completed": sum(r.completed for r in runs),
            "errors": sum(r.errors for r in runs),
            "retries": sum(r.retries for r in runs),
        })
    return table


def format_table(table: list[dict]) -> str:
    head = (f"{'system':<15} {'workload':<10} {'conc':>4} {'tok/s':>8} {'ttft p50/p95 ms':>17} "
            f"{'itl p50/p95 ms':>16} {'e2e p50/p95 s':>15} {'err':>4}")
    lines = [head, "-" * len(head)]
    for r in table:
        lines.append(
            f"{r['system']:<15} {r['workload']:<10} {r['concurrency']:>4} {r['tok_s']:>8.1f} "
            f"{r['ttft_p50'] * 1e3:>8.0f}/{r['ttft_p95'] * 1e3:<8.0f} "
            f"{r['itl_p50'] * 1e3:>7.1f}/{r['itl_p95'] * 1e3:<8.1f} "
            f"{r['e2e_p50']:>7.2f}/{r['e2e_p95']:<7.2f} {r['errors']:>4}"
        )
    return "\n".join(lines)
