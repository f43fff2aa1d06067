"""Host memory as base models come and go: a model's size before and after
its load, and the heap given back after an unload (glibc's malloc; no-ops
elsewhere)."""

from __future__ import annotations

import ctypes
import os
import sys
from pathlib import Path


def planned_bytes(model: str, dtype: str) -> int:
    """Bytes a local model will take once loaded with ``dtype``, before
    loading it: a GGUF file's plan (models/fit.py: each tensor kept or
    dequantized as the load will), else its weight files. 0 for a hub id."""
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        try:
            # the tensor table alone: gguf-py's reader takes seconds over a large vocabulary
            # (2 s of a 1.7B model's first start, before its load began), mola's full one 0.2 s
            from ..adapters.formats.gguf_reader import GGUFTensorTable
            from ..models.fit import free_bytes, plan
            from ..models.loader import resolve_dtype

            tensors = GGUFTensorTable(str(path)).tensors
            return plan(tensors, resolve_dtype(dtype, True, tensors, free_bytes())).total
        except Exception:  # a broken file: its load says why
            return file_bytes(model)
    return file_bytes(model)


def file_bytes(model: str) -> int:
    """Bytes of a local model's weight files (0 for a hub id)."""
    path = Path(model).expanduser()
    if path.is_file():
        return path.stat().st_size
    if path.is_dir():
        return sum(f.stat().st_size for pattern in ("*.safetensors", "*.gguf") for f in path.glob(pattern))
    return 0


def trim_heap() -> None:
    """Give the heap's free pages back to the system (glibc's malloc_trim; a
    no-op elsewhere). An unloaded base's host buffers (a GGUF file's
    dequantization, its tokenizer) are freed on its engine thread's malloc
    arena, which the next engine thread does not reuse: without this, RSS
    grows by hundreds of MB a load/unload cycle of a real model."""
    if not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc (musl has no malloc_trim)
        pass


M_ARENA_MAX = -8  # glibc's mallopt parameter


def limit_malloc_arenas(arenas: int = 2) -> None:
    """Cap glibc's malloc arenas (a no-op elsewhere, or when MALLOC_ARENA_MAX
    is set). Each engine thread a load starts would otherwise get an arena
    of its own, and what the unloaded bases' threads freed stays in theirs:
    with the cap, RSS over 6 load/unload cycles of the real model and the
    bench model grew 2.6% instead of 6.8% (benchmarks/bases.py --parts cycles)."""
    if not sys.platform.startswith("linux") or "MALLOC_ARENA_MAX" in os.environ:
        return
    try:
        ctypes.CDLL(None).mallopt(M_ARENA_MAX, arenas)
    except (OSError, AttributeError):
        pass


def weight_bytes(model) -> int:
    """Bytes of a model's parameters (its slot packs included once installed)."""
    from mlx.utils import tree_flatten

    return sum(v.nbytes for _, v in tree_flatten(model.parameters()))
