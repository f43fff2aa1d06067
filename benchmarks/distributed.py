"""One process against a 2-rank tensor-parallel group (mlx.launch, ring
backend, loopback), same model and adapters, side by side in one run; and
how much of a sharded decode step the collective takes.

    python benchmarks/distributed.py [--concurrency 8] [--repeats 3] [--max-tokens 32]

On one 2-core machine the two ranks share the cores (each gets one BLAS
thread), so the point is the recorded ratio and the collective's share, not
a speed-up; on a group of Macs the same script measures the real thing.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from loadgen import RunResult, format_table, run_load, summarize  # noqa: E402
from serve import requests_for  # noqa: E402
from systems import (HERE, Server, _wait, bench_adapters, bench_env, bench_model, eos_id,  # noqa: E402
                     free_port, start_mola)


def start_group(model: Path, adapters: list[Path], max_num_seqs: int, log: Path, ranks: int = 2) -> Server:
    port = free_port()
    args = ["mlx.launch", "--backend", "ring", "-n", str(ranks), "--", sys.executable, "-m", "mola", "serve",
            "--distributed", "--model", str(model), "--host", "127.0.0.1", "--port", str(port),
            "--served-model-name", "base", "--max-loras", str(len(adapters)), "--max-lora-rank", "16",
            "--max-num-seqs", str(max_num_seqs), "--log-level", "warning", "--allow-any-adapter-path"]
    for i, a in enumerate(adapters):
        args += ["--adapter", f"a{i}={a}"]
    env = {**bench_env(), "OPENBLAS_NUM_THREADS": "1"}  # the ranks share the machine's cores
    proc = subprocess.Popen(args, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT,
                            start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    _wait(url, proc, "/health")
    return Server(f"mola {ranks} ranks", url, proc)


def collective_share(model: Path, batch: int) -> dict:
    env = {**bench_env(), "OPENBLAS_NUM_THREADS": "1"}
    r = subprocess.run(["mlx.launch", "--backend", "ring", "-n", "2", "--", sys.executable,
                        str(HERE / "_collective.py"), str(model), str(batch)],
                       env=env, capture_output=True, text=True, timeout=900)
    lines = [line for line in r.stdout.splitlines() if line.startswith("{")]
    if not lines:
        raise RuntimeError(f"collective measurement failed:\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}")
    return json.loads(lines[-1])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--out", type=Path, default=HERE / "results" / "distributed.json")
    a = p.parse_args()
    model = bench_model()
    adapters = bench_adapters(model, 8, 16)
    eos = eos_id(model)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    servers = []
    results = []
    try:
        servers.append(start_mola(model, adapters, 8, 16, a.concurrency, a.out.with_suffix(".one.log")))
        servers[0].name = "mola 1 rank"
        servers.append(start_group(model, adapters, a.concurrency, a.out.with_suffix(".two.log")))
        for s in servers:  # warm-up
            asyncio.run(run_load(s.url, requests_for("mola", "mixed8", 8, 8, model, adapters, eos, 90_000),
                                 8, RunResult(s.name, "warmup", 8), 120))
        offset = 0
        for rep in range(a.repeats):
            for s in servers:
                for wl in ("base", "mixed8"):
                    reqs = requests_for("mola", wl, a.requests, a.max_tokens, model, adapters, eos, offset)
                    offset += a.requests
                    r = asyncio.run(run_load(s.url, reqs, a.concurrency, RunResult(s.name, wl, a.concurrency), 300))
                    results.append(r)
                    print(f"  rep {rep} {s.name:<12} {wl:<7} {r.tok_s:7.1f} tok/s", file=sys.stderr, flush=True)
    finally:
        for s in servers:
            if s.proc.poll() is None:
                try:
                    os.killpg(s.proc.pid, signal.SIGINT)
                except ProcessLookupError:
                    pass
            s.stop()
    collective = collective_share(model, a.concurrency)
    table = summarize(results)
    print(format_table(table))
    one = {r["workload"]: r["tok_s"] for r in table if r["system"] == "mola 1 rank"}
    two = {r["workload"]: r["tok_s"] for r in table if r["system"] == "mola 2 ranks"}
    ratios = {wl: two[wl] / one[wl] for wl in one if wl in two}
    print(f"\n2 ranks / 1 rank, output tok/s: {json.dumps({k: round(v, 3) for k, v in ratios.items()})}")
    print(f"collective share of a sharded decode step (batch {a.concurrency}): "
          f"{collective['collective_share']:.1%} ({collective['collective_ms']:.1f} of {collective['step_ms']:.1f} ms)")
    a.out.write_text(json.dumps({"table": table, "ratios_2_over_1": ratios, "collective": collective}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
