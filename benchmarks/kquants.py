"""A Q4_K_M file kept quantized against dequantized: resident bytes and decode speed.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 \\
        python benchmarks/kquants.py [--ftype Q4_K_M] [--batch 1 8] [--steps 32] [--repeats 3]

1. Measured: a SmolLM2-1.7B-Instruct-shaped model (the real SmolLM2-135M's metadata
   and tokenizer, 1.7B's sizes: 135M's width of 576 is no multiple of the K-quants'
   256, so llama.cpp's Q4_K_M of it is mostly Q5_0) written as a Q4_K_M file, each tensor in the codec llama.cpp's quantizer
   gives it (src/llama-quant.cpp, build 11434: output, or the tied token_embd, and the
   attn_v / ffn_down of the ``use_more_bits`` layers Q6_K, the other matrices Q4_K, norms F32), its blocks
   random but valid (mola.testing.gguf_model.random_blocks: speed and memory do not
   depend on the values). Loaded with --dtype keep and float32: MLX's active memory
   after the load and the planned bytes (models/fit.py), and decode tokens per
   second at each --batch (benchmarks/gguf_dtype.py's loop), medians of --repeats
   interleaved rounds.
2. Planned, not loaded: the same rule applied to the tensor lists of 7-8B models
   (Llama-2-7B, Mistral-7B, Llama-3.1-8B shapes): the file's bytes (what llama.cpp
   holds) and mola's plan kept and dequantized (fit.plan, which tests/test_models_fit.py
   checks against what a loaded model holds).
Written to benchmarks/results/kquants.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

import mlx.core as mx
import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from gguf_dtype import decode_rate, openblas_loaded  # noqa: E402

# (hidden, layers, ffn, heads, kv heads, vocab) of the models planned in part 2
SHAPES = {
    "Llama-2-7B": (4096, 32, 11008, 32, 32, 32000),
    "Mistral-7B": (4096, 32, 14336, 32, 8, 32000),
    "Llama-3.1-8B": (4096, 32, 14336, 32, 8, 128256),
}


def use_more_bits(i: int, n: int) -> bool:
    """llama-quant.cpp: the layers Q4_K_M / Q5_K_M give Q6_K to (attn_v, ffn_down)."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def codec_for(name: str, n_layers: int, ftype: str, tied: bool = False) -> str:
    """The codec llama.cpp's quantizer gives ``name`` under Q4_K_M or Q5_K_M (a model
    with tied embeddings has no output.weight: its token_embd is quantized as one)."""
    base = {"Q4_K_M": "Q4_K", "Q5_K_M": "Q5_K"}[ftype]
    if name == "output.weight" or (tied and name == "token_embd.weight"):
        return "Q6_K"
    parts = name.split(".")
    if len(parts) == 4 and parts[2] in ("attn_v", "ffn_down") and use_more_bits(int(parts[1]), n_layers):
        return "Q6_K"
    return base


def shape_tensors(hidden, layers, ffn, heads, kv_heads, vocab, ftype, tied=False):
    """The tensor list (name, codec, ne) of a llama-shaped model, as fit.plan reads it."""
    from gguf import GGMLQuantizationType as T

    kv = hidden // heads * kv_heads
    out = [("token_embd.weight", (hidden, vocab)), ("output_norm.weight", (hidden,))]
    if not tied:
        out.append(("output.weight", (hidden, vocab)))
    for i in range(layers):
        out += [(f"blk.{i}.{n}.weight", ne) for n, ne in (
            ("attn_q", (hidden, hidden)), ("attn_k", (hidden, kv)), ("attn_v", (hidden, kv)),
            ("attn_output", (hidden, hidden)), ("ffn_gate", (hidden, ffn)), ("ffn_up", (hidden, ffn)),
            ("ffn_down", (ffn, hidden)), ("attn_norm", (hidden,)), ("ffn_norm", (hidden,)))]
    return [SimpleNamespace(name=n, shape=ne, tensor_type=T.F32 if len(ne) == 1 else T[codec_for(n, layers, ftype, tied)])
            for n, ne in out]


def file_bytes(tensors) -> int:
    from gguf import GGML_QUANT_SIZES

    total = 0
    for t in tensors:
        block, size = GGML_QUANT_SIZES[t.tensor_type]
        total += int(np.prod(t.shape)) // block * size
    return total


# SmolLM2-1.7B-Instruct: (hidden, layers, ffn, heads, kv heads), its vocabulary is SmolLM2-135M's
MEASURED = (2048, 24, 8192, 32, 32)


def write_like(real: Path, out: Path, ftype: str) -> Path:
    """A SmolLM2-1.7B-shaped file: ``real``'s (SmolLM2-135M's) tokenizer and metadata
    with MEASURED's sizes, each matrix in the codec ``ftype`` gives it (random valid blocks)."""
    from gguf import GGUFValueType, GGUFWriter

    from mola.models.gguf_file import open_gguf
    from mola.testing.gguf_model import random_blocks

    f = open_gguf(real)
    hidden, layers, ffn, heads, kv_heads = MEASURED
    sizes = {"embedding_length": hidden, "block_count": layers, "feed_forward_length": ffn,
             "attention.head_count": heads, "attention.head_count_kv": kv_heads,
             "rope.dimension_count": hidden // heads}
    writer = GGUFWriter(str(out), f.arch.name)
    for key, field in f.reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        vtype, value = field.types[0], field.contents()
        if key.removeprefix(f"{f.arch.name}.") in sizes:
            value, vtype = sizes[key.removeprefix(f"{f.arch.name}.")], GGUFValueType.UINT32
        if vtype == GGUFValueType.ARRAY:
            writer.add_key_value(key, value, vtype, sub_type=field.types[-1])
        else:
            writer.add_key_value(key, value, vtype)
    vocab = int(next(t for t in f.reader.tensors if t.name == "token_embd.weight").shape[1])
    rng = np.random.default_rng(0)
    for t in shape_tensors(hidden, layers, ffn, heads, kv_heads, vocab, ftype, tied=True):
        if len(t.shape) == 1:
            writer.add_tensor(t.name, np.ones(t.shape[0], dtype=np.float32))
        else:
            writer.add_tensor(t.name, random_blocks(t.tensor_type.name, t.shape[1], t.shape[0], rng),
                              raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def loaded_bytes(path: Path, dtype: str):
    from mola.models.loader import load_base_model

    mx.clear_cache()
    before = mx.get_active_memory()
    model = load_base_model(str(path), dtype=dtype).model
    mx.eval(model.parameters())
    return model, mx.get_active_memory() - before


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ftype", default="Q4_K_M", choices=["Q4_K_M", "Q5_K_M"])
    p.add_argument("--batch", nargs="+", type=int, default=[1, 8])
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "kquants.json"))
    a = p.parse_args()

    from mola.models import fit
    from mola.models.fetch import ensure_smollm
    from mola.models.gguf_file import open_gguf

    dtypes = ("keep", "float32")
    with tempfile.TemporaryDirectory() as tmp:
        path = write_like(ensure_smollm(), Path(tmp) / f"smollm2-1.7b-shape-{a.ftype}.gguf", a.ftype)
        tensors = open_gguf(path).reader.tensors
        measured = {"file_bytes": path.stat().st_size}
        models = {}
        for d in dtypes:
            models[d], active = loaded_bytes(path, d)
            plan = fit.plan(tensors, d)
            measured[d] = {"active_bytes": active, "planned_bytes": plan.total, "groups": plan.groups}
        runs = {d: {b: [] for b in a.batch} for d in dtypes}
        for r in range(a.repeats):
            for b in a.batch:
                for d in dtypes:
                    runs[d][b].append(decode_rate(models[d], b, a.steps))
                    print(f"repeat {r + 1}: {d:8s} batch {b}: {runs[d][b][-1]:7.1f} tok/s", file=sys.stderr)
    speed = {d: {str(b): round(statistics.median(v), 1) for b, v in by.items()} for d, by in runs.items()}
    ratio = {str(b): round(statistics.median(k / f for k, f in zip(runs["keep"][b], runs["float32"][b])), 2)
             for b in a.batch}
    planned = {}
    for name, shape in SHAPES.items():
        ts = shape_tensors(*shape, a.ftype)
        planned[name] = {"file_bytes": file_bytes(ts), **{d: fit.plan(ts, d).total for d in ("keep", "float32", "float16")}}
    gib = 2 ** 30
    print(f"\nSmolLM2-1.7B shape, {a.ftype}: file {measured['file_bytes'] / 2**20:.1f} MiB")
    for d in dtypes:
        print(f"  {d:8s} active {measured[d]['active_bytes'] / 2**20:7.1f} MiB (planned "
              f"{measured[d]['planned_bytes'] / 2**20:7.1f}), decode " +
              ", ".join(f"batch {b}: {speed[d][str(b)]} tok/s" for b in a.batch))
    print("  keep / float32 tok/s (paired medians): " + ", ".join(f"batch {b}: {ratio[str(b)]}" for b in a.batch))
    for name, row in planned.items():
        print(f"{name} {a.ftype}: file {row['file_bytes'] / gib:.2f} GiB; mola keep {row['keep'] / gib:.2f}, "
              f"float16 {row['float16'] / gib:.2f}, float32 {row['float32'] / gib:.2f} GiB")
    result = {"ftype": a.ftype, "device": str(mx.default_device()), "machine": platform.machine(),
              "openblas": openblas_loaded(), "mlx": mx.__version__, "steps": a.steps, "repeats": a.repeats,
              "smollm2_1.7b_shape": {**measured, "tok_per_s_median": speed, "keep_over_float32_median": ratio,
                                "tok_per_s_runs": {d: {str(b): v for b, v in by.items()} for d, by in runs.items()}},
              "planned": planned}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"written to {a.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
