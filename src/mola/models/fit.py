"""Will a GGUF model fit, before a byte of it is read: the memory each group of its
tensors takes once loaded in a given ``--dtype``, from the tensor types and shapes
alone (codecs.held_nbytes), checked against the memory free; the codecs mola can
read at all; and what ``--dtype auto`` picks on a CPU (float32 where it fits, else
the file's codecs kept). The loader logs the plan after loading, and mola validate
prints it."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

from ..errors import ModelLoadError
from .codecs import FLOATS, KEPT, codec_name, held_nbytes, is_kept
from .gguf import DTYPES, keep_dtype

# --dtype auto on a CPU computes in float32 only where that leaves a quarter of the free
# memory to the KV caches, the adapter packs (sized to the adapters loaded, so not counted
# here: each growth is checked when it comes, engine/memory.py) and the rest of the process.
AUTO_FLOAT32_SHARE = 0.75
_GROUPS = (
    ("embedding", re.compile(r"token_embd\.")),
    ("output", re.compile(r"output\.")),
    ("experts", re.compile(r"blk\.\d+\.ffn_[a-z_]*(exps|gate_inp)[a-z_]*\.")),
    ("norms, biases", re.compile(r".*(norm|\.bias$|sinks)")),
    ("attention", re.compile(r"blk\.\d+\.attn_")),
    ("feed-forward", re.compile(r"blk\.\d+\.ffn_")),
)


def tensor_group(name: str) -> str:
    """``blk.3.attn_q.weight`` -> "attention"; the group a tensor's memory is told in."""
    return next((group for group, pattern in _GROUPS if pattern.match(name)), "other")


@dataclass(frozen=True)
class MemoryPlan:
    dtype: str  # --dtype: "keep" or a float dtype's name
    compute: str  # the dtype the model computes in
    # group -> {"Q4_K kept" / "Q6_K -> float32" / "F32 -> float32": bytes}
    groups: dict[str, dict[str, int]] = field(default_factory=dict)

    @property
    def total(self) -> int:
        return sum(sum(parts.values()) for parts in self.groups.values())

    def lines(self) -> list[str]:
        """One line a group: its bytes and what each codec became."""
        out = []
        for group, parts in self.groups.items():
            what = ", ".join(f"{k} {mib(v)}" for k, v in sorted(parts.items(), key=lambda kv: -kv[1]))
            out.append(f"{group:<14} {mib(sum(parts.values())):>10}  ({what})")
        return out


def mib(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB"


def gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def plan(tensors, dtype: str) -> MemoryPlan:
    """The memory ``tensors`` (gguf-py ReaderTensors) take loaded in ``dtype``
    ("keep" or a key of gguf.DTYPES), by group and codec."""
    keep = dtype == "keep"
    matrices = {codec_name(t.tensor_type) for t in tensors if len(t.shape) > 1}
    compute = keep_dtype(matrices) if keep else DTYPES[dtype]
    size = compute.size
    groups: dict[str, dict[str, int]] = {}
    for t in tensors:
        codec = codec_name(t.tensor_type)
        kept = keep and is_kept(codec, len(t.shape))
        what = f"{codec} kept" if kept else f"{codec} -> {str(compute).split('.')[-1]}"
        parts = groups.setdefault(tensor_group(t.name), {})
        parts[what] = parts.get(what, 0) + held_nbytes(t.tensor_type, t.shape, size, keep)
    return MemoryPlan(dtype, str(compute).split(".")[-1], groups)


def unreadable_codecs(tensors) -> dict[str, str]:
    """{codec: a tensor stored in it} for the codecs neither kept nor dequantized by
    gguf-py (Q8_1, Q8_K, integers, F64): a file holding one is refused at start."""
    from gguf import GGML_QUANT_SIZES, quants

    out, seen = {}, set()
    for t in tensors:
        codec = codec_name(t.tensor_type)
        if codec in seen or codec in FLOATS or codec in KEPT:
            continue
        seen.add(codec)
        try:
            _, block_bytes = GGML_QUANT_SIZES[t.tensor_type]
            quants.dequantize(np.zeros((1, block_bytes), dtype=np.uint8), t.tensor_type)
        except (NotImplementedError, KeyError, ValueError):
            out[codec] = t.name
    return out


def check_fits(path, need: MemoryPlan, free: int | None, kept: MemoryPlan | None = None) -> None:
    """ModelLoadError, with the numbers, unless ``need`` fits the ``free`` bytes;
    ``kept``: the same file under --dtype keep, offered when it would fit."""
    if free is None or need.total <= free:
        return
    dequantized = sorted({what for parts in need.groups.values() for what in parts if " -> " in what})
    hint = (f"; --dtype keep holds it in {gib(kept.total)}" if kept is not None and kept.total <= free
            and kept.total < need.total else "")
    raise ModelLoadError(
        f"{path} needs {gib(need.total)} as --dtype {need.dtype} ({', '.join(dequantized)}), but only "
        f"{gib(max(free, 0))} of memory is free{hint}. Nothing was loaded.")


def auto_dtype(tensors, free: int | None) -> str:
    """--dtype auto for a GGUF file on a CPU: float32 (MLX's quantized matmul is slow
    there, benchmarks/gguf_dtype.py) where it fits AUTO_FLOAT32_SHARE of the free
    memory, else the file's codecs kept."""
    if free is None or plan(tensors, "float32").total <= AUTO_FLOAT32_SHARE * free:
        return "float32"
    return "keep"


def free_bytes() -> int | None:
    """Bytes free for a model: on a GPU what MLX recommends for its working set less
    what it holds; on a CPU the system's available memory. None when it cannot be told."""
    if mx.default_device() == mx.gpu:
        info = mx.device_info()
        limit = info.get("max_recommended_working_set_size") or info.get("memory_size")
        if limit:
            return int(limit) - mx.get_active_memory()
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None
