"""Issue 37's figures: an adapter pushed from memory under traffic, and an
activated LoRA's turn against a plain LoRA's on a long shared conversation.

    python benchmarks/alora_push.py [--pushes 10] [--concurrency 8] [--context 1500] [--repeats 5]

Uses the 88M bench model and its rank-16 adapters (every linear of every
block; benchmarks/serve.py's, built once into benchmarks/.cache), on one mola
on 127.0.0.1 with OpenBLAS preloaded.

1. push: --concurrency clients keep chat requests (64 tokens, EOS banned)
   running over 8 adapters while a training-side mlx-lm model (LoRALinear
   layers of rank 16 on every linear, random factors) is pushed --pushes
   times with mola.client.push_adapter, one second apart. Reported: each
   push's wall time at the client (body built, sent, read, checked, slot
   written), and completion tokens per second of the traffic during the
   pushes against the same traffic without them.
2. aLoRA: --repeats conversations of --context random tokens. Each is sent
   first to the base model (its KV goes to the prompt cache), then continued
   by 16 more tokens with (a) an activated LoRA whose invocation starts the
   continuation and (b) the same adapter as a plain LoRA. Reported: time to
   first token of (a) and (b), streamed, and the cached tokens each reports.

Writes benchmarks/results/alora_push.json (the server's log: results/alora_push.log).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from loadgen import prompt_for  # noqa: E402
from systems import HERE, ban_eos, bench_adapters, bench_model, eos_id, start_mola  # noqa: E402

INVOCATION = [101, 102, 103]


def alora_twin(adapter: Path, out: Path) -> Path:
    """``adapter`` as a PEFT activated LoRA invoked by INVOCATION."""
    from mola.adapters.formats import read_adapter
    from mola.testing.peft import save_peft_adapter

    if not (out / "adapter_config.json").is_file():
        save_peft_adapter(out, read_adapter(adapter))
        config = json.loads((out / "adapter_config.json").read_text())
        (out / "adapter_config.json").write_text(json.dumps({**config, "alora_invocation_tokens": INVOCATION}))
    return out


def training_model(model: Path):
    """What a training loop holds: the bench model with random rank-16 LoRALinear layers."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.tuner.utils import linear_to_lora_layers
    from mlx_lm.utils import load

    m, _ = load(str(model))
    linear_to_lora_layers(m, len(m.layers), {"rank": 16, "scale": 2.0, "dropout": 0.0,
                                              "keys": ["self_attn.q_proj", "self_attn.k_proj",
                                                       "self_attn.v_proj", "self_attn.o_proj"]})
    b = {k: mx.random.normal(v.shape) * 0.01 for k, v in tree_flatten(m.trainable_parameters())
         if k.endswith("lora_b")}
    m.load_weights(list(b.items()), strict=False)
    mx.eval(m.parameters())
    return m


async def traffic(url: str, concurrency: int, seconds: float, eos) -> float:
    """Completion tokens per second of chat traffic over 8 adapters for ``seconds``."""
    tokens, stop = 0, time.monotonic() + seconds

    async def user(c, k):
        nonlocal tokens
        i = 0
        while time.monotonic() < stop:
            r = await c.post("/v1/chat/completions", json={
                "model": f"a{(k + i) % 8}", "max_tokens": 64, "logit_bias": ban_eos(eos),
                "messages": [{"role": "user", "content": prompt_for(k * 1000 + i)}]})
            tokens += r.json()["usage"]["completion_tokens"]
            i += 1

    t0 = time.monotonic()
    async with httpx.AsyncClient(base_url=url, timeout=300) as c:
        await asyncio.gather(*(user(c, k) for k in range(concurrency)))
    return tokens / (time.monotonic() - t0)


def pushes_under_traffic(url: str, model: Path, n: int, concurrency: int, eos) -> dict:
    from mola.client import push_adapter

    trainer = training_model(model)
    push_adapter(url, "live", trainer)  # the first load, outside the timing
    quiet = asyncio.run(traffic(url, concurrency, 2.0 + n, eos))
    times: list[float] = []

    def pusher():
        for _ in range(n):
            time.sleep(1.0)
            t0 = time.perf_counter()
            push_adapter(url, "live", trainer)
            times.append(time.perf_counter() - t0)

    thread = threading.Thread(target=pusher)
    thread.start()
    busy = asyncio.run(traffic(url, concurrency, 2.0 + n, eos))
    thread.join()
    return {"push_ms": [round(t * 1000, 1) for t in times], "push_ms_median": round(statistics.median(times) * 1000, 1),
            "push_ms_max": round(max(times) * 1000, 1), "tok_per_s_without_pushes": round(quiet, 1),
            "tok_per_s_with_pushes": round(busy, 1), "ratio": round(busy / quiet, 3)}


def ttft(url: str, model_id: str, prompt: list[int]) -> tuple[float, int]:
    """Seconds to the first streamed token, and the cached tokens reported."""
    t0, first, cached = time.perf_counter(), None, None
    with httpx.stream("POST", url + "/v1/completions", timeout=300, json={
            "model": model_id, "prompt": prompt, "max_tokens": 8, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}) as r:
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            if first is None and event["choices"] and event["choices"][0]["text"]:
                first = time.perf_counter() - t0
            if event.get("usage"):
                cached = event["usage"]["prompt_tokens_details"]["cached_tokens"]
    return first, cached


def alora_turns(url: str, context: int, repeats: int) -> dict:
    rng = random.Random(0)
    out = {"alora": [], "lora": [], "alora_cached": [], "lora_cached": []}
    for _ in range(repeats):
        conversation = [rng.randrange(200, 8000) for _ in range(context)]
        tail = [rng.randrange(200, 8000) for _ in range(13)]
        ttft(url, "base", conversation)  # the base model's turn: cached
        for kind, model_id in (("alora", "al"), ("lora", "pl")):
            seconds, cached = ttft(url, model_id, conversation + INVOCATION + tail)
            out[kind].append(round(seconds * 1000, 1))
            out[f"{kind}_cached"].append(cached)
    out["ttft_ms_median"] = {k: statistics.median(out[k]) for k in ("alora", "lora")}
    out["lora_over_alora"] = round(out["ttft_ms_median"]["lora"] / out["ttft_ms_median"]["alora"], 2)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pushes", type=int, default=10)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--context", type=int, default=1500)
    p.add_argument("--repeats", type=int, default=5)
    a = p.parse_args()
    model = bench_model()
    adapters = bench_adapters(model, 8, 16)
    alora = alora_twin(adapters[0], HERE / ".cache" / "alora-r16-0")
    out = HERE / "results" / "alora_push.json"
    server = start_mola(model, adapters, 12, 16, a.concurrency, out.with_suffix(".log"),
                        extra=("--adapter", f"al={alora}", "--adapter", f"pl={adapters[0]}", "--no-ui"))
    try:
        result = {"pushes": pushes_under_traffic(server.url, model, a.pushes, a.concurrency, eos_id(model))}
        print(json.dumps(result, indent=1), flush=True)
        result["alora"] = alora_turns(server.url, a.context, a.repeats)
    finally:
        server.stop()
    print(json.dumps(result, indent=1))
    out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
