"""The activated-LoRA demo (docs/adapters.md): the chat demo's pirate style
trained as an activated LoRA on SmolLM2-135M-Instruct, invoked by the
assistant's role header, then one conversation served and measured.

    python devtools/build_alora_demo.py --out DIR [--questions N] [--measure]

The data are the chat demo's (mola/demo/chat.py): the base model's own first
sentences to its training questions, rewritten by the pirate rule
(mola/demo/styles.py); the recipe is the pirate adapter's, plus
--alora-invocation. With --measure, a `mola serve` on 127.0.0.1 serves the
adapter, and a conversation of about 1,000 tokens is answered first by the
base model, then by the adapter, streamed: printed are each turn's time to
first token and the cached tokens it reports, and the same adapter's turn
as a plain LoRA's (the same factors without the invocation) for comparison.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

INVOCATION = "<|im_start|>assistant\n"  # SmolLM2's (ChatML) assistant header


def build(out: Path, questions: int | None) -> None:
    from mola.demo.chat import RECIPES, SEED, train_answers, write_data
    from mola.models.fetch import ensure_smollm
    from mola.train import TrainConfig, train_adapter

    def log(line):
        print(line, file=sys.stderr, flush=True)

    gguf = ensure_smollm()
    answers = train_answers(gguf, log, questions)
    r = RECIPES["pirate"]
    with tempfile.TemporaryDirectory(prefix="mola-alora-data-") as tmp:
        data = write_data(answers, r.style, Path(tmp))
        train_adapter(TrainConfig(
            model=str(gguf), dtype="float32", data=data, out=out, rank=r.rank, layers=r.layers, targets=r.targets,
            iters=r.iters, batch_size=r.batch_size, learning_rate=r.learning_rate, lr_schedule="cosine",
            warmup=r.warmup, grad_clip=1.0, mask_prompt=True, seed=SEED, steps_per_report=10,
            steps_per_eval=r.iters, val_batches=-1, force=True, alora_invocation=INVOCATION), log=log)


def plain_twin(adapter: Path, out: Path) -> Path:
    """The same factors as a plain LoRA (no invocation)."""
    shutil.copytree(adapter, out, dirs_exist_ok=True)
    config = json.loads((out / "adapter_config.json").read_text())
    config.pop("alora_invocation_tokens", None)
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2))
    return out


def turn(url: str, model: str, messages: list[dict]) -> tuple[float, int, str]:
    """(time to first token in ms, cached tokens, answer) of one streamed chat turn."""
    import httpx

    t0, first, text, cached = time.perf_counter(), None, [], None
    with httpx.stream("POST", url + "/v1/chat/completions", timeout=600, json={
            "model": model, "messages": messages, "max_tokens": 40, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}) as r:
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            for c in chunk.get("choices", []):
                if c["delta"].get("content"):
                    first = first or time.perf_counter()
                    text.append(c["delta"]["content"])
            if chunk.get("usage"):
                cached = chunk["usage"]["prompt_tokens_details"]["cached_tokens"]
    return (first - t0) * 1000, cached, "".join(text)


def measure(adapter: Path, port: int = 8123) -> None:
    import httpx

    plain = plain_twin(adapter, adapter.parent / (adapter.name + "-plain"))
    server = subprocess.Popen([sys.executable, "-m", "mola", "serve", "--host", "127.0.0.1", "--port", str(port),
                               "--adapter", f"pirate-alora={adapter}", "--adapter", f"pirate-plain={plain}"])
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(1)
        story = " ".join(f"Day {i}: the ship sailed on past island {i} and the crew counted its gold."
                         for i in range(1, 60))
        history = [{"role": "user", "content": f"Here is my log. {story} What is a ship?"}]
        ms, cached, answer = turn(url, "SmolLM2-135M-Instruct", history)
        print(f"base turn:         TTFT {ms:7.0f} ms, cached_tokens {cached}: {answer[:60]!r}")
        for model in ("pirate-alora", "pirate-plain"):
            ms, cached, answer = turn(url, model, history)
            print(f"{model + ' turn:':19}TTFT {ms:7.0f} ms, cached_tokens {cached}: {answer[:60]!r}")
    finally:
        server.terminate()
        server.wait(timeout=60)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--questions", type=int, default=None, help="training questions (default: all)")
    p.add_argument("--measure", action="store_true", help="serve it and time one conversation")
    args = p.parse_args()
    if not (args.out / "adapters.safetensors").is_file():
        build(args.out, args.questions)
    if args.measure:
        measure(args.out.resolve())
    return 0


if __name__ == "__main__":
    sys.exit(main())
