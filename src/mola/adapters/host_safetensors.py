"""Safetensors read on the host, with numpy, into evaluated MLX arrays (a
push's body is written the same way by mola.client.write_safetensors).

``mx.load`` gives lazy arrays whose read runs as MLX tasks. On the adapter
reader thread those tasks queue in the same scheduler as the engine's decode
steps, so under traffic a read waits behind the step in flight (a pushed
body, read through Python file callbacks, took 17 ms idle and 45 ms beside a
busy engine; benchmarks/README.md). Here the bytes are parsed with numpy
and copied into MLX arrays that are evaluated from the start (``mx.array``
of a numpy array runs no task). bfloat16, which numpy lacks, crosses as its
bits: one cheap view each, evaluated together by the caller.

Anything this reader does not take (another dtype, a malformed header)
returns None, and the caller falls back to ``mx.load``, whose messages
name what is wrong.
"""

from __future__ import annotations

import json
import struct

import mlx.core as mx
import numpy as np

# safetensors dtype -> (numpy dtype read, MLX view after the copy, or None)
_DTYPES = {
    "F32": (np.float32, None),
    "F16": (np.float16, None),
    "BF16": (np.uint16, mx.bfloat16),
}


def read_safetensors(data: bytes) -> tuple[dict[str, str], dict[str, mx.array]] | None:
    """(metadata, tensors) of a safetensors file's bytes, or None when it
    holds anything but float32/float16/bfloat16 tensors or is malformed."""
    try:
        (n,) = struct.unpack_from("<Q", data, 0)
        header = json.loads(data[8 : 8 + n])
    except (struct.error, ValueError, UnicodeDecodeError):
        return None
    if not isinstance(header, dict):
        return None
    metadata = header.pop("__metadata__", None) or {}
    base, size = 8 + n, len(data) - 8 - n
    tensors = {}
    for key, info in header.items():
        try:
            np_dtype, view = _DTYPES[info["dtype"]]
            shape, (begin, end) = [int(d) for d in info["shape"]], info["data_offsets"]
        except (KeyError, TypeError, ValueError):
            return None
        count = int(np.prod(shape, dtype=np.int64))
        if not (0 <= begin <= end <= size and end - begin == count * np.dtype(np_dtype).itemsize):
            return None
        host = (np.frombuffer(data, dtype=np_dtype, count=count, offset=base + begin) if count
                else np.zeros(0, dtype=np_dtype)).reshape(shape)
        array = mx.array(host)  # a copy, evaluated: no MLX task
        tensors[key] = array.view(view) if view is not None else array
    return metadata, tensors


def read_safetensors_file(path: str) -> dict[str, mx.array] | None:
    """The tensors of a safetensors file, read as :func:`read_safetensors`
    reads bytes; None when it cannot (the caller falls back to ``mx.load``)."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError:
        return None
    read = read_safetensors(data)
    return None if read is None else read[1]

