"""Speculative decoding benchmark: mola with prompt lookup (--speculative
ngram) against mola without it, side by side in one run, at concurrency 1,
4 and 8.

    python benchmarks/speculative.py [--concurrency 1 4 8] [--repeats 2] [--requests 2]

Workloads (every request of a workload is answered by both servers, and
their outputs must be identical):

- copy: "repeat this paragraph" on the demo's echo base (mola.demo.echo_base,
  which copies the user's message), every request on one adapter: a random
  rank-8 LoRA small enough that the base still copies (a fine-tune that
  changes a letter or so);
- copy_mixed: the same paragraphs, requests round robin over the base, the
  demo's `title` and `upper` adapters (which rewrite what they copy: drafts
  copied from the prompt are partly or wholly wrong), three more adapters
  like copy's and one that swaps letters all along: different adapters
  verify in one batch;
- copy_real: "Repeat this paragraph exactly" on the real SmolLM2-135M-Instruct
  GGUF (mola.models.fetch, kept in mola's cache), base model: an instruct
  model that copies;
- free: free generation on the 88M bench model of benchmarks/serve.py
  (random weights, distinct prompts, EOS banned so every request decodes
  --free-tokens), greedy: a random model falls into loops, which prompt
  lookup drafts;
- free_sampled: the same, sampled (temperature 1, a seed per request), where
  drafts almost never match: speculation must cost (next to) nothing.

Each (workload, concurrency) runs --repeats times, the two servers
interleaved; figures are medians. Reported: output tok/s, the ratio
speculative / plain, tokens per row per decode step (1 without speculation)
and the mean accepted length (drafted tokens accepted per row that drafted,
per verifying step), both from the server's /metrics, and whether outputs
were identical.
Results go to benchmarks/results/speculative.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from loadgen import prompt_for  # noqa: E402
from systems import CACHE, HERE, ban_eos, bench_model, eos_id, start_mola  # noqa: E402

PARAGRAPHS = [
    "the lighthouse keeper climbed the spiral stairs every evening at dusk, counting the steps as his "
    "father had taught him, and when he reached the lamp room he wiped the great lens clean.",
    "a small boat drifted past the harbor wall while the fishermen mended their nets, talking quietly "
    "about the weather, the price of fuel and the storm that was coming in from the west.",
    "she kept a notebook of every bird she saw on the cliffs, with the date, the hour and the wind, "
    "and after twenty years the pages told a story that nobody else in the village knew.",
    "the train was late again, so the passengers stood on the platform with their coffee, watching "
    "the fog lift slowly from the fields and the first light catch the rails in the distance.",
]
METRICS = ("mola_speculative_rows_total", "mola_speculative_draft_tokens_total",
           "mola_speculative_accepted_tokens_total", "mola_decode_steps_total", "mola_decode_rows_total")


def echo_setup(cache: Path) -> tuple[Path, list[Path], list[Path]]:
    """The echo base, its demo adapters (title, upper) and five random
    adapters that leave it copying."""
    from mola.demo import ensure_demo
    from mola.testing.adapter import make_random_adapter

    base, demo = ensure_demo(cache / "echo")
    randoms = []
    # On the MLP (float32 in the echo base: MLX's CPU gather_mm takes float32
    # only). At std 0.002 the echo still copies, a letter or so changed; at
    # 0.005 it swaps some letters all along ("lighphoqse keeper").
    for i, std in enumerate((0.002, 0.002, 0.002, 0.002, 0.005)):
        path = cache / f"echo-lora-{i}-{std}"
        if not (path / "adapters.safetensors").is_file():
            make_random_adapter(path, base, rank=8, seed=300 + i, std=std, keys=("mlp.down_proj",))
        randoms.append(path)
    return base, randoms, [demo["title"], demo["upper"]]


def workload_jobs(workload: str, n: int, max_tokens: int, eos: int | list[int] | None) -> list[dict]:
    """Chat bodies: adapter ids a0..a4 are the random ones, a5 title, a6 upper."""
    jobs = []
    for i in range(n):
        if workload.startswith("free"):
            body = {"model": "base", "messages": [{"role": "user", "content": prompt_for(i)}],
                    "logit_bias": ban_eos(eos)}
            if workload == "free_sampled":
                jobs.append({**body, "max_tokens": max_tokens, "temperature": 1.0, "seed": i})
                continue
        elif workload == "copy_real":
            text = PARAGRAPHS[i % len(PARAGRAPHS)] + " " + PARAGRAPHS[(i + 1) % len(PARAGRAPHS)]
            body = {"model": "base", "messages": [
                {"role": "user", "content": "Repeat this paragraph exactly, word for word:\n\n" + text}]}
        else:
            model = "a0" if workload == "copy" else ["base", "a5", "a6", "a1", "a2", "a3", "a4"][i % 7]
            text = PARAGRAPHS[i % len(PARAGRAPHS)]
            body = {"model": model, "messages": [{"role": "user", "content": text}]}
        jobs.append({**body, "max_tokens": max_tokens, "temperature": 0})
    return jobs


def scrape(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics", timeout=30).text
    out = {}
    for line in text.splitlines():
        for name in METRICS:
            if line.startswith(name + " "):
                out[name] = float(line.split()[-1])
    return out


async def run_jobs(url: str, jobs: list[dict], concurrency: int) -> tuple[float, int, list[str]]:
    """Wall seconds, completion tokens and each job's output text, with at
    most ``concurrency`` requests in flight."""
    queue = list(enumerate(jobs))
    texts: list[str] = [""] * len(jobs)
    tokens = 0

    async def worker(client):
        nonlocal tokens
        while queue:
            i, body = queue.pop(0)
            r = await client.post("/v1/chat/completions", json=body)
            r.raise_for_status()
            texts[i] = r.json()["choices"][0]["message"]["content"]
            tokens += r.json()["usage"]["completion_tokens"]

    async with httpx.AsyncClient(base_url=url, timeout=900) as client:
        t0 = time.perf_counter()
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
        return time.perf_counter() - t0, tokens, texts


def measure(url: str, jobs: list[dict], concurrency: int) -> dict:
    before = scrape(url)
    wall, tokens, texts = asyncio.run(run_jobs(url, jobs, concurrency))
    d = {k: v - before.get(k, 0.0) for k, v in scrape(url).items()}
    return {"tok_s": tokens / wall, "tokens": tokens, "wall_s": wall, "texts": texts,
            "spec_rows": d.get("mola_speculative_rows_total", 0.0),
            "tokens_per_row_step": tokens / max(1.0, d.get("mola_decode_rows_total", 0.0)),
            "accepted": d.get("mola_speculative_accepted_tokens_total", 0.0),
            "drafted": d.get("mola_speculative_draft_tokens_total", 0.0)}


def start(name: str, model: Path, adapters: list[Path], spec: bool, args, logs: Path):
    extra = ("--speculative", "ngram", "--num-draft-tokens", str(args.num_draft_tokens)) if spec else ()
    if spec and args.speculate_always:
        extra += ("--speculate-always",)
    return start_mola(model, adapters, max_loras=8, max_rank=16, max_num_seqs=32,
                      log=logs / f"speculative-{name}-{'spec' if spec else 'plain'}.log",
                      openblas=not args.no_openblas, extra=extra + ("--prompt-cache-bytes", "0"))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 8])
    p.add_argument("--workloads", nargs="+", default=["copy", "copy_mixed", "copy_real", "free", "free_sampled"])
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--requests", type=int, default=2, help="requests per concurrency slot (default 2)")
    p.add_argument("--max-tokens", type=int, default=200, help="copying workloads (default 200)")
    p.add_argument("--free-tokens", type=int, default=48, help="free generation (default 48)")
    p.add_argument("--num-draft-tokens", type=int, default=8)
    p.add_argument("--speculate-always", action="store_true",
                   help="the speculative server verifies whenever a row drafts (no cost check)")
    p.add_argument("--no-openblas", action="store_true")
    p.add_argument("--out", type=Path, default=HERE / "results" / "speculative.json")
    args = p.parse_args()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    logs = Path(tempfile.mkdtemp(prefix="mola-spec-"))
    echo, randoms, demo = echo_setup(CACHE)
    bench = bench_model()
    setups = {"copy": (echo, randoms + demo), "copy_mixed": (echo, randoms + demo), "free": (bench, []),
              "free_sampled": (bench, [])}
    if "copy_real" in args.workloads:
        from mola.models.fetch import FetchError, ensure_smollm

        try:
            setups["copy_real"] = (ensure_smollm(), [])
        except FetchError as e:
            print(f"copy_real skipped: {e.message}", flush=True)
            args.workloads.remove("copy_real")
    rows = []
    for model in dict.fromkeys(setups[w][0] for w in args.workloads):
        workloads = [w for w in args.workloads if setups[w][0] == model]
        adapters = setups[workloads[0]][1]
        servers = {s: start(model.name, model, adapters, s, args, logs) for s in (False, True)}
        try:
            for w in workloads:
                for c in args.concurrency:
                    rows.append(run_setting(servers, w, c, args, eos_id(model) if w.startswith("free") else None))
                    print(format_row(rows[-1]), flush=True)
        finally:
            for s in servers.values():
                s.stop()
    summary = {"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows}
    args.out.write_text(json.dumps(summary, indent=1))
    print(f"\nresults: {args.out}; server logs: {logs}")
    return 0


def run_setting(servers: dict, workload: str, concurrency: int, args, eos: int | list[int] | None) -> dict:
    n = concurrency * args.requests
    max_tokens = args.free_tokens if workload.startswith("free") else args.max_tokens
    jobs = workload_jobs(workload, n, max_tokens, eos)
    runs = {False: [], True: []}
    order = [False, True]
    for r in range(args.repeats + 1):  # the first round warms both servers up and is dropped
        random.Random(r).shuffle(order)
        for spec in order:
            result = measure(servers[spec].url, jobs, concurrency)
            if r:
                runs[spec].append(result)
    med = lambda xs: statistics.median(xs)  # noqa: E731
    plain, spec = runs[False], runs[True]
    accepted = sum(x["accepted"] for x in spec)
    return {
        "workload": workload, "concurrency": concurrency, "requests": n,
        "plain_tok_s": med([x["tok_s"] for x in plain]), "spec_tok_s": med([x["tok_s"] for x in spec]),
        "ratio": med([x["tok_s"] for x in spec]) / med([x["tok_s"] for x in plain]),
        "plain_runs": [round(x["tok_s"], 1) for x in plain], "spec_runs": [round(x["tok_s"], 1) for x in spec],
        "tokens_per_row_step": med([x["tokens_per_row_step"] for x in spec]),
        "mean_accepted": accepted / max(1.0, sum(x["spec_rows"] for x in spec)),
        "drafted": sum(x["drafted"] for x in spec), "accepted": accepted,
        "identical": all(a["texts"] == b["texts"] for a in plain for b in spec),
    }


def format_row(r: dict) -> str:
    return (f"{r['workload']:<11} c={r['concurrency']:<2} plain {r['plain_tok_s']:7.1f} tok/s  "
            f"speculative {r['spec_tok_s']:7.1f} tok/s  x{r['ratio']:.2f}  "
            f"tokens/row/step {r['tokens_per_row_step']:.2f}  accepted {r['mean_accepted']:.2f}  "
            f"identical {'yes' if r['identical'] else 'NO'}")


if __name__ == "__main__":
    sys.exit(main())
