"""The systems a benchmark compares, each started on 127.0.0.1 by the
benchmark itself: mola, mlx-lm's own server, mlx-lm's in-process
batch_generate and llama.cpp's llama-server (a binary built beforehand, see
start_llama_server); plus the bench model and adapters they share."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent
CACHE = HERE / ".cache"
OPENBLAS = "/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3"
ADAPTER_KEYS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def bench_model(cache: Path = CACHE) -> Path:
    """A float32 llama of ~88M parameters with random weights (built once)."""
    from mola.testing.model import TinyModelSpec, make_tiny_model

    path = cache / "model-88m"
    if not (path / "config.json").is_file():
        spec = TinyModelSpec(hidden_size=768, num_hidden_layers=12, intermediate_size=2048,
                             num_attention_heads=12, num_key_value_heads=4, vocab_size=8192,
                             max_position_embeddings=4096, weight_gain=1.0)
        make_tiny_model(path, spec)
    return path


# Random-weight float32 models at the proportions of models people serve
# (issue 26); the vocabulary stays the bench tokenizer's 8192, so the output
# projection is smaller than the real ones' and the LoRA's share of a step larger.
SHAPED = {
    "qwen0.5b": {"model_type": "qwen2", "hidden_size": 896, "num_hidden_layers": 24, "intermediate_size": 4864,
                 "num_attention_heads": 14, "num_key_value_heads": 2},
    "llama1b": {"model_type": "llama", "hidden_size": 2048, "num_hidden_layers": 16, "intermediate_size": 8192,
                "num_attention_heads": 32, "num_key_value_heads": 8},
}


def shaped_model(name: str, cache: Path = CACHE) -> Path:
    """A random-weight float32 model in the shape SHAPED[name] (built once)."""
    from mola.testing.model import TinyModelSpec, make_tiny_model

    path = cache / f"model-{name}"
    if not (path / "config.json").is_file():
        spec = TinyModelSpec(**SHAPED[name], vocab_size=8192, max_position_embeddings=4096, weight_gain=1.0)
        make_tiny_model(path, spec)
    return path


def real_model(cache: Path = CACHE) -> tuple[Path, Path]:
    """The real model: SmolLM2-135M-Instruct's Q4_1 GGUF (fetched once into
    mola's cache, hashes checked), which mola serves as it is, and its `mola
    convert` output in the dtype `--dtype auto` picks for it here (float32 on a
    CPU, kept quantized on a GPU), for mlx-lm: the same weights and dtype."""
    from mola.models.convert import convert
    from mola.models.fetch import ensure_smollm
    from mola.models.loader import resolve_dtype

    gguf = ensure_smollm()
    dtype = resolve_dtype("auto", is_gguf=True)
    out = cache / f"smollm2-{dtype}"
    if not (out / "config.json").is_file():
        convert(gguf, out, dtype=dtype, force=True)
    return gguf, out


DEMO_ADAPTERS = ("title", "json", "pirate")  # adapters/smollm2/*: trained on the real model's GGUF


def demo_adapters() -> list[Path]:
    """The three adapters trained on SmolLM2-135M-Instruct's Q4_1 GGUF that the demo serves."""
    root = HERE.parent / "adapters" / "smollm2"
    return [root / name for name in DEMO_ADAPTERS]


def gguf_adapters(adapters: list[Path], base_gguf: Path, cache: Path = CACHE) -> list[Path]:
    """llama.cpp GGUF LoRA twins of mlx-lm adapters (devtools/convert_mlx_lm_to_gguf.py,
    written once into the cache): the same weights, llama.cpp's names and q/k row order."""
    out = []
    for a in adapters:
        path = cache / "gguf-lora" / f"{a.parent.name}-{a.name}.gguf"
        if not path.is_file():
            path.parent.mkdir(parents=True, exist_ok=True)
            subprocess.run([sys.executable, str(HERE.parent / "devtools" / "convert_mlx_lm_to_gguf.py"), str(a),
                            str(path), "--model", str(base_gguf)], check=True, capture_output=True)
        out.append(path)
    return out


def bench_adapters(model: Path, k: int, rank: int, cache: Path = CACHE, prefix: str = "adapter") -> list[Path]:
    """K random adapters of ``rank`` on every linear of every block."""
    from mola.testing.adapter import make_random_adapter

    out = []
    for i in range(k):
        path = cache / f"{prefix}-r{rank}-{i}"
        if not (path / "adapters.safetensors").is_file():
            make_random_adapter(path, model, rank=rank, keys=ADAPTER_KEYS, seed=100 + i, std=0.02)
        out.append(path)
    return out


def eos_id(model: Path) -> int | list[int]:
    return json.loads((model / "config.json").read_text())["eos_token_id"]


def ban_eos(eos: int | list[int]) -> dict[str, int]:
    """logit_bias banning the end-of-sequence token(s) (config.json may list several)."""
    return {str(e): -100 for e in (eos if isinstance(eos, list) else [eos])}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def bench_env(openblas: bool = True) -> dict:
    env = dict(os.environ)
    env.pop("LD_PRELOAD", None)
    env["MOLA_OPENBLAS"] = "0"  # the preload below is the only one, for every system alike
    if openblas and sys.platform == "linux" and Path(OPENBLAS).exists():
        env["LD_PRELOAD"] = OPENBLAS
    return env


@dataclass
class Server:
    name: str
    url: str
    proc: subprocess.Popen

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def _wait(url: str, proc: subprocess.Popen, path: str, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            if httpx.get(url + path, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError("server did not start")


def start_mola(model: Path, adapters: list[Path], max_loras: int, max_rank: int, max_num_seqs: int,
               log: Path, openblas: bool = True, extra: tuple[str, ...] = ()) -> Server:
    port = free_port()
    args = [sys.executable, "-m", "mola", "serve", "--model", str(model), "--host", "127.0.0.1",
            "--port", str(port), "--served-model-name", "base", "--max-loras", str(max_loras),
            "--max-lora-rank", str(max_rank), "--max-num-seqs", str(max_num_seqs),
            "--log-level", "warning", "--allow-any-adapter-path", *extra]
    for i, a in enumerate(adapters):
        args += ["--adapter", f"a{i}={a}"]
    proc = subprocess.Popen(args, env=bench_env(openblas), stdout=log.open("w"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    _wait(url, proc, "/health")
    return Server("mola", url, proc)


def start_mlx_lm(model: Path, max_num_seqs: int, log: Path, openblas: bool = True,
                 extra: tuple[str, ...] = ()) -> Server:
    port = free_port()
    args = [sys.executable, "-m", "mlx_lm.server", "--model", str(model), "--host", "127.0.0.1",
            "--port", str(port), "--decode-concurrency", str(max_num_seqs),
            "--prompt-concurrency", str(min(max_num_seqs, 8)), "--log-level", "WARNING", *extra]
    proc = subprocess.Popen(args, env=bench_env(openblas), stdout=log.open("w"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    _wait(url, proc, "/health")
    return Server("mlx_lm.server", url, proc)


def llama_server_binary(given: str | None = None) -> Path:
    """llama.cpp's llama-server: ``given``, else $LLAMA_SERVER, else on PATH. It is
    never built here (benchmarks only, never CI): see the build steps in
    benchmarks/README.md ("llama.cpp's server beside mola")."""
    found = given or os.environ.get("LLAMA_SERVER") or shutil.which("llama-server")
    if not found or not Path(found).is_file():
        raise SystemExit("llama-server not found: pass --llama-server PATH or set $LLAMA_SERVER "
                         "(build steps: benchmarks/README.md, \"llama.cpp's server beside mola\")")
    return Path(found)


def start_llama_server(binary: Path, model_gguf: Path, loras: list[Path], slots: int, ctx_per_slot: int,
                       log: Path, threads: int = 2) -> Server:
    """llama-server on ``model_gguf`` with ``loras`` loaded but not applied (each
    request names every adapter's scale, see llama_body), ``slots`` parallel
    sequences of ``ctx_per_slot`` tokens each, continuous batching, ``threads``
    threads for decode and prompt. --no-repack: on these x86 machines the
    repacked Q4_1 weights take an AMX path that dies with SIGILL."""
    port = free_port()
    args = [str(binary), "-m", str(model_gguf), "--host", "127.0.0.1", "--port", str(port),
            "-np", str(slots), "-c", str(slots * ctx_per_slot), "-cb", "-t", str(threads), "-tb", str(threads),
            "--no-repack", "--no-webui"]
    if loras:  # once, comma-separated: repeated --lora flags keep only the last
        args += ["--lora", ",".join(str(p) for p in loras), "--lora-init-without-apply"]
    env = bench_env(openblas=False)
    env["LD_LIBRARY_PATH"] = os.pathsep.join(filter(None, [str(binary.parent), env.get("LD_LIBRARY_PATH")]))
    proc = subprocess.Popen(args, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    _wait(url, proc, "/health")
    return Server("llama-server", url, proc)


def llama_body(prompt: str, max_tokens: int, adapter: int | None, num_adapters: int) -> dict:
    """A llama-server chat request on adapter ``adapter`` (None: the base). Every
    adapter's scale is set, 0 for all but the chosen one: `"lora": []` does not
    zero adapters loaded at start (llama.cpp issue). ignore_eos: exactly max_tokens."""
    return {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True,
            "lora": [{"id": i, "scale": 1.0 if i == adapter else 0.0} for i in range(num_adapters)]}


def mola_body(model_id: str, prompt: str, max_tokens: int, eos: int | list[int]) -> dict:
    return {"model": model_id, "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, "logit_bias": ban_eos(eos)}


def mlx_lm_body(model: Path, adapter: Path | None, prompt: str, max_tokens: int, eos: int | list[int]) -> dict:
    """mlx_lm.server loads the model (and adapter) a request names, reloading
    when they change; "default_model" would ignore the adapter."""
    body = {"model": str(model), "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, "logit_bias": ban_eos(eos)}
    if adapter is not None:
        body["adapters"] = str(adapter)
    return body


def run_batch_generate(model: Path, num_requests: int, concurrency: int, max_tokens: int,
                       openblas: bool = True, timeout: float = 900) -> dict:
    """mlx-lm's in-process batch_generate on the same prompts (base model)."""
    r = subprocess.run(
        [sys.executable, str(HERE / "_batch_generate.py"), str(model), str(num_requests),
         str(concurrency), str(max_tokens)],
        env=bench_env(openblas), capture_output=True, text=True, timeout=timeout,
    )
    if r.returncode != 0:
        raise RuntimeError(f"batch_generate failed:\n{r.stderr[-2000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])
