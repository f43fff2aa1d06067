"""KV budget soak (issue 36): long prompts and long answers over 8 adapters and
the base at a deliberately small --kv-cache-bytes, against the same requests
with no budget.

    python benchmarks/kv_soak.py [--requests 96] [--concurrency 16] [--budget-share 0.35]
                                 [--admission optimistic]

Uses the 88M bench model and adapters of benchmarks/serve.py (built once into
benchmarks/.cache). Two servers on 127.0.0.1, one after the other, take the
same --requests requests at --concurrency: prompts of 300-900 tokens, answers
of 96-320 tokens (EOS banned), half greedy, half sampled with a seed, half
streamed, round robin over the base and 8 adapters. The bounded server's
budget is --budget-share of what --concurrency rows at the longest request
take, so rows wait and are preempted all along. Reported: every request
answered (errors, lost), answers identical to the unbounded server's,
preemptions and waits for memory, the most KV the batches held (measured by
the engine after every step) against the budget, MLX's active memory (sampled
each second) of both, and throughput (completion tokens / wall time) of both.
Writes benchmarks/results/kv_soak.json (the servers' logs: results/kv_soak-*.log).
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

STEP = 256  # positions a batch cache grows by at a time (mlx-lm's BatchKVCache.step)
WORDS = "the sea wind over a harbour where boats of every colour rest while gulls argue about bread".split()


def requests(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        filler = " ".join(rng.choice(WORDS) for _ in range(rng.randrange(250, 800)))
        out.append({"model": "base" if i % 9 == 0 else f"a{i % 9 - 1}",
                    "messages": [{"role": "user", "content": f"{prompt_for(i)} Notes: {filler}"}],
                    "max_tokens": rng.randrange(96, 320), "stream": i % 2 == 1,
                    **({"temperature": 0.8, "seed": 1000 + i} if i % 4 >= 2 else {"temperature": 0})})
    return out


def metric(text: str, name: str) -> float:
    m = re.search(rf"^{re.escape(name)} ([0-9.e+-]+)$", text, re.M)
    return float(m.group(1)) if m else float("nan")


def answer_of(r: httpx.Response, stream: bool) -> tuple[str, int] | None:
    """(text, completion tokens) of a whole response; None if a stream was cut short."""
    if not stream:
        body = r.json()
        return body["choices"][0]["message"]["content"], body["usage"]["completion_tokens"]
    events = [line[len("data: "):] for line in r.text.splitlines() if line.startswith("data: ")]
    if not events or events[-1] != "[DONE]":
        return None
    text, tokens = "", None
    for event in map(json.loads, events[:-1]):
        for choice in event.get("choices", []):
            text += choice["delta"].get("content") or ""
        if event.get("usage"):
            tokens = event["usage"]["completion_tokens"]
    return text, tokens


async def drive(url: str, reqs: list[dict], concurrency: int, eos) -> dict:
    answers: list = [None] * len(reqs)
    errors: list[str] = []
    active: list[float] = []
    queue = list(range(len(reqs)))
    done = asyncio.Event()

    async def user(c: httpx.AsyncClient):
        while queue:
            i = queue.pop(0)
            body = {**reqs[i], "logit_bias": ban_eos(eos)}
            if body["stream"]:
                body["stream_options"] = {"include_usage": True}
            try:
                r = await c.post("/v1/chat/completions", json=body)
                got = answer_of(r, body["stream"]) if r.status_code == 200 else None
                if got is None:
                    errors.append(f"{i}: {r.status_code} {r.text[-200:]}")
                answers[i] = got
            except httpx.HTTPError as e:
                errors.append(f"{i}: {e!r}")

    async def sample(c: httpx.AsyncClient):
        while not done.is_set():
            active.append(metric((await c.get("/metrics")).text, "mola_memory_active_bytes"))
            await asyncio.sleep(1.0)

    t0 = time.monotonic()
    async with httpx.AsyncClient(base_url=url, timeout=1800) as c:
        sampler = asyncio.create_task(sample(c))
        await asyncio.gather(*(user(c) for _ in range(concurrency)))
        seconds = time.monotonic() - t0
        done.set()
        await sampler
        text = (await c.get("/metrics")).text
        health = (await c.get("/health")).json()
    tokens = sum(a[1] for a in answers if a is not None)
    return {"answers": answers, "errors": errors, "seconds": round(seconds, 1), "tokens": tokens,
            "tok_per_s": round(tokens / seconds, 1), "active_peak_bytes": max(active, default=0),
            "active_start_bytes": active[0] if active else None,
            "kv_held_peak_bytes": metric(text, "mola_kv_held_peak_bytes"),
            "preemptions": metric(text, "mola_kv_preemptions_total"), "waits": metric(text, "mola_kv_waits_total"),
            "kv_cache": next(iter(health["kv_cache"].values()))}


def kv_bytes_per_token(model: Path) -> int:
    c = json.loads((model / "config.json").read_text())
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    return c["num_hidden_layers"] * 2 * c.get("num_key_value_heads", c["num_attention_heads"]) * head_dim * 4


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=96)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--budget-share", type=float, default=0.35)
    p.add_argument("--admission", default="optimistic", choices=("optimistic", "reserve"))
    p.add_argument("--out", type=Path, default=HERE / "results" / "kv_soak.json")
    a = p.parse_args()
    model = bench_model()
    adapters = bench_adapters(model, 8, 16)
    reqs = requests(a.requests)
    eos = eos_id(model)
    per_token = kv_bytes_per_token(model)
    # what --concurrency rows at the longest request take (the prompt's ~1.4 tokens a word, generously)
    longest = max(len(r["messages"][0]["content"].split()) * 2 + r["max_tokens"] for r in reqs)
    budget = int(a.budget_share * a.concurrency * (longest + STEP) * per_token)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    runs = {}
    for name, flags in (("unbounded", ("--kv-cache-bytes", "0")),
                        ("bounded", ("--kv-cache-bytes", str(budget), "--kv-admission", a.admission))):
        server = start_mola(model, adapters, 8, 16, a.concurrency, a.out.with_name(f"kv_soak-{name}.log"),
                            extra=(*flags, "--max-model-len", "4096", "--no-ui"))
        try:
            runs[name] = asyncio.run(drive(server.url, reqs, a.concurrency, eos))
        finally:
            server.stop()
        print(name, {k: v for k, v in runs[name].items() if k != "answers"}, flush=True)
    free, bound = runs["unbounded"], runs["bounded"]
    same = sum(x is not None and x == y for x, y in zip(free["answers"], bound["answers"]))
    result = {
        "requests": a.requests, "concurrency": a.concurrency, "admission": a.admission, "budget_bytes": budget,
        "kv_bytes_per_token": per_token,
        "answered": {k: sum(x is not None for x in r["answers"]) for k, r in runs.items()},
        "errors": {k: r["errors"][:5] for k, r in runs.items()},
        "identical_answers": same,
        "preemptions": bound["preemptions"], "waits_for_memory": bound["waits"],
        "kv_held_peak_bytes": {k: r["kv_held_peak_bytes"] for k, r in runs.items()},
        "kv_held_peak_over_budget": bound["kv_held_peak_bytes"] / budget,
        "active_peak_bytes": {k: r["active_peak_bytes"] for k, r in runs.items()},
        "active_start_bytes": {k: r["active_start_bytes"] for k, r in runs.items()},
        "seconds": {k: r["seconds"] for k, r in runs.items()},
        "tok_per_s": {k: r["tok_per_s"] for k, r in runs.items()},
        "throughput_bounded_over_unbounded": round(bound["tok_per_s"] / free["tok_per_s"], 3),
    }
    print(json.dumps(result, indent=1))
    a.out.write_text(json.dumps(result, indent=1))
    ok = same == a.requests and not bound["errors"] and not free["errors"]
    return 0 if ok and bound["kv_held_peak_bytes"] <= budget else 1


if __name__ == "__main__":
    sys.exit(main())
