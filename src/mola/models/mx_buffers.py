"""Numpy views of new MLX arrays, so that a GGUF tensor's repack (codecs.py) writes its
output straight into the arrays the model will hold: ``empty`` gives the view to
write, ``as_mx`` the MLX array behind it, with no copy from numpy into MLX (the copy
and its page faults were about a fifth of a first load's conversion).

An MLX array is immutable once evaluated only by convention: the array behind a
view made here is new, evaluated, and seen by nothing else until ``as_mx`` hands it
out, so writing it through the view first is safe. Anything else ``as_mx`` is given
(a numpy array, a view of part of such an array, one of another shape in memory) is
copied, as ``mx.array`` does."""

from __future__ import annotations

import ctypes
import os
import sys
from contextlib import contextmanager

import mlx.core as mx
import numpy as np

_MX = {np.dtype(k): v for k, v in ((np.uint8, mx.uint8), (np.uint16, mx.uint16), (np.uint32, mx.uint32),
                                   (np.int8, mx.int8), (np.int16, mx.int16), (np.int32, mx.int32),
                                   (np.float16, mx.float16), (np.float32, mx.float32))}


def empty(shape, dtype) -> np.ndarray:
    """A writable, C-contiguous numpy array of ``shape`` and ``dtype`` whose memory is a
    new evaluated MLX array's (zeros until written); a plain numpy array where MLX
    cannot hold ``dtype`` or does not lend its memory as one contiguous writable block."""
    dtype = np.dtype(dtype)
    kind = _MX.get(dtype)
    if kind is None:
        return np.empty(shape, dtype)
    a = mx.zeros(shape, kind)
    mx.eval(a)
    view = np.asarray(memoryview(a))
    if not (view.flags.c_contiguous and view.flags.writeable and view.shape == tuple(shape) and view.dtype == dtype):
        return np.empty(shape, dtype)
    return view


def owner(x: np.ndarray) -> mx.array | None:
    """The MLX array whose memory ``x`` is, all of it in order, or None."""
    base = x
    while isinstance(base, np.ndarray):
        base = base.base
    if not (isinstance(base, memoryview) and isinstance(base.obj, mx.array)):
        return None
    a = base.obj
    whole = np.asarray(base)
    same = (x.flags.c_contiguous and x.nbytes == whole.nbytes and x.dtype == whole.dtype
            and x.__array_interface__["data"][0] == whole.__array_interface__["data"][0])
    return a if same else None


def as_mx(x: np.ndarray) -> mx.array:
    """``x`` as an MLX array: the one made by :func:`empty` that it is, reshaped (no
    copy), else a copy (``mx.array``)."""
    a = owner(x) if isinstance(x, np.ndarray) else None
    if a is None:
        return mx.array(x)
    return a.reshape(x.shape)


# glibc's mallopt parameters, and the values held while a file converts (see reused_heap)
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
HELD_MMAP_THRESHOLD = 32 << 20  # glibc's largest dynamic threshold: temporaries below it come from the heap
HELD_TRIM_THRESHOLD = 1 << 30  # freed heap memory up to this is kept for the next chunk's temporaries
AFTER_TRIM_THRESHOLD = 64 << 20  # twice the mmap threshold, as glibc's dynamic rule sets it
_TUNED = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "GLIBC_TUNABLES")


@contextmanager
def reused_heap():
    """While a file converts, glibc's malloc keeps the memory the repacks' temporaries
    free for the next chunk's, instead of unmapping or trimming it and faulting new
    zeroed pages in for each (2-3 page faults a page of output, where one is the
    least: the output's own); afterwards the heap is trimmed. A no-op but on glibc,
    or where the environment tunes malloc itself."""
    libc = _glibc()
    if libc is None:
        yield
        return
    libc.mallopt(M_MMAP_THRESHOLD, HELD_MMAP_THRESHOLD)
    libc.mallopt(M_TRIM_THRESHOLD, HELD_TRIM_THRESHOLD)
    try:
        yield
    finally:
        libc.mallopt(M_TRIM_THRESHOLD, AFTER_TRIM_THRESHOLD)
        libc.malloc_trim(0)


def _glibc():
    if not sys.platform.startswith("linux") or any(k in os.environ for k in _TUNED):
        return None
    try:
        libc = ctypes.CDLL(None)
        return libc if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None
    except OSError:
        return None
