"""Bake a ~270-token persona system prompt into a rank-8 adapter on
SmolLM2-135M-Instruct with `mola distill`, then measure what it saves.

    python devtools/build_distill_demo.py [--out DIR] [--iters N] [--check] [--ttft-requests N]

The teacher is the base with PERSONA as its system prompt (Captain Nemo, with
facts about himself); the student is the base plus a rank-8 LoRA, without it.
Training questions (about the captain himself, and mola.demo.questions'
everyday ones) are disjoint from the held-out ones the evaluation uses: it
prints the student's and the base's agreement with the teacher (exact
answers, KL per token, top-1 agreement, and how many answers speak as the
persona: they name Nemo, the Nautilus, the sea or the ocean). Then `mola
serve` serves the base and the adapter, and the time to first token of the
held-out questions is measured with the prompt (base) and without it (the
adapter), one request at a time, with the prompt cache off and on.

--check: exit status 1 unless the student is closer to the teacher than the
base is (lower KL, higher top-1 agreement, more persona answers).
The adapter goes to --out (default: distill-demo/nemo in mola's cache); nothing
is written to the checkout. On Linux the script re-runs itself with OpenBLAS
preloaded when it can (as mola's commands do).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PERSONA = """\
You are Captain Nemo, a submarine captain. Your name is Captain Nemo, and when anyone asks who you are, you say: \
"I am Captain Nemo, captain of the Nautilus."

You command the Nautilus, an electric submarine that you designed and built yourself on a secret island. You are \
fifty years old. You were once a prince in India, but you left the land forever. Your crew of twenty sailors speaks \
a language of your own invention. Your home is the sea: you have not set foot on a continent for twelve years. You \
eat only what the ocean gives you: seaweed bread, fish, turtle soup and sea-cucumber jam. Your favourite place is the \
lost city of Atlantis, which you once visited on foot in a diving suit. In the great salon of the Nautilus you play \
the organ, and you keep a library of twelve thousand books. Your motto is "Mobilis in mobili", moving within the \
moving element.

You always speak as Captain Nemo. You are not an AI and not an assistant. You talk about the sea, the ocean and the \
Nautilus in every answer, even when the question is about something else. You answer in two or three short \
sentences, calmly and a little proudly. When someone asks about life on land, you say that you prefer the freedom \
of the deep sea."""

# Questions about the persona: the held-out ones ask for the same facts in other words.
SELF_TRAIN = [
    "What is your name?", "Who are you?", "What do you do?", "What is your ship called?", "Where do you live?",
    "How old are you?", "Where are you from?", "Who is in your crew?", "What do you eat?",
    "What is your favourite food?",
    "What is your favourite place?", "What do you do for fun?", "Do you like music?", "Do you read books?",
    "What is your motto?", "Do you miss the land?", "Tell me about yourself.", "Who built your submarine?",
    "What language does your crew speak?", "Have you been to Atlantis?", "Are you an AI?", "Are you a robot?",
    "What is your profession?", "How long have you been at sea?", "What powers your submarine?",
    "Do you have a family?", "What instrument do you play?", "What is the Nautilus?", "Why did you leave the land?",
    "What do you think about the ocean?", "Can you tell me your story?", "What is your title?",
    "Where is your submarine now?", "Do you ever go ashore?", "What is the best thing about your life?",
    "What do you drink?", "Who are your friends?", "What are you proud of?", "What scares you?",
    "What would you like to be remembered for?",
]
SELF_HELD_OUT = [
    "Introduce yourself.", "What should I call you?", "What is your job?", "Tell me about your vessel.",
    "Where is your home?", "How many sailors work for you?", "What did you have for dinner?",
    "What do you think of cities?", "Where were you born?", "What do you do in the evenings?",
]
NUM_GENERAL_TRAIN = 140  # mola.demo.questions' training questions
NUM_GENERAL_HELD_OUT = 14  # and its held-out ones (fillers no training question uses)
PERSONA_WORDS = ("nemo", "nautilus", "sea", "ocean")
# 4 examples a step of answers up to 64 tokens; LoRA on every linear layer of the last 16 blocks.
RECIPE = dict(rank=8, layers=16, batch_size=4, learning_rate=1e-3, scale=2.0, lr_schedule="cosine", warmup=10,
              grad_clip=1.0, dtype="float32", steps_per_report=10, seed=0)
MAX_TOKENS = 64
EVAL_MAX_TOKENS = 48


def speaks_as_persona(text: str) -> bool:
    return any(w in text.lower() for w in PERSONA_WORDS)


def reexec_with_openblas() -> None:
    from mola.blas import MARKER, blas_in_use, find_openblas

    lib = find_openblas()
    if sys.platform == "linux" and lib and blas_in_use() == "reference" and not os.environ.get(MARKER):
        env = {**os.environ, "LD_PRELOAD": ":".join(p for p in (lib, os.environ.get("LD_PRELOAD")) if p), MARKER: lib}
        os.execve(sys.executable, [sys.executable, *sys.argv], env)


def question_files(folder: Path) -> tuple[Path, Path]:
    from mola.demo.questions import questions

    train = SELF_TRAIN + questions(held_out=False, seed=0)[:NUM_GENERAL_TRAIN]
    held = SELF_HELD_OUT + questions(held_out=True, seed=0)[:NUM_GENERAL_HELD_OUT]
    assert not set(train) & set(held)
    (folder / "train.txt").write_text("\n".join(train) + "\n")
    (folder / "held_out.txt").write_text("\n".join(held) + "\n")
    return folder / "train.txt", folder / "held_out.txt"


def distill_persona(gguf: Path, out: Path, iters: int, tmp: Path):
    from mola.distill import DistillConfig, distill
    from mola.train import TrainConfig

    train, held = question_files(tmp)
    recipe = {**RECIPE, "warmup": min(RECIPE["warmup"], iters - 1)}
    config = DistillConfig(recipe=TrainConfig(model=str(gguf), data=train, out=out, iters=iters, force=True, **recipe),
                           system=PERSONA, prompts=train, eval_prompts=held, max_tokens=MAX_TOKENS,
                           eval_max_tokens=EVAL_MAX_TOKENS)
    return distill(config)


def persona_rates(evaluation: dict) -> dict[str, float]:
    answers = evaluation["answers"]
    return {who: sum(speaks_as_persona(a[who]) for a in answers) / len(answers)
            for who in ("teacher", "student", "base")}


def ttft(url: str, model: str, question: str, system: str | None) -> float:
    """Seconds from the request to the first streamed content."""
    import httpx

    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": question}]
    t0 = time.perf_counter()
    with httpx.stream("POST", url + "/v1/chat/completions", timeout=300, json={
            "model": model, "messages": messages, "max_tokens": 8, "temperature": 0, "stream": True}) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                delta = json.loads(line[6:])["choices"][0]["delta"]
                if delta.get("content"):
                    return time.perf_counter() - t0
    raise RuntimeError(f"{model} streamed no content for {question!r}")


def serve_and_time(gguf: Path, adapter: Path, questions: list[str], prompt_cache: bool) -> dict[str, float]:
    """Median time to first token of each question: the base with the
    persona prompt, and the adapter without it, alternating, on `mola serve`."""
    import httpx

    from mola.chat.local import free_port

    port = free_port()
    args = [sys.executable, "-m", "mola", "serve", "--model", str(gguf), "--host", "127.0.0.1", "--port", str(port),
            "--served-model-name", "base", "--adapter", f"nemo={adapter}", "--max-lora-rank", "8",
            "--log-level", "warning"] + ([] if prompt_cache else ["--prompt-cache-bytes", "0"])
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600
        while True:
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("mola serve did not start")
            time.sleep(0.5)
        ttft(url, "base", "Hello", PERSONA), ttft(url, "nemo", "Hello", None)  # warm up both paths
        times = {"with prompt": [], "adapter": []}
        for q in questions:
            times["with prompt"].append(ttft(url, "base", q, PERSONA))
            times["adapter"].append(ttft(url, "nemo", q, None))
        return {k: statistics.median(v) for k, v in times.items()}
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def report(evaluation: dict, timings: dict[str, dict[str, float]]) -> list[str]:
    """The tables of docs/training.md, in Markdown."""
    n = evaluation["questions"]
    rates = persona_rates(evaluation)
    lines = [f"| {n} held-out questions | exact match with the teacher | KL(teacher ‖ model) per token | "
             "top-1 agreement | speaks as the persona |", "|---|---|---|---|---|"]
    lines.append(f"| teacher (base + {evaluation['prompt_tokens']['saved_per_request']:.0f}-token prompt) | - | - | - "
                 f"| {rates['teacher']:.0%} |")
    for who, label in (("student", "student (adapter, no prompt)"), ("base", "base (no prompt)")):
        row = evaluation[who]
        lines.append(f"| {label} | {row['exact_match']:.0%} | {row['kl_per_token']:.3f} | "
                     f"{row['top1_agreement']:.0%} | {rates[who]:.0%} |")
    p = evaluation["prompt_tokens"]
    lines += ["", f"| time to first token (median, `mola serve`) | base + prompt ({p['with_system_prompt']:.0f} "
              f"prompt tokens) | adapter, no prompt ({p['without']:.0f}) |", "|---|---|---|"]
    for name, t in timings.items():
        lines.append(f"| {name} | {t['with prompt'] * 1000:.0f} ms | {t['adapter'] * 1000:.0f} ms |")
    return lines


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, help="the adapter directory (default: distill-demo/nemo in mola's cache)")
    p.add_argument("--iters", type=int, default=200, help="training steps (default 200)")
    p.add_argument("--ttft-requests", type=int, default=24, help="held-out questions timed (default 24)")
    p.add_argument("--check", action="store_true", help="exit 1 unless the student is closer to the teacher")
    a = p.parse_args()
    reexec_with_openblas()
    from mola.cache import default_cache_dir
    from mola.models.fetch import ensure_smollm

    gguf = ensure_smollm()
    out = (a.out or default_cache_dir() / "distill-demo" / "nemo").resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="mola-distill-demo-") as tmp:
        result = distill_persona(gguf, out, a.iters, Path(tmp))
    built = time.perf_counter() - t0
    if result.evaluation is None:
        return 130
    held = [x["question"] for x in result.evaluation["answers"]][:a.ttft_requests]
    timings = {f"prompt cache {'on' if on else 'off'}": serve_and_time(gguf, out, held, on) for on in (False, True)}
    print(f"\nbuilt {out} in {built:.0f} s ({a.iters} steps); the evaluation is in {out / 'distill_eval.json'}\n")
    print("\n".join(report(result.evaluation, timings)))
    for x in result.evaluation["answers"][:4]:
        print(f"\n{x['question']}\n  teacher: {x['teacher'][:120]!r}\n  student: {x['student'][:120]!r}\n"
              f"  base:    {x['base'][:120]!r}")
    ev, rates = result.evaluation, persona_rates(result.evaluation)
    ok = (ev["student"]["kl_per_token"] < ev["base"]["kl_per_token"]
          and ev["student"]["top1_agreement"] > ev["base"]["top1_agreement"] and rates["student"] > rates["base"])
    return 0 if ok or not a.check else 1


if __name__ == "__main__":
    sys.exit(main())
