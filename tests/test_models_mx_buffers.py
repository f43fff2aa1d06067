"""mola/models/mx_buffers.py: a numpy view written by a repack is the MLX array the
model holds (the same memory, no copy), and anything else is copied; the heap's
settings during a conversion are put back after it."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mola.models import mx_buffers


@pytest.mark.parametrize("dtype", [np.uint32, np.float32, np.float16, np.uint8])
def test_a_written_view_is_the_mlx_array_as_mx_gives(dtype):
    view = mx_buffers.empty((6, 8), dtype)
    assert view.flags.writeable and view.flags.c_contiguous and view.shape == (6, 8) and view.dtype == dtype
    view[:] = np.arange(48).reshape(6, 8).astype(dtype)
    a = mx_buffers.as_mx(view.reshape(3, 16))  # a repack's reshape of its output
    assert a.shape == (3, 16) and np.array_equal(np.array(a), np.arange(48).reshape(3, 16).astype(dtype))
    assert mx_buffers.owner(view) is not None
    # the same memory: a write through the view after as_mx shows in the MLX array
    view[0, 0] = 7
    assert np.array(a)[0, 0] == 7


def test_two_views_are_two_arrays():
    a, b = mx_buffers.empty((4, 4), np.uint32), mx_buffers.empty((4, 4), np.uint32)
    a[:] = 1
    assert (b == 0).all() and (np.array(mx_buffers.as_mx(b)) == 0).all()


def test_what_is_not_a_whole_view_is_copied():
    view = mx_buffers.empty((4, 4), np.float32)
    view[:] = 3
    part, plain, strided = view[1:], np.ones((4, 4), np.float32), view[:, ::2]
    for x in (part, plain, strided, view.view(np.uint32)):
        assert mx_buffers.owner(x) is None
        copied = mx_buffers.as_mx(x)
        assert np.array_equal(np.array(copied), x)
        x[...] = 5 if x.dtype == np.float32 else 0  # the copy does not follow
        assert not np.array_equal(np.array(copied), x)


def test_a_dtype_mlx_cannot_hold_is_plain_numpy():
    x = mx_buffers.empty((2, 2), np.float64)
    assert mx_buffers.owner(x) is None and x.dtype == np.float64


def test_the_heap_is_trimmed_and_its_threshold_set_back_after_a_conversion(monkeypatch):
    calls = []

    class Libc:
        def mallopt(self, param, value):
            calls.append((param, value))
            return 1

        def malloc_trim(self, pad):
            calls.append(("trim", pad))
            return 1

    monkeypatch.setattr(mx_buffers, "_glibc", lambda: Libc())
    with mx_buffers.reused_heap():
        assert calls == [(mx_buffers.M_MMAP_THRESHOLD, mx_buffers.HELD_MMAP_THRESHOLD),
                         (mx_buffers.M_TRIM_THRESHOLD, mx_buffers.HELD_TRIM_THRESHOLD)]
    assert calls[2:] == [(mx_buffers.M_TRIM_THRESHOLD, mx_buffers.AFTER_TRIM_THRESHOLD), ("trim", 0)]
    monkeypatch.undo()
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "1")
    assert mx_buffers._glibc() is None  # malloc tuned by the environment: left alone
