"""Load time of a GGUF model: first (converted now) and cached (read from the
conversion cache), kept and float32, each in a fresh process, with its resident
memory after the load (issue 43).

    python benchmarks/gguf_load.py [--file F.gguf] [--dtypes keep float32] [--repeats 1]
        [--baseline-src DIR] [--llama-server PATH] [--serve]

--file: the GGUF file (default: kquants.py's SmolLM2-1.7B-shaped Q4_K_M file, 1.06 GB,
written into a temporary folder). Every run is a new `python` that calls
mola.models.loader.load_base_model and reports its wall time, VmRSS after the load and
VmHWM (the peak); the load log's timings are kept. The conversion cache is a
temporary folder of its own, emptied before each "first" run. --baseline-src: a
``src`` folder of another mola (e.g. ``git archive <commit> src | tar -x -C DIR``)
loaded the same way, for today-against-before figures under the same load.
--llama-server: a llama-server binary, timed from its start until /health answers 200
on the same file, with its VmRSS then (build steps: benchmarks/README.md). --serve: also
`mola serve --model FILE` (no adapter) from its start to a healthy /health, reading the
entry the runs before it wrote, with its VmRSS then. --serve-first N: N interleaved pairs
of first starts of `mola serve --dtype D` (the conversion cache empty: converted now) of
--baseline-src's mola and this one, for each --dtypes D, and nothing else.
Written to benchmarks/results/gguf_load.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

CHILD = r"""
import json, logging, sys, time
logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
t0 = time.perf_counter()
from mola.models.loader import load_base_model
loaded = load_base_model(sys.argv[1], dtype=sys.argv[2])
seconds = time.perf_counter() - t0
status = dict(line.split(":", 1) for line in open("/proc/self/status") if ":" in line)
kib = lambda k: int(status[k].split()[0])
print(json.dumps({"seconds": seconds, "rss_mib": kib("VmRSS") / 1024, "peak_rss_mib": kib("VmHWM") / 1024}))
"""


def run_child(path: Path, dtype: str, src: Path, cache: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(src), "MOLA_GGUF_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-c", CHILD, str(path), dtype], capture_output=True, text=True, env=env,
                       timeout=1800)
    if r.returncode != 0:
        raise SystemExit(f"the load failed ({dtype}, {src}):\n{r.stderr[-3000:]}")
    out = json.loads(r.stdout.strip().splitlines()[-1])
    out["process_seconds"] = time.perf_counter() - t0  # the interpreter's start and imports too
    out["log"] = [line for line in r.stderr.splitlines() if re.search(r"model (converted|read|loaded)|written to the conversion cache", line)]
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def healthy(argv: list[str], port: int, env: dict | None = None) -> dict:
    """Start ``argv`` (a server on ``port``), and time it until /health answers
    200; its VmRSS then (the whole process: weights, packs, KV, the runtime), and
    the CPU time it had used (user and system, every thread): on a machine shared
    with other work, what the start cost apart from what it waited for."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    try:
        while time.perf_counter() - t0 < 600:
            if proc.poll() is not None:
                raise SystemExit(f"{argv[0]} exited with {proc.returncode} before it was healthy")
            try:
                if urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1).status == 200:
                    seconds = time.perf_counter() - t0
                    with open(f"/proc/{proc.pid}/status") as f:
                        rss = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
                    with open(f"/proc/{proc.pid}/stat") as f:  # utime, stime: fields 14, 15 after the name
                        ticks = f.read().rpartition(")")[2].split()[11:13]
                    cpu = sum(int(t) for t in ticks) / os.sysconf("SC_CLK_TCK")
                    return {"seconds": seconds, "rss_mib": rss / 1024, "cpu_seconds": cpu}
            except OSError:
                time.sleep(0.05)
        raise SystemExit(f"{argv[0]} did not become healthy within 600 s")
    finally:
        proc.terminate()
        proc.wait()


def llama_server(binary: str, path: Path) -> dict:
    port = free_port()
    return healthy([binary, "-m", str(path), "--no-repack", "-t", "2", "--port", str(port)], port)


def mola_serve(path: Path, dtype: str, src: Path, cache: Path) -> dict:
    """``mola serve --model FILE`` (no adapter) from start to a healthy /health."""
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(src), "MOLA_GGUF_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}
    return healthy([sys.executable, "-m", "mola", "serve", "--model", str(path), "--dtype", dtype,
                    "--host", "127.0.0.1", "--port", str(port)], port, env)


def serve_first(a, src: Path) -> int:
    """N interleaved pairs of first starts (an empty conversion cache each) of mola serve:
    the baseline's, then this tree's, for each dtype."""
    if a.file is None or a.baseline_src is None:
        raise SystemExit("--serve-first needs --file and --baseline-src")
    runs: dict = {d: {"baseline": [], "first": []} for d in a.dtypes}
    loads = []
    with tempfile.TemporaryDirectory(prefix="mola-gguf-first-") as tmp:
        cache = Path(tmp) / "cache"
        for r in range(a.serve_first):
            for d in a.dtypes:
                for kind, tree in (("baseline", a.baseline_src), ("first", src)):
                    subprocess.run(["rm", "-rf", str(cache)], check=True)
                    with open("/proc/loadavg") as f:
                        loads.append(f.read().split()[0])
                    x = mola_serve(a.file, d, tree, cache)
                    runs[d][kind].append(x)
                    print(f"pair {r + 1}: {d:8s} {kind:8s} healthy in {x['seconds']:6.2f} s (CPU "
                          f"{x['cpu_seconds']:5.1f} s), RSS "
                          f"{x['rss_mib']:7.0f} MiB (load average {loads[-1]})", file=sys.stderr)
    ratios = {d: [b["seconds"] / f["seconds"] for b, f in zip(v["baseline"], v["first"])] for d, v in runs.items()}
    result = {"file": str(a.file), "file_bytes": a.file.stat().st_size, "baseline_src": str(a.baseline_src),
              "machine": platform.machine(), "cpus": os.cpu_count(), "loadavg_before_each": loads,
              "mola_serve_first": runs, "baseline_over_first": ratios}
    for d, xs in ratios.items():
        print(f"  {d}: baseline / first start, pair by pair: {', '.join(f'{x:.2f}' for x in xs)}")
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"written to {a.out}", file=sys.stderr)
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--file", type=Path)
    p.add_argument("--dtypes", nargs="+", default=["keep", "float32"])
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--baseline-src", type=Path)
    p.add_argument("--llama-server")
    p.add_argument("--serve", action="store_true", help="also time `mola serve` to a healthy /health, cached")
    p.add_argument("--serve-first", type=int, default=0, metavar="N",
                   help="only N interleaved first starts of mola serve, --baseline-src's and this one's")
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "gguf_load.json"))
    a = p.parse_args()
    src = Path(__file__).resolve().parent.parent / "src"
    if a.serve_first:
        return serve_first(a, src)
    with tempfile.TemporaryDirectory(prefix="mola-gguf-load-") as tmp:
        path = a.file
        if path is None:
            sys.path.insert(0, str(Path(__file__).parent))
            from kquants import write_like
            from mola.models.fetch import ensure_smollm

            path = write_like(ensure_smollm(), Path(tmp) / "smollm2-1.7b-shape-Q4_K_M.gguf", "Q4_K_M")
        cache = Path(tmp) / "cache"
        runs: dict = {d: {"first": [], "cached": [], "baseline": []} for d in a.dtypes}
        for r in range(a.repeats):
            for d in a.dtypes:
                if a.baseline_src:
                    runs[d]["baseline"].append(run_child(path, d, a.baseline_src, Path(tmp) / "unused"))
                subprocess.run(["rm", "-rf", str(cache)], check=True)
                runs[d]["first"].append(run_child(path, d, src, cache))
                runs[d]["cached"].append(run_child(path, d, src, cache))
                for kind in ("baseline", "first", "cached"):
                    if runs[d][kind]:
                        x = runs[d][kind][-1]
                        print(f"repeat {r + 1}: {d:8s} {kind:8s} load {x['seconds']:6.1f} s (process "
                              f"{x['process_seconds']:6.1f} s), RSS {x['rss_mib']:7.0f} MiB, peak "
                              f"{x['peak_rss_mib']:7.0f} MiB", file=sys.stderr)
        llama = llama_server(a.llama_server, path) if a.llama_server else None
        # a second start of `mola serve` (the entry written by the runs above), against llama-server's
        served = {d: mola_serve(path, d, src, cache) for d in a.dtypes} if a.serve else {}
        size = path.stat().st_size
    with open("/proc/loadavg") as f:
        load = f.read().split()[:3]
    result = {"file": str(a.file or "kquants.py SmolLM2-1.7B shape, Q4_K_M"), "file_bytes": size,
              "machine": platform.machine(), "cpus": os.cpu_count(), "loadavg_after": load, "runs": runs,
              "llama_server": llama, "mola_serve_cached": served}
    print(f"\n{result['file']}: {size / 2**30:.2f} GiB; load average after: {' '.join(load)}")
    for d in a.dtypes:
        for kind, xs in runs[d].items():
            if xs:
                best = min(xs, key=lambda x: x["seconds"])
                print(f"  {d:8s} {kind:8s} {best['seconds']:6.1f} s, RSS {best['rss_mib']:,.0f} MiB "
                      f"(peak {best['peak_rss_mib']:,.0f})")
    for d, x in served.items():
        print(f"  mola serve --dtype {d} (cached) healthy in {x['seconds']:.1f} s, RSS {x['rss_mib']:,.0f} MiB")
    print(f"  llama-server healthy in {llama['seconds']:.1f} s, RSS {llama['rss_mib']:,.0f} MiB" if llama
          else "  llama-server: not run (no --llama-server)")
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"written to {a.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
