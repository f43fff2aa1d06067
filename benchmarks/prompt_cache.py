"""Prompt-cache benchmark: multi-turn chat with a shared system prompt, mola
with its prompt cache, without it (--prompt-cache-bytes 0), and mlx_lm.server
with its own prompt cache, side by side in one run.

    python benchmarks/prompt_cache.py [--model real|DIR] [--clients 8] [--turns 4] [--conversations 2]
                                      [--system-tokens 400] [--max-tokens 32] [--repeats 2]

--model real: SmolLM2-135M-Instruct, its Q4_1 GGUF served by mola as the file
(as `serve.py --model real` does) and its `mola convert` output by
mlx_lm.server, with 8 random rank-8 adapters on every linear (the first 8 of
serve.py's); default: the 88M bench model with rank-16 adapters.

Each of --clients clients holds --conversations conversations one after the
other, each of --turns turns: the whole conversation so far (one ~400-token
system prompt shared by every client and adapter, the user's turns, the
replies) is sent again each turn, as chat clients do. Workloads: `one` (every
client on adapter a0) and `mixed8` (client k on adapter a{k % 8}). Requests are
greedy and stream, with EOS banned so every reply is --max-tokens tokens. The
first run of each server is a warm-up (the system prompt is then cached, as on
a server in use); systems and workloads are interleaved within each repeat.

Reported per system and workload: time to first token p50/p95 by turn, output
tok/s, per-stream decode tok/s (tokens after the first over the time after the
first), cached prompt tokens by turn (usage.prompt_tokens_details), and for
mola the decode steps that mixed adapters. JSON lands in
benchmarks/results/prompt_cache.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from loadgen import WORDS, pct  # noqa: E402
from systems import HERE, ban_eos, bench_adapters, bench_model, eos_id, real_model, start_mlx_lm, start_mola  # noqa: E402

SYSTEMS = ("mola", "mola-nocache", "mlx_lm.server")


def system_prompt(model: Path, num_tokens: int) -> str:
    """A system prompt of about ``num_tokens`` tokens of the bench tokenizer."""
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(tokenizer_file=str(model / "tokenizer.json"))
    rng = random.Random(0)
    words = ["You are the assistant of a harbour office. Follow these rules."]
    while len(tok.encode(" ".join(words))) < num_tokens:
        words.append(" ".join(rng.choice(WORDS) for _ in range(8)) + ".")
    return " ".join(words)


@dataclass
class Turn:
    turn: int
    ttft: float = float("nan")
    tokens: int = 0
    decode_s: float = 0.0  # first to last content chunk
    cached: int = 0
    prompt_tokens: int = 0
    ok: bool = False


@dataclass
class Run:
    system: str
    workload: str
    turns: list[Turn] = field(default_factory=list)
    wall_s: float = 0.0
    mixed_steps: float | None = None  # mola: decode steps that mixed adapters, during the run


async def ask(client: httpx.AsyncClient, body: dict, turn: int) -> tuple[Turn, str]:
    result, text, times = Turn(turn), [], []
    t0 = time.perf_counter()
    async with client.stream("POST", "/v1/chat/completions", json=body) as resp:
        if resp.status_code != 200:
            await resp.aread()
            return result, ""
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                u = chunk["usage"]
                result.tokens, result.prompt_tokens = u["completion_tokens"], u["prompt_tokens"]
                result.cached = (u.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
            for choice in chunk.get("choices") or []:
                piece = choice.get("delta", {}).get("content")
                if piece:
                    text.append(piece)
                    times.append(time.perf_counter())
    if times:
        result.ttft, result.decode_s, result.ok = times[0] - t0, times[-1] - times[0], True
    return result, "".join(text)


async def conversation(client, body_for, system: str, who: int, conv: int, turns: int) -> list[Turn]:
    messages = [{"role": "system", "content": system}]
    out = []
    for t in range(turns):
        rng = random.Random(who * 1000 + conv * 10 + t)
        messages.append({"role": "user", "content": f"Client {who}, question {t}: "
                         + " ".join(rng.choice(WORDS) for _ in range(12)) + "?"})
        result, reply = await ask(client, body_for(who, messages), t + 1)
        out.append(result)
        messages.append({"role": "assistant", "content": reply})
    return out


async def run_workload(url: str, body_for, system: str, clients: int, conversations: int, turns: int,
                       offset: int) -> tuple[list[Turn], float]:
    async def client_loop(client, who):
        done = []
        for conv in range(conversations):
            done += await conversation(client, body_for, system, who, offset + conv, turns)
        return done

    limits = httpx.Limits(max_connections=clients + 4, max_keepalive_connections=clients + 4)
    async with httpx.AsyncClient(base_url=url, timeout=900, limits=limits) as client:
        t0 = time.perf_counter()
        per_client = await asyncio.gather(*(client_loop(client, k) for k in range(clients)))
        return [t for c in per_client for t in c], time.perf_counter() - t0


def bodies(system: str, workload: str, model: Path, adapters: list[Path], max_tokens: int, eos: int | list[int]):
    def adapter_of(who: int) -> int:
        return 0 if workload == "one" else who % 8

    def body_for(who: int, messages: list[dict]) -> dict:
        body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}, "logit_bias": ban_eos(eos)}
        if system.startswith("mola"):
            return {**body, "model": f"a{adapter_of(who)}"}
        return {**body, "model": str(model), "adapters": str(adapters[adapter_of(who)])}

    return body_for


def mixed_steps(url: str) -> float:
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("mola_mixed_decode_steps_total"):
            return float(line.split()[1])
    return 0.0


def summarize(runs: list[Run], turns: int) -> list[dict]:
    table = []
    for key in dict.fromkeys((r.system, r.workload) for r in runs):
        group = [r for r in runs if (r.system, r.workload) == key]
        done = [t for r in group for t in r.turns if t.ok]
        row = {"system": key[0], "workload": key[1], "repeats": len(group),
               "errors": sum(not t.ok for r in group for t in r.turns),
               "tok_s": statistics.median(sum(t.tokens for t in r.turns) / r.wall_s for r in group),
               "decode_tok_s": statistics.median([(t.tokens - 1) / t.decode_s for t in done if t.decode_s > 0]
                                                 or [float("nan")])}
        for n in range(1, turns + 1):
            at = [t for t in done if t.turn == n]
            row[f"ttft_p50_t{n}"] = pct([t.ttft for t in at], 0.5)
            row[f"ttft_p95_t{n}"] = pct([t.ttft for t in at], 0.95)
            row[f"cached_t{n}"] = statistics.mean([t.cached / max(1, t.prompt_tokens) for t in at] or [0.0])
        later = [t.ttft for t in done if t.turn >= 2]
        row["ttft_p50_later"], row["ttft_p95_later"] = pct(later, 0.5), pct(later, 0.95)
        if group[0].mixed_steps is not None:
            row["mixed_steps"] = statistics.median(r.mixed_steps for r in group)
        table.append(row)
    return table


def targets(table: list[dict]) -> list[dict]:
    def get(system, workload, key):
        return next((r[key] for r in table if (r["system"], r["workload"]) == (system, workload)), None)

    out = []

    def add(name, goal, value, lower_is_better):
        if value is None:
            return
        met = value <= goal if lower_is_better else value >= goal
        out.append({"target": name, "value": round(value, 3), "goal": f"{'<=' if lower_is_better else '>='} {goal}",
                    "met": met})

    def ratio(a, b):
        return None if a is None or not b else a / b

    for wl in ("mixed8", "one"):
        add(f"turn>=2 TTFT p50, cache / no cache ({wl})", 0.3,
            ratio(get("mola", wl, "ttft_p50_later"), get("mola-nocache", wl, "ttft_p50_later")), True)
        add(f"decode tok/s, cache / no cache ({wl})", 0.97,
            ratio(get("mola", wl, "decode_tok_s"), get("mola-nocache", wl, "decode_tok_s")), False)
    add("turn>=2 TTFT p50, mola / mlx_lm.server (one)", 1.0,
        ratio(get("mola", "one", "ttft_p50_later"), get("mlx_lm.server", "one", "ttft_p50_later")), True)
    add("turn>=2 TTFT p50, mlx_lm.server / mola (mixed8)", 3.0,
        ratio(get("mlx_lm.server", "mixed8", "ttft_p50_later"), get("mola", "mixed8", "ttft_p50_later")), False)
    add("tok/s, mola / mlx_lm.server (mixed8)", 3.0,
        ratio(get("mola", "mixed8", "tok_s"), get("mlx_lm.server", "mixed8", "tok_s")), False)
    return out


def format_table(table: list[dict], turns: int) -> str:
    head = f"{'system':<14} {'workload':<8} {'tok/s':>6} {'dec/s':>6} " + " ".join(
        f"{'ttft t' + str(n) + ' p50/p95 ms':>20}" for n in range(1, turns + 1)) + "  cached share by turn"
    lines = [head, "-" * len(head)]
    for r in table:
        ttfts = " ".join(f"{r[f'ttft_p50_t{n}'] * 1e3:>10.0f}/{r[f'ttft_p95_t{n}'] * 1e3:<9.0f}"
                         for n in range(1, turns + 1))
        shares = " ".join(f"{r[f'cached_t{n}']:.2f}" for n in range(1, turns + 1))
        lines.append(f"{r['system']:<14} {r['workload']:<8} {r['tok_s']:>6.1f} {r['decode_tok_s']:>6.1f} "
                     f"{ttfts}  {shares}{'  err ' + str(r['errors']) if r['errors'] else ''}")
    return "\n".join(lines)


def start(name: str, model: Path, mlx_model: Path, adapters: list[Path], rank: int, clients: int, out: Path,
          blas: bool):
    log = out.with_suffix(f".{name}.log")
    if name == "mlx_lm.server":  # its own prompt cache, room for every conversation
        return start_mlx_lm(mlx_model, clients, log, blas, extra=("--prompt-cache-size", str(4 * clients)))
    extra = ("--prompt-cache-bytes", "0") if name == "mola-nocache" else ()
    return start_mola(model, adapters, len(adapters), rank, clients, log, blas, extra)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="real (SmolLM2-135M-Instruct) or a model directory (default: the 88M bench model)")
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--conversations", type=int, default=2, help="conversations per client, one after another")
    p.add_argument("--system-tokens", type=int, default=400)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=SYSTEMS)
    p.add_argument("--workloads", nargs="+", default=["one", "mixed8"], choices=["one", "mixed8"])
    p.add_argument("--no-openblas", action="store_true")
    p.add_argument("--out", type=Path, default=HERE / "results" / "prompt_cache.json")
    a = p.parse_args()

    if a.model == "real":  # mola serves the GGUF itself, mlx_lm.server its conversion
        model, mlx_model = real_model()
        rank, adapters = 8, bench_adapters(mlx_model, 8, 8, prefix="smollm2-adapter")
    else:
        model = mlx_model = Path(a.model) if a.model else bench_model()
        rank, adapters = 16, bench_adapters(model, 8, 16)
    eos, system = eos_id(mlx_model), system_prompt(mlx_model, a.system_tokens)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    servers, runs = {}, []
    try:
        for name in a.systems:
            servers[name] = start(name, model, mlx_model, adapters, rank, a.clients, a.out, not a.no_openblas)
        offset = 0
        for rep in range(a.repeats + 1):  # repeat 0 warms up
            for wl in a.workloads:
                for name, server in servers.items():
                    body_for = bodies(name, wl, mlx_model, adapters, a.max_tokens, eos)
                    before = mixed_steps(server.url) if name.startswith("mola") else None
                    turns, wall = asyncio.run(run_workload(server.url, body_for, system, a.clients,
                                                           1 if rep == 0 else a.conversations, a.turns, offset))
                    offset += a.conversations
                    run = Run(name, wl, turns, wall)
                    if before is not None:
                        run.mixed_steps = mixed_steps(server.url) - before
                    print(f"  {'warm-up' if rep == 0 else f'rep {rep}'} {name:<14} {wl:<7} "
                          f"{sum(t.tokens for t in turns) / wall:6.1f} tok/s in {wall:5.1f} s, "
                          f"{sum(not t.ok for t in turns)} errors", file=sys.stderr, flush=True)
                    if rep > 0:
                        runs.append(run)
        caches = {n: httpx.get(s.url + "/v1/adapters").json().get("prompt_cache")
                  for n, s in servers.items() if n.startswith("mola")}
    finally:
        for server in servers.values():
            server.stop()

    table = summarize(runs, a.turns)
    print(format_table(table, a.turns))
    goals = targets(table)
    print("\nTargets (ratios of medians from this run):")
    for t in goals:
        print(f"  {t['target']:<52} {t['value']:>8}  (goal {t['goal']}) {'met' if t['met'] else 'MISSED'}")
    print(f"\nmola's prompt cache at the end: {caches.get('mola')}")
    a.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(a).items()}, "table": table,
                                 "targets": goals, "prompt_cache": caches}, indent=1))
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
