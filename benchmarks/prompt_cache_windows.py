"""Prompt cache on a model with sliding-window layers (issue 43, item 3): turn-2
time to first token with the cache against the same engine with it off
(--prompt-cache-bytes 0), in process, on a random float32 model in Gemma 3's
layout (gemma3_text: five sliding-window layers of 512 tokens, then a global
one, q/k norms, the local rope base).

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 \
    python benchmarks/prompt_cache_windows.py [--layers 12] [--hidden 640] [--window 512]
        [--prompt-tokens 1500] [--user-tokens 24] [--max-tokens 16] [--repeats 3]

Per repeat, on each engine (interleaved, cache first then off, after one
warm-up conversation each): a conversation of two turns on fresh random
tokens, the second sent whole (turn 1's prompt and answer, then the user's
next turn), as chat clients send it. TTFT is the time from adding the request
to its first token coming back. Reported: the median turn-2 TTFT of each, their
ratio (target <= 0.3), the tokens turn 2 found cached, and identical answers.
JSON lands in benchmarks/results/prompt_cache_windows.json.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import threading
import time
from pathlib import Path

from mola.engine.config import EngineConfig
from mola.engine.engine import Engine
from mola.engine.sequence import SamplingParams, Sequence
from mola.models.loader import load_base_model
from mola.testing.model import TinyModelSpec, make_tiny_model

HERE = Path(__file__).resolve().parent


class Runner:
    """An engine on ``model`` and a blocking way to time a request's first token."""

    def __init__(self, model: Path, max_tokens: int, **config):
        self.max_tokens = max_tokens
        self.first: dict[int, float] = {}  # seq_id -> when its first token came back
        self.done: set[int] = set()
        self.cond = threading.Condition()
        self.engine = Engine(lambda: load_base_model(str(model)), EngineConfig(**config), self._on_outputs)
        self.engine.start()

    def _on_outputs(self, outputs) -> None:
        now = time.perf_counter()
        with self.cond:
            for out in outputs:
                if out.tokens:
                    self.first.setdefault(out.seq_id, now)
                if out.finish_reason is not None:
                    self.done.add(out.seq_id)
            self.cond.notify_all()

    def ttft(self, prompt: list[int]) -> tuple[float, Sequence]:
        seq = Sequence(prompt=prompt, params=SamplingParams(max_tokens=self.max_tokens, temperature=0.0))
        start = time.perf_counter()
        self.engine.add(seq)
        with self.cond:
            while seq.seq_id not in self.done:
                assert self.cond.wait(900), "the engine timed out"
        return self.first[seq.seq_id] - start, seq

    def stop(self) -> None:
        self.engine.stop()


def build(args) -> Path:
    path = HERE / ".cache" / f"gemma3-{args.layers}x{args.hidden}-w{args.window}"
    if not (path / "config.json").exists():
        make_tiny_model(path, TinyModelSpec(model_type="gemma3_text", hidden_size=args.hidden,
                                            num_hidden_layers=args.layers, intermediate_size=4 * args.hidden,
                                            num_attention_heads=args.hidden // 64, num_key_value_heads=1,
                                            max_position_embeddings=8192, norm_noise=0.3))
        config = json.loads((path / "config.json").read_text())
        config.update(sliding_window=args.window, sliding_window_pattern=6)
        (path / "config.json").write_text(json.dumps(config))
    return path


def conversation(runner: Runner, rng: random.Random, args) -> dict:
    prompt = [1] + [rng.randrange(20, 500) for _ in range(args.prompt_tokens - 1)]
    t1, one = runner.ttft(prompt)
    second = prompt + one.output + [rng.randrange(20, 500) for _ in range(args.user_tokens)]
    t2, two = runner.ttft(second)
    return {"turn1_ttft_s": t1, "turn2_ttft_s": t2, "turn2_tokens": len(second),
            "turn2_cached": two.num_cached_tokens, "answers": [one.output, two.output]}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--hidden", type=int, default=640)
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--prompt-tokens", type=int, default=1500)
    p.add_argument("--user-tokens", type=int, default=24)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", type=Path, default=HERE / "results" / "prompt_cache_windows.json")
    args = p.parse_args()
    model = build(args)
    runners = {"cache": Runner(model, args.max_tokens), "off": Runner(model, args.max_tokens, prompt_cache_bytes=0)}
    runs: dict[str, list[dict]] = {name: [] for name in runners}
    try:
        for name, runner in runners.items():  # warm-up
            conversation(runner, random.Random(1000), args)
        for r in range(args.repeats):
            for name, runner in runners.items():
                runs[name].append(conversation(runner, random.Random(r), args))
                print(name, r, {k: v for k, v in runs[name][-1].items() if k != "answers"}, flush=True)
        cost = runners["cache"].engine.call(lambda: runners["cache"].engine.runner.kv_cost).result()
    finally:
        for runner in runners.values():
            runner.stop()
    med = {name: statistics.median(x["turn2_ttft_s"] for x in runs[name]) for name in runs}
    result = {
        "model": {"layers": args.layers, "hidden": args.hidden, "window": args.window,
                  "kv_cost": {"per_token": cost.per_token, "windows": cost.windows}},
        "args": {k: str(v) for k, v in vars(args).items()},
        "turn2_ttft_s": med, "ratio": med["cache"] / med["off"],
        "identical_answers": all(a["answers"] == b["answers"] for a, b in zip(runs["cache"], runs["off"])),
        "runs": runs,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(json.dumps({k: result[k] for k in ("turn2_ttft_s", "ratio", "identical_answers")}))


if __name__ == "__main__":
    main()
